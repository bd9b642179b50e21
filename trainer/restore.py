"""Resume: agree on the newest valid checkpoint and get that state onto every rank.

Used by the trainer's loop (trainer/loop.py) and by the low-communication mode (trainer/diloco.py):
both hold a model and an optimizer-like object whose `state` is the tree a checkpoint stores.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from dpool.protocol.jobspec import JobSpec
from dpool.trainer import checkpoint as ckpt
from dpool.trainer.dist import Group
from dpool.trainer.task import source_named


class Resumed(NamedTuple):
    step: int  # the step resumed from (0: a fresh start)
    how: str  # "fresh", "local", "memory" or "broadcast"
    generation: int  # the generation of the group that wrote that checkpoint (0: a fresh start)


def restore(
    spec: JobSpec, run_dir: Path, group: Group, model, optimizer, log, memory: Path | None = None, at_most: int | None = None,
    fingerprints: dict[str, int] | None = None,
) -> Resumed:
    """Agree on the resume step (the newest valid checkpoint any rank holds, on disk or kept in
    memory) and get that state everywhere.

    Ranks that hold the same step (verified, on disk or in memory) load it; otherwise the first rank
    that holds it (rank 0 where it does) broadcasts weights and optimizer state over the collective, so a node that never saw the job
    needs nothing but the job file. `at_most`: no step past it is resumed (the daemon's record of
    the metrics ends there).
    """
    job_hash = spec.training_hash()
    stores = [run_dir] + ([memory] if memory is not None else [])
    for d in stores:
        ckpt.clean_partial(d)
    mine, found_in, written_by = 0, None, 0  # this rank's newest verified step, where (not verified twice), its generation
    skipped: list[str] = []
    disk = ckpt.newest_valid(run_dir, job_hash, log, at_most, skipped=skipped)
    kept = _newest_kept(memory, job_hash, log, at_most) if memory is not None else None
    if kept is not None and kept[0] >= (disk[0] if disk else 0):
        (mine, manifest), found_in = kept, memory  # memory first: the faster read
        written_by = _generation(manifest)
    elif disk:
        (mine, manifest), found_in = disk, run_dir
        written_by = _generation(manifest)
    # Every rank's newest verified step (whether it skipped damaged ones, and the generation that
    # wrote it), in one all_sum: the group resumes from the newest any rank holds, read by the
    # first rank that holds it. Rank 0's alone made a rank whose copy was intact drop it when rank
    # 0's was damaged.
    world = group.size
    table = [0] * (3 * world)
    table[group.rank], table[world + group.rank], table[2 * world + group.rank] = mine, int(bool(skipped)), written_by
    gathered = group.sum_ints(table)
    newest, damaged = gathered[:world], [r for r in range(world) if gathered[world + r]]
    step = max(newest)
    if step == 0 and damaged and not os.environ.get("DPOOL_WORKER_ADDR"):
        # By hand, a run whose every checkpoint is damaged is not trained again from step 0
        # (which would drop them): the user decides. Under a daemon the pool does (another
        # node's checkpoint, or step 0), and damaged ones are moved aside or dropped as below.
        if skipped:
            raise ckpt.CheckpointError(
                f"{ckpt.checkpoint_root(run_dir)}: no checkpoint verifies, so nothing to resume from and nothing was changed: "
                + "; ".join(skipped) + ". Move them aside (or delete them) to train again from step 0, or use another --run-dir"
            )
        raise ckpt.CheckpointError(
            f"no rank holds a checkpoint that verifies, and rank {damaged[0]}'s are damaged (its error names them): nothing to "
            "resume from and nothing was changed"
        )
    root = newest.index(step)  # rank 0 where it holds that step
    if mine != step:
        found_in = None
    if step > 0 and fingerprints:
        _check_same_input(spec, group, root, run_dir, found_in, step, fingerprints, log)
    # Above the resume step lies a timeline that is not resumed (a damaged newer checkpoint, or
    # ones this rank wrote in a group that went on without the others): gone before anything is
    # written, so pruning keeps what this run writes and the pool never sees them as holdings.
    for d in stores:
        dropped, moved = ckpt.drop_above(d, step, job_hash)
        if dropped:
            log.info("checkpoint.dropped", steps=dropped, resume_step=step, memory=d is memory)
        if moved:
            log.warning("checkpoint.set_aside", folders=[str(f) for f in moved], resume_step=step, memory=d is memory)
    source = found_in
    if step > 0 and source is None:
        for d in reversed(stores):  # memory first: the faster read
            try:
                ckpt.verify(d, step, job_hash)
                source = d
                break
            except ckpt.CheckpointMismatch:
                if d is memory:
                    continue
                raise
            except ckpt.CheckpointError:
                continue
    (holders,) = group.sum_ints([int(source is not None)])
    if step > 0 and holders < group.size:
        _check_same_layout(group, model, optimizer)
    local = holders == group.size
    if step > 0 and (local or group.rank == root):
        assert source is not None
        weights, opt_state = ckpt.load_arrays(source, step)
        ckpt.check_trained(weights, model, source, step)
        model.load_weights(list(weights.items()), strict=False)
        optimizer.state = tree_unflatten(list(opt_state.items()))
    if not local or step == 0:
        # The root's trained weights everywhere, bit for bit (a fresh start too: initial values
        # from the seed on rank 0). A frozen base is every rank's own, loaded from its disk.
        flat = tree_flatten(model.trainable_parameters())
        params = group.broadcast([v for _, v in flat], root)
        model.load_weights([(k, p) for (k, _), p in zip(flat, params, strict=True)], strict=False)
        if step > 0:
            # Sorted by name: the root's state came from a file, the others' from init(), in other orders.
            flat = sorted(tree_flatten(optimizer.state), key=lambda kv: kv[0])
            sent = group.broadcast([v for _, v in flat], root)
            optimizer.state = tree_unflatten([(k, v) for (k, _), v in zip(flat, sent, strict=True)])
    mx.eval(model.parameters(), optimizer.state)
    if step == 0:
        how = "fresh"
    elif not local:
        how = "broadcast"
    else:
        how = "memory" if source is memory else "local"
    return Resumed(step, how, gathered[2 * world + root] if step > 0 else 0)


def _check_same_input(
    spec: JobSpec, group: Group, root: int, run_dir: Path, found_in: Path | None, step: int, fingerprints: dict[str, int], log,
) -> None:
    """The checkpoint resumed was trained on the data and model this run reads (its manifest's
    fingerprints, checked by the rank that reads it: every rank holds rank 0's). By hand, files
    changed since refuse the resume (exit 2) rather than go on from a state of other data, as a
    checkpoint of another job file is refused; under a daemon the pool stages the job's files by
    content, and a difference (a tokenizer of another library version) is logged."""
    names = sorted(k for k in fingerprints if k != "test")  # what was trained on (every rank holds the same keys)
    changed = 0  # 1 + the index of the first that differs
    if group.rank == root and found_in is not None:
        recorded = (ckpt.read_manifest(found_in, step) or {}).get("fingerprints")
        if isinstance(recorded, dict):  # (checkpoints written before fingerprints were kept have none)
            changed = next((i + 1 for i, k in enumerate(names) if k in recorded and recorded[k] != fingerprints[k]), 0)
    (changed,) = group.broadcast([mx.array([changed], dtype=mx.int64)], root)
    changed = int(changed.item())
    if not changed:
        return
    key, source = source_named(spec, names[changed - 1])
    if os.environ.get("DPOOL_WORKER_ADDR"):
        log.warning("checkpoint.input_changed", step=step, key=key, source=source)
        return
    raise ckpt.CheckpointMismatch(
        f"{key} = {source!r}: these files are not the ones the checkpoint of step {step} was trained on "
        f"({ckpt.checkpoint_root(found_in or run_dir)}); nothing was changed. Put the files back to resume, or train "
        "from step 0 in another --run-dir"
    )


def generation_of(given: int | None, resumed: Resumed) -> int:
    """This group's generation: as its daemon numbered it, or by hand (none given) one more than
    that of the group that wrote the checkpoint it resumed (1 for a fresh start), so a run started
    again by hand counts its restarts as a pool's does."""
    if given is not None:
        return given
    return resumed.generation + 1 if resumed.step > 0 else 1


def _generation(manifest: dict) -> int:
    """The generation a checkpoint's manifest records (0 where it records none)."""
    g = manifest.get("generation")
    return g if isinstance(g, int) and not isinstance(g, bool) and g > 0 else 0


def _newest_kept(memory: Path, job_hash: str, log, at_most: int | None) -> tuple[int, dict] | None:
    """The newest state kept in memory that verifies, with its manifest (another job's is not this
    job's: skipped)."""
    try:
        return ckpt.newest_valid(memory, job_hash, log, at_most)
    except ckpt.CheckpointMismatch as e:
        log.warning("memory_state.skipped", reason=str(e))
        return None


def _check_same_layout(group: Group, model, optimizer) -> None:
    """Before a broadcast: every rank must hold the same names, shapes and dtypes, or the fused
    collective would pair mismatched buffers (and hang or corrupt) instead of failing clearly."""
    items = sorted(tree_flatten(model.trainable_parameters()), key=lambda kv: kv[0])
    items += sorted(tree_flatten(optimizer.state), key=lambda kv: kv[0])
    text = ";".join(f"{k}:{v.shape}:{v.dtype}" for k, v in items)
    mine = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    (theirs,) = group.broadcast_ints([mine])
    (differ,) = group.sum_ints([int(mine != theirs)])
    if differ:
        raise RuntimeError(
            f"{differ} rank(s) build a model or optimizer state that differs from rank 0's "
            "(different mlx or dpool versions?); cannot receive its checkpoint"
        )
