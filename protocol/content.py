"""What a job's files are, wherever they sit: the trees behind `data.source`, `model.path` and
`model.adapters`.

Identity is by content and by paths relative to a tree's root, never by absolute paths, user names
or mount points: `~/corpus/*.txt` on alice's Mac and on bob's names two folders with the same
files, so it is the same data. `dpctl submit` hashes these trees (dpool.staging.manifest) and
records their digests in the job (`[content]`); a node serves the job only from files that match
them: its own copy at the job's path, or the pool's verified copy in its cache.

The root of a source:
- a folder: the folder (its .txt and .jsonl files, at any depth);
- a glob (`~/corpus/**/*.txt`): the folder before the first part with a wildcard;
- one file: the folder it is in.
An mlx_lm data folder's tree is its train.jsonl, valid.jsonl and test.jsonl; a model folder's tree
is every file in it except hidden ones (`.git`, `.cache`); the adapters' tree is adapters.safetensors
and adapter_config.json of an adapter folder, or the one .safetensors file `model.adapters` names.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable
from pathlib import Path

from dpool.protocol.jobspec import JobSpec, data_files, data_location, model_location

WILDCARDS = frozenset("*?[")
LM_DATA_FILES = ("train.jsonl", "valid.jsonl", "test.jsonl")
ADAPTER_FILES = ("adapters.safetensors", "adapter_config.json")
# A trainer's refusal when its machine's copy of a tree does not hash to the job's digest
# (trainer/sameinput.py); its dpd then checks its copy in full (daemon/nodestage.py `verify`).
NOT_THE_CONTENT = "this machine's copy is not the job's content"


def source_root(resolved: str) -> Path:
    """The folder a resolved source's files are named relative to (see the module's docstring)."""
    parts = Path(resolved).parts
    for i, part in enumerate(parts):
        if WILDCARDS & set(part):
            return Path(*parts[:i]) if i else Path(".")
    path = Path(resolved)
    return path if path.is_dir() or not path.suffix else path.parent


def data_tree(spec: JobSpec) -> tuple[Path, list[Path]] | None:
    """The data's root on this machine and its files (None: the built-in 'stdlib', a Hugging Face
    dataset, which each node loads itself, or no such path)."""
    if spec.data.source == "stdlib":  # data.hf_dataset leaves it so
        return None
    if spec.model.kind == "mlx_lm":
        where, folder = data_location(spec)
        if where != "dir":
            return None
        root = Path(folder)
        files = [root / name for name in LM_DATA_FILES if (root / name).is_file()]
    else:
        root = source_root(spec.resolved_source())
        files = [Path(p) for p in data_files(spec)]
    return (root, files) if files else None


def model_tree(spec: JobSpec) -> tuple[Path, list[Path]] | None:
    """An mlx_lm model folder on this machine and its files (None: a repo id, or no such folder)."""
    if spec.model.kind != "mlx_lm":
        return None
    where, path = model_location(spec)
    root = Path(path)
    if where != "dir" or not root.is_dir():
        return None
    files = []
    for folder, dirs, names in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(folder, n) for n in sorted(names) if not n.startswith(".")]
    return (root, files) if files else None


def adapters_tree(spec: JobSpec) -> tuple[Path, list[Path]] | None:
    """The adapters an mlx_lm job starts from, on this machine (None: none named, or not here)."""
    if spec.model.kind != "mlx_lm" or spec.model.adapters is None:
        return None
    path = Path(spec.resolve(spec.model.adapters))
    if path.is_file():
        return path.parent, [path]
    files = [path / name for name in ADAPTER_FILES if (path / name).is_file()]
    return (path, files) if (path / ADAPTER_FILES[0]) in files else None


# Each tree a job may name by content: its `[content]` field, the job-file key that names it, and
# its files on this machine.
TREES: tuple[tuple[str, str, Callable[[JobSpec], tuple[Path, list[Path]] | None]], ...] = (
    ("data", "data.source", data_tree),
    ("model", "model.path", model_tree),
    ("adapters", "model.adapters", adapters_tree),
)


def staged(spec: JobSpec, data_dir: Path | None, model_dir: Path | None, adapters_dir: Path | None = None) -> JobSpec:
    """The job as this node runs it: its sources replaced by the folders that hold their verified
    trees here. The training hash is unchanged (it counts the content digests, not the paths), and
    so are the data's split and order (documents are named relative to the root)."""
    data, model = spec.data, spec.model
    if data_dir is not None:
        source = str(data_dir) if spec.model.kind == "mlx_lm" else _same_pattern(spec, data_dir)
        data = dataclasses.replace(data, source=source)
    if model_dir is not None:
        model = dataclasses.replace(model, path=str(model_dir))
    if adapters_dir is not None and model.adapters is not None:
        named = Path(spec.model.adapters).name  # a file keeps its name inside the tree; a folder is the tree
        inside = adapters_dir / named if (adapters_dir / named).is_file() else adapters_dir
        model = dataclasses.replace(model, adapters=str(inside))
    return dataclasses.replace(spec, data=data, model=model)


def tree_names(spec: JobSpec, data_dir: Path | None, model_dir: Path | None, adapters_dir: Path | None = None) -> list[tuple[str, str]]:
    """(a folder `staged` put in place of a source, the source as the job file names it): a
    message about a file in the folder (a bad data line, a layer the model lacks) names the path
    the user wrote (`~/corpus/notes.jsonl:2`), not the cache's."""
    out = []
    if data_dir is not None:
        out.append((str(data_dir), spec.data.source if spec.model.kind == "mlx_lm" else str(source_root(spec.data.source))))
    if model_dir is not None:
        out.append((str(model_dir), spec.model.path))
    if adapters_dir is not None and spec.model.adapters is not None:
        named = Path(spec.model.adapters)
        out.append((str(adapters_dir), str(named.parent) if (adapters_dir / named.name).is_file() else spec.model.adapters))
    return out


def _same_pattern(spec: JobSpec, tree: Path) -> str:
    """The source's pattern, rooted at `tree` instead of its own root: a folder stays a folder, a
    glob keeps its wildcards, one file keeps its name (the tree holds exactly the matched files)."""
    resolved = spec.resolved_source()
    rest = os.path.relpath(resolved, source_root(resolved))
    return str(tree) if rest == "." else glob.escape(str(tree)) + os.sep + rest
