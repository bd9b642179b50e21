"""Optimized BLAS on Linux CPU: trainer tokens/s with Debian's OpenBLAS preloaded (the default where
it is installed) vs the reference BLAS bundled in the mlx[cpu] wheel (`DPOOL_BLAS=reference`).
Same job, fresh processes, interleaved trials.

    python bench/blas.py [--job examples/demo.toml] [--steps 30] [--trials 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import ROOT, run_trainer

from dpool.trainer.blas import find_openblas, mlx_uses_reference_blas


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default=str(ROOT / "examples" / "demo.toml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    if sys.platform != "linux" or not mlx_uses_reference_blas():
        print("this mlx build does not bundle the reference BLAS: nothing to compare")
        return
    lib = find_openblas()
    if lib is None:
        print("no OpenBLAS found: apt-get install libopenblas0-pthread")
        return
    fast, slow = [], []
    with tempfile.TemporaryDirectory() as tmp:
        base = dict(os.environ, DPOOL_CACHE_DIR=str(Path(tmp) / "cache"))
        run_trainer(args.job, 8, base, Path(tmp))  # token cache outside the timed runs
        for _ in range(args.trials):
            fast.append(run_trainer(args.job, args.steps, base, Path(tmp)))
            slow.append(run_trainer(args.job, args.steps, dict(base, DPOOL_BLAS="reference"), Path(tmp)))
    f, s = statistics.median(fast), statistics.median(slow)
    print(f"job: {args.job}  trials: {args.trials} x {args.steps} steps")
    print(f"reference BLAS (bundled)   {s:10.0f} tokens/s   ({', '.join(f'{x:.0f}' for x in slow)})")
    print(f"OpenBLAS ({lib})  {f:10.0f} tokens/s   ({', '.join(f'{x:.0f}' for x in fast)})")
    print(f"ratio OpenBLAS / reference: {f / s:.2f}")


if __name__ == "__main__":
    main()
