"""The per-step progress deadline of a running group. Pure: times come in as arguments.

Why a deadline at all: a frozen rank (SIGSTOP, a deadlock in the ring, a partitioned link) makes
every other rank spin inside `all_sum` forever; nothing exits and heartbeats keep coming (the
daemons are fine). Only the absence of step progress shows it.

How long to wait after step s was reported before calling the group stalled:

    allowance(s) = max(floor, factor x median(recent step intervals)) + extra(s)

- The median of the last intervals between consecutive steps, as the coordinator sees them (so
  they include the trainer -> dpd -> coordinator hops and any load on the machine), times `factor`
  (`recovery.step_timeout_factor`, default 8): a step would have to get 8x slower than its own
  recent median, for the whole allowance, to be called stalled. The median ignores the odd slow
  step (a checkpoint copy, a garbage collection).
- `floor` (`recovery.step_timeout_floor_s`, default 2 s): tiny steps (milliseconds) would otherwise
  give sub-second deadlines that scheduling noise on a loaded machine trips. 2 s is just above the
  heartbeat expiry (1.5 s): a machine that cannot run a 10 ms step within 2 s would lose its
  heartbeats too.
- `extra(s)`: after step s the trainer may evaluate (every `eval.every_steps`) and rank 0 may
  generate a sample (every `eval.sample_every_steps`) before step s+1; the others wait for it in
  the next all_sum. Their cost is measured the first time (the allowance then is the generous
  start-up deadline, `recovery.start_timeout_s`) and then allowed `factor` times over.
- diloco (`[sync] mode = "diloco"`): ranks run their replicas' inner steps apart and meet only
  at the outer all_sum where an outer step of `inner_steps` ends (protocol/rounds.py: after the
  warm-up's `warmup_steps`), so the watch follows the slowest rank (the pool reports the lowest
  step of the live ranks), and the outer step (its all_sum and update; a gather, below, apart) is
  measured and allowed like an evaluation ("outer"). A warm-up step is an outer step of its
  own, an all_sum after every step as in sync mode: its interval is a step's, all_sum included.
- A new split (sync mode): when rank 0's balancer moves work between ranks, the step after the
  announcing one is the first under it, and its micro batches have new shapes that the compiled step
  may not have seen (a compile, seconds on a loaded machine) or may have (none). The ranks flag it in
  that step's progress (`resplit`). Being so unlike from one time to the next, its cost is not
  measured; the next step is allowed what a compile can cost, `factor` times the longest first
  step of a generation (the trainer's own measure: it compiles the step's functions) plus the
  floor, and the start-up deadline until a first step was measured. (The start-up deadline each
  time, as before, left a freeze there unnoticed for 2 minutes, and a job rebalances a few times.)
- A gather (diloco): an outer step that takes a checkpoint, or moves replicas between ranks,
  first all_sums every replica's inner optimizer state (or the moving ones'): two float32 arrays
  a parameter each for AdamW, `2 x replicas` times the parameters, where the outer all_sum sends
  them once (in `sync.dtype`). So it is allowed the measured outer step scaled by that ratio: 12x
  with 3 replicas and bfloat16 sums, 16x with 8 in float32, beyond the 8x an outer step gets, and
  on a slow link with a large model (the mode's case) a gather took longer than the outer step's
  allowance. Rank 0 knows at the start of the outer step whether it will gather (its checkpoint
  decision and its announced split are made by then) and says so with the step that ends it
  (`gather`); the last step, and a stop, always checkpoint. Not measured: its size varies.
- Before the first step of a generation the allowance is the start-up deadline (MLX's init, the
  checkpoint restore and broadcast, compiling the first step), counted from the launch.
- Once the group was asked to checkpoint and stop, no further step comes: the ranks write their
  checkpoint and exit; `STOP_MARGIN_S` more is allowed for that. After the last step a rank also
  drains its checkpoint writer and runs the test-set evaluation where the job asks for one, whose
  cost no step measures: the start-up deadline is allowed (12 s were not enough for the writer of
  a rank on a loaded machine, and a large test set takes minutes). Its exit ends the group.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

from dpool.protocol.commmodel import DTYPE_BYTES
from dpool.protocol.jobspec import JobSpec
from dpool.protocol.rounds import Rounds

RECENT = 32  # step intervals kept for the median
STOP_MARGIN_S = 10.0
UNMEASURED = frozenset({"split", "gather"})  # kinds whose cost varies from one time to the next: never measured
ETA_MAX_S = 1e11  # a status row's bound on eta_s (3,000 years): a longer estimate is none
# The ETA's pace: steps over wall time in this generation's last ETA_WINDOW_S, once the window
# spans ETA_MIN_SPAN_S. Per-step intervals are no pace: reports that arrive together (a busy
# coordinator, fast steps) read as intervals of 0, and their median as a job about to end.
ETA_WINDOW_S, ETA_MIN_SPAN_S = 30.0, 1.0


@dataclass(slots=True)
class StepWatch:
    steps: int  # the job's last step
    eval_every: int
    sample_every: int
    floor_s: float
    factor: float
    start_s: float
    started_at: float  # launch of the generation
    last_step: int | None = None  # newest step reported by any rank (None: none yet)
    last_at: float = 0.0
    recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=RECENT))
    extra: dict[str, float] = field(default_factory=dict)  # measured cost of "eval" / "sample" / "outer"
    rounds: Rounds | None = None  # diloco: where its outer steps of inner_steps end (None: sync)
    resplit_at: int | None = None  # the step whose successor runs under a new split (sync mode)
    gather_at: int | None = None  # diloco: the step whose outer step gathers replica states (rank 0's word)
    gather_ratio: float = 0.0  # diloco: a gather's bytes over the outer all_sum's
    stopping: bool = False  # asked to checkpoint and stop
    compile_s: float = 0.0  # the longest first step of a generation (compiling included); 0: none yet
    marks: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)  # (when, step): the ETA's window

    @classmethod
    def start(cls, spec: JobSpec, now: float, previous: StepWatch | None = None) -> StepWatch:
        """The watch of a newly launched generation; the previous generation's measurements carry
        over (the same model and batch: step times change with the world size, not by 8x)."""
        rec, ev = spec.recovery, spec.eval
        watch = cls(
            steps=spec.train.steps,
            eval_every=ev.every_steps,
            sample_every=ev.sample_every_steps,
            floor_s=rec.step_timeout_floor_s,
            factor=rec.step_timeout_factor,
            start_s=rec.start_timeout_s,
            started_at=now,
            rounds=Rounds(spec.sync.inner_steps, spec.sync.warmup_steps) if spec.sync.mode == "diloco" else None,
            gather_ratio=2 * spec.sync.replicas * 4 / DTYPE_BYTES.get(spec.sync.dtype, 4),
        )
        if previous is not None:
            watch.recent.extend(previous.recent)
            watch.extra.update(previous.extra)
            watch.compile_s = previous.compile_s
        return watch

    def after(self, step: int) -> list[str]:
        """What the trainer does between reporting `step` and starting the next one."""
        kinds = []
        if step % self.eval_every == 0:
            kinds.append("eval")
        if step % self.sample_every == 0:
            kinds.append("sample")
        if self.rounds is not None and self.rounds.boundary(step) and not self.rounds.warm(step):
            kinds.append("outer")
        if step == self.resplit_at:
            kinds.append("split")
        if self.rounds is not None and (step == self.gather_at or step >= self.steps or (self.stopping and self.rounds.boundary(step))):
            kinds.append("gather")
        return kinds

    def gathers(self, step: int) -> None:
        """Rank 0 said that the outer step ending at `step` gathers replica states."""
        if self.last_step is None or step > self.last_step:
            self.gather_at = step

    def observe(self, step: int, now: float, seconds: float, resplit: bool = False) -> None:
        """A rank reported `step` (which took it `seconds`) at `now`, and whether the next step runs
        under a new split; only a new highest step moves the watch. The first report of a
        generation seeds the median with the trainer's own measure of that step (compiling
        included, so on the safe side)."""
        if self.last_step is not None and step <= self.last_step:
            return
        if not self.recent and seconds > 0:
            self.recent.append(seconds)
        if self.last_step is None:
            self.compile_s = max(self.compile_s, seconds)
        if self.last_step is not None:
            interval = (now - self.last_at) / (step - self.last_step)
            kinds = self.after(self.last_step) if step == self.last_step + 1 else []
            if kinds and self.recent and UNMEASURED.isdisjoint(kinds):  # (with a split or a gather in it, nothing is)
                base = statistics.median(self.recent)
                cost = max(0.0, interval - base) / len(kinds)
                for k in kinds:
                    self.extra[k] = cost
            elif not kinds:
                self.recent.append(interval)
        self.last_step, self.last_at = step, now
        self.marks.append((now, step))
        while len(self.marks) > 2 and now - self.marks[0][0] > ETA_WINDOW_S:
            self.marks.popleft()
        if resplit:
            self.resplit_at = step

    def allowance(self) -> float:
        """Seconds allowed after the newest report before the group counts as stalled."""
        if self.last_step is None:
            return self.start_s
        base = max(self.floor_s, self.factor * statistics.median(self.recent)) if self.recent else self.start_s
        for k in self.after(self.last_step):
            if k == "gather":
                base += self._gather()
            elif k == "split":
                base += self.factor * self.compile_s + self.floor_s if self.compile_s > 0 else self.start_s
            else:
                base += self.factor * self.extra[k] + self.floor_s if k in self.extra else self.start_s
        if self.last_step >= self.steps:
            base += self.start_s
        elif self.stopping:
            base += STOP_MARGIN_S
        return base

    def _gather(self) -> float:
        """A gather's allowance: the outer step's (a warm-up step's: the median step's) times the
        gather's bytes over the outer all_sum's; the start-up deadline while neither is measured."""
        assert self.rounds is not None and self.last_step is not None
        scale = self.extra.get("outer")
        if scale is None and self.rounds.warm(self.last_step) and self.recent:
            scale = statistics.median(self.recent)
        if scale is None:
            return self.start_s
        return self.factor * self.gather_ratio * scale + self.floor_s

    def eta(self, now: float) -> float | None:
        """Seconds until the last step at this generation's pace over its last ETA_WINDOW_S (until
        that spans ETA_MIN_SPAN_S: the recent median step interval). None before either is
        measured, or when it is beyond ETA_MAX_S: 100,000 steps left at a valid step time of 1e7 s
        would be 1e12 s, a value no status row can carry."""
        if self.last_step is None:
            return None
        (t0, s0), (t1, s1) = self.marks[0], self.marks[-1]  # observed since last_step is set
        if t1 - t0 >= ETA_MIN_SPAN_S and s1 > s0:
            per_step = (t1 - t0) / (s1 - s0)
        elif self.recent:
            per_step = statistics.median(self.recent)
        else:
            return None
        # Time since the last report counts down within one step, no further: a step that takes
        # longer (a stall, an evaluation) holds the ETA at the steps after it (0 only for the last).
        eta = max(0.0, (self.steps - self.last_step) * per_step - min(now - self.last_at, per_step))
        return eta if eta <= ETA_MAX_S else None

    def deadline(self) -> float:
        return (self.started_at if self.last_step is None else self.last_at) + self.allowance()
