"""Whether every rank of a group trains the same input, and, where not, whose copy is wrong.

Each rank fingerprints what it built (the data's documents, the base model's weights, the adapters
it starts from); the group compares them in one all_sum per kind. Where they differ, someone's copy
is not the job's, and the question is whose: that node sits the job out (its rank exits 2) while
the others go on. Rank 0's copy alone was the reference once, so one damaged copy on rank 0's
machine left every good node out and the job trained on the damage.

- A job that names its files by content (`[content]`, written by `dpctl submit`): each rank hashes
  its own copy (only now, when copies differ) and compares it with the job's digest. A copy that
  is not the job's content refuses (exit 2; its dpd then checks its cache in full and fetches the
  damaged files again); ranks whose copies are intact fail as peers (exit 1).
- Otherwise (by hand, the built-in corpus): the copy most ranks hold is the reference, rank 0's on
  a tie.
"""

from __future__ import annotations

import collections

from dpool.protocol.content import adapters_tree, data_tree, model_tree
from dpool.protocol.jobspec import JobSpec
from dpool.protocol.logs import get_logger
from dpool.staging.manifest import ManifestError, scan
from dpool.trainer.data import DataError
from dpool.trainer.dist import Group
from dpool.trainer.task import source_named

log = get_logger(component="trainer")

# A fingerprint's kind -> the [content] tree it is built from ("test": test.jsonl, in the data's tree).
CONTENT_OF = {"data": "data", "test": "data", "model": "model", "adapters": "adapters"}
TREES = {"data": data_tree, "model": model_tree, "adapters": adapters_tree}


def same_everywhere(group: Group, fingerprints: dict[str, int], spec: JobSpec) -> None:
    """Every rank must train the same data on the same base model; name what differs, and leave
    out the rank(s) whose copy is wrong (module docstring)."""
    for what, mine in sorted(fingerprints.items()):
        held = group.gather_ints(mine)
        if len(set(held)) == 1:
            continue
        key, source = source_named(spec, what)
        hint = " (and, for 'stdlib', the same Python version)" if source == "stdlib" else ""
        kind = CONTENT_OF.get(what)
        expected = getattr(spec.content, kind) if kind is not None else None
        if expected is not None:
            problem = _not_the_content(spec, kind, expected)
            intact = group.gather_ints(int(problem is None))
            log.warning("input.differs", what=what, fingerprints=held, intact=intact, problem=problem)
            if 0 < sum(intact) < group.size or problem is not None:
                if problem is not None:
                    raise DataError(f"{key} = {source!r}: this machine's copy is not the job's content ({problem}); every node needs the same files")
                bad = [r for r, ok in enumerate(intact) if not ok]
                raise RuntimeError(f"rank(s) {', '.join(map(str, bad))} hold a copy of {key} = {source!r} that is not the job's content")
        counts = collections.Counter(held)
        most = max(counts.values())
        reference = next(fp for fp in held if counts[fp] == most)  # in rank order: rank 0's on a tie
        if mine != reference:
            # Bad input on this machine (exit 2): its node sits the job out, and the group
            # restarts without it instead of failing the same way again.
            raise DataError(
                f"{key} = {source!r}: this machine's {what} differs from the copy {most} of the group's {group.size} ranks "
                f"hold (rank {held.index(reference)}'s); every node needs the same files{hint}"
            )
        odd = [r for r, fp in enumerate(held) if fp != reference]
        raise RuntimeError(f"rank(s) {', '.join(map(str, odd))} hold different {what} than the other ranks for {key} = {source!r}; every node needs the same files{hint}")


def _not_the_content(spec: JobSpec, kind: str, expected: str) -> str | None:
    """None when this machine's tree of `kind` hashes to the job's digest; else what it is."""
    tree = TREES[kind](spec)
    if tree is None:
        return "no such files here"
    root, files = tree
    try:
        digest = scan(root, files).digest
    except (ManifestError, OSError) as e:
        return f"cannot read it: {e}"
    return None if digest == expected else f"its files hash to {digest[:12]}, the job's to {expected[:12]}"
