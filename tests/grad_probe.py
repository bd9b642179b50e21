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
from dpool.trainer.data import VOCAB_SIZE, BatchSampler, load_corpus, split_shares
from dpool.trainer.dist import Group
from dpool.trainer.loop import _restore, parse_shares
from dpool.trainer.model import build_model
from dpool.trainer.step import Stepper


def main(job: str, out: str, cache: str, shares_arg: str | None) -> None:
    configure_logging("warning")
    spec = load_job(job)
    group = Group()
    shares = parse_shares(shares_arg, group.size, spec.train.global_batch)
    corpus = load_corpus(spec, cache)
    sampler = BatchSampler(corpus.train, spec.model.context, spec.train.global_batch, spec.train.seed)
    model = build_model(spec.model, VOCAB_SIZE, spec.train.seed)
    opt = optim.AdamW(learning_rate=spec.train.lr)
    opt.init(model.trainable_parameters())
    _restore(spec, __import__("pathlib").Path(out + f".rank{group.rank}"), group, model, opt, get_logger())
    offset, share = split_shares(shares)[group.rank]
    stepper = Stepper(model, opt, group, spec.train.micro_batch if isinstance(spec.train.micro_batch, int) else spec.train.global_batch, spec.train.grad_clip)
    names, grads, _ = stepper.reduce(sampler.sequences(1, offset, share))
    mx.eval(grads)  # every rank must run the collective, not only the one that saves
    if group.rank == 0:
        np.savez(out, **{n: np.array(g) for n, g in zip(names, grads, strict=True)})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
