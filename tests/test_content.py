"""What a job's trees are (protocol/content.py): the files named by content, and where a node runs them from."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpool.protocol.content import adapters_tree, staged
from dpool.protocol.jobspec import parse_job


def lm_job(tmp_path: Path, adapters: str) -> object:
    doc = {"name": "a", "model": {"kind": "mlx_lm", "path": "model", "adapters": adapters}, "data": {"source": "data"},
           "content": {"adapters": "ab" * 32}}  # as submit names them: by content, so a node's copy is the same job
    return parse_job(doc, source="job.toml", base_dir=str(tmp_path))


@pytest.mark.parametrize("form", ["folder", "file"])
def test_adapters_are_a_tree_and_a_node_runs_them_from_its_copy(tmp_path: Path, form: str) -> None:
    folder = tmp_path / "adapters"
    folder.mkdir()
    (folder / "adapters.safetensors").write_bytes(b"weights")
    (folder / "adapter_config.json").write_text("{}")
    (folder / "notes.txt").write_text("not part of the adapters")
    given = "adapters" if form == "folder" else "adapters/adapters.safetensors"
    spec = lm_job(tmp_path, given)
    root, files = adapters_tree(spec)
    assert root == folder
    expected = ["adapter_config.json", "adapters.safetensors"] if form == "folder" else ["adapters.safetensors"]
    assert sorted(p.name for p in files) == expected
    cache = tmp_path / "cache" / "tree"
    cache.mkdir(parents=True)
    for p in files:
        (cache / p.name).write_bytes(p.read_bytes())
    here = staged(spec, None, None, cache)
    assert here.model.adapters == str(cache if form == "folder" else cache / "adapters.safetensors")
    assert here.training_hash() == spec.training_hash()


def test_adapters_without_their_weights_are_no_tree(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert adapters_tree(lm_job(tmp_path, "empty")) is None
    assert adapters_tree(lm_job(tmp_path, "nowhere")) is None
