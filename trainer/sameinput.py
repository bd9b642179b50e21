"""Whether every rank of a group trains the same input, and, where not, whose copy is wrong.

Each rank fingerprints what it built (the data's documents, the base model's weights, the adapters
it starts from); the group compares them in one all_sum per kind. Where they differ, someone's copy
is not the job's, and the question is whose: that node sits the job out (its rank exits 2) while
the others go on. Rank 0's copy alone was the reference once, so one damaged copy on rank 0's
machine left every good node out and the job trained on the damage.

- A job that names its files by content (`[content]`, written by `dpctl submit`): each rank hashes
  its own copies of every tree the job names (only now, when something differs: an mlx_lm job's
  tokens depend on the model's tokenizer too) and compares them with the job's digests. A rank
  with a copy that is not the job's content refuses (exit 2; its dpd then checks its copy in full
  and fetches the damaged files again); ranks whose copies are intact fail as peers (exit 1).
- Otherwise, or where every copy is the job's content (a cache of tokens made by another version,
  say): the copy most ranks hold is the reference, rank 0's on a tie.

What the fingerprints cover decides what is caught: the data's documents (or tokens), the model's
config and its files' names and sizes, not every byte of its weights.
"""

from __future__ import annotations

import collections

from dpool.protocol.content import NOT_THE_CONTENT, TREES
from dpool.protocol.jobspec import JobSpec
from dpool.protocol.logs import get_logger
from dpool.staging.manifest import ManifestError, scan
from dpool.trainer.data import DataError
from dpool.trainer.dist import Group
from dpool.trainer.task import source_named

log = get_logger(component="trainer")

def same_everywhere(group: Group, fingerprints: dict[str, int], spec: JobSpec) -> None:
    """Every rank must train the same data on the same base model; name what differs, and leave
    out the rank(s) whose copy is wrong (module docstring)."""
    for what, mine in sorted(fingerprints.items()):
        held = group.gather_ints(mine)
        if len(set(held)) == 1:
            continue
        key, source = source_named(spec, what)
        hint = " (and, for 'stdlib', the same Python version)" if source == "stdlib" else ""
        if any(getattr(spec.content, kind) is not None for kind, _, _ in TREES):
            problem = _not_the_content(spec)
            intact = group.gather_ints(int(problem is None))
            log.warning("input.differs", what=what, fingerprints=held, intact=intact, problem=problem)
            if problem is not None:
                raise DataError(f"{problem}; every node needs the same files")
            if sum(intact) < group.size:
                bad = [r for r, ok in enumerate(intact) if not ok]
                raise RuntimeError(f"rank(s) {', '.join(map(str, bad))} hold a copy of the job's files that is not its content ({what} differs)")
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


def _not_the_content(spec: JobSpec) -> str | None:
    """None when this machine's copy of every tree the job names by content hashes to its digest;
    else which one does not, and what it is."""
    for kind, key, tree_of in TREES:
        expected = getattr(spec.content, kind)
        if expected is None:
            continue
        tree = tree_of(spec)
        if tree is None:
            return f"{key}: {NOT_THE_CONTENT} (no such files here)"
        root, files = tree
        try:
            digest = scan(root, files).digest
        except (ManifestError, OSError) as e:
            return f"{key}: {NOT_THE_CONTENT} (cannot read it: {e})"
        if digest != expected:
            return f"{key}: {NOT_THE_CONTENT} (its files hash to {digest[:12]}, the job's to {expected[:12]})"
    return None
