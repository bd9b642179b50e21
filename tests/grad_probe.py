"""Run as one rank (or alone): the pool's mean gradient of step 1, saved by rank 0 as .npz.

Uses the trainer's own data, model, restore and reduction code, so a test can compare the gradient
that 1 rank and N ranks with unequal shares agree on.
"""

import sys

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from dpool.protocol.jobspec import load_job
from dpool.protocol.logs import configure_logging, get_logger
from dpool.trainer.data import split_shares
from dpool.trainer.dist import Group
from dpool.trainer.loop import parse_shares
from dpool.trainer.restore import restore as _restore
from dpool.trainer.step import Stepper
from dpool.trainer.task import build_task


def main(job: str, out: str, cache: str, shares_arg: str | None) -> None:
    configure_logging("warning")
    spec = load_job(job)
    group = Group()
    shares = parse_shares(shares_arg, group.size, spec.train.global_batch)
    task = build_task(spec, __import__("pathlib").Path(cache))
    model = task.model
    opt = optim.AdamW(learning_rate=spec.train.lr)
    opt.init(model.trainable_parameters())
    _restore(spec, __import__("pathlib").Path(out + f".rank{group.rank}"), group, model, opt, get_logger())
    offset, share = split_shares(shares)[group.rank]
    micro = spec.train.micro_batch if isinstance(spec.train.micro_batch, int) else spec.train.global_batch
    stepper = Stepper(task, opt, group, micro, spec.train.grad_clip, spec.train.seed)
    names, grads, _ = stepper.reduce(task.examples(1, offset, share))
    mx.eval(grads)  # every rank must run the collective, not only the one that saves
    if group.rank == 0:
        np.savez(out, **{n: np.array(g) for n, g in zip(names, grads, strict=True)})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
