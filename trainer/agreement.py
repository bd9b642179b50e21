"""Start-up agreement: every rank of a group runs the same job file with the same shares.

Ranks started by hand (`mlx.launch`, or MLX_RANK / MLX_HOSTFILE set by the user) each get their own
command line, and nothing later notices one that differs: shares of 5,3 on one rank and 4,4 on the
other train 9 sequences of a global batch of 8 (every loss wrong), and a job file with another
learning rate drifts the weights apart; every rank exits 0. So right after the group forms, before
anything is built, each rank writes what it was given into its row of a small table, and one all_sum
gives every rank the whole table (the other rows are zeros). Every rank finds the same differences
and exits 2 with the same message. Under dpd every rank gets the same job and shares, and the check
is one all_sum of a few hundred bytes on top of the group's start-up.

A row is [status, hash high, hash low, schedule high, schedule low, share of rank 0, ..., share of rank n-1]:
  status    OK, or REFUSED: this rank refused its own --shares (it says why; its peers name it, so
            no rank is left waiting for it in a later collective);
  hash      the job's training hash (`JobSpec.training_hash()`, 16 hex digits: what checkpoints keep
            as `job_hash`), in two 32-bit halves, exact in int64;
  schedule  `JobSpec.schedule_hash()`: the [eval] and [checkpoint] settings, which decide when the
            ranks meet in an all_sum beyond the step (an evaluation every 5 steps on one rank and
            every 10 on the other left both waiting for good), the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpool.trainer.dist import Group

OK, REFUSED = 1, 2
HEAD = 5  # status and the two hashes' halves, before the shares


def disagreement(group: Group, training_hash: str, shares: Sequence[int] | None, schedule_hash: str = "0") -> str | None:
    """What the ranks of `group` disagree on, as the message every rank prints, or None. `shares`:
    this rank's --shares, or None where it refused them (it raises its own error after this).
    Every rank of the group must call it, at the same point (one all_sum); alone, nothing is sent."""
    world = group.size
    if world == 1:
        return None
    digest, schedule = int(training_hash[:16], 16), int(schedule_hash[:16], 16)
    row = [OK if shares is not None else REFUSED, digest >> 32, digest & 0xFFFFFFFF, schedule >> 32, schedule & 0xFFFFFFFF, *(shares or [0] * world)]
    width = HEAD + world
    table = [0] * (world * width)
    table[group.rank * width : (group.rank + 1) * width] = row
    summed = group.sum_ints(table)
    rows = [summed[r * width : (r + 1) * width] for r in range(world)]
    return describe(rows)


def describe(rows: list[list[int]]) -> str | None:
    """The message for a gathered table (one row per rank, as above), or None where all agree."""
    problems = []
    hashes = [f"{(r[1] << 32) | r[2]:016x}" for r in rows]
    if differ := [r for r in range(1, len(rows)) if hashes[r] != hashes[0]]:
        first = differ[0]
        problems.append(
            f"rank {first}'s job file differs from rank 0's (training hash {hashes[first]} vs {hashes[0]}){_more(differ)}: "
            "every rank must run the same job file"
        )
    elif differ := [r for r in range(1, len(rows)) if rows[r][3:5] != rows[0][3:5]]:
        problems.append(
            f"rank {differ[0]}'s job file differs from rank 0's in [eval] or [checkpoint]{_more(differ)}: "
            "every rank must run the same job file (they decide when the ranks meet to evaluate and checkpoint)"
        )
    refused = [r for r, row in enumerate(rows) if row[0] == REFUSED]
    if refused:
        problems.append(
            f"rank {refused[0]} refused its --shares (its own error says why){_more(refused)}: every rank must be given the same --shares"
        )
    else:
        shares = [row[HEAD:] for row in rows]
        if differ := [r for r in range(1, len(rows)) if shares[r] != shares[0]]:
            first = differ[0]
            problems.append(
                f"rank {first}'s --shares {_text(shares[first])} differ from rank 0's {_text(shares[0])}{_more(differ)}: "
                "every rank must be given the same --shares"
            )
    return "; ".join(problems) or None


def _text(shares: list[int]) -> str:
    return ",".join(str(s) for s in shares)


def _more(ranks: list[int]) -> str:
    """The ranks after the first that differ too."""
    rest = ranks[1:]
    return f" ({'rank' if len(rest) == 1 else 'ranks'} {', '.join(str(r) for r in rest)} too)" if rest else ""
