"""`python -m dpool.trainer JOB.toml --run-dir DIR [--shares N,N,...]`: one rank of a job."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from dpool.trainer.blas import reexec_with_openblas

# OSErrors that mean this machine's storage failed the rank (exit EXIT_DISK: its node is blamed).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def main(argv: list[str] | None = None) -> int:
    code = _main(sys.argv[1:] if argv is None else argv)
    report = sys.modules.get("dpool.trainer.report")  # loaded by the loop
    if report is not None:
        report.close(code)  # [report]: ended or stopped, the last rows out and the W&B run finished (bounded)
    memstate = sys.modules.get("dpool.trainer.memstate")  # loaded once training was set up
    if code not in (0, 75) and memstate is not None:
        # Failing (a peer lost, a disk full): the state of the last completed step, if it is being
        # kept in memory right now, lands first, so the restart recomputes no more than one step.
        memstate.finish_writes()
    return code


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpool.trainer",
        description="Run one rank of a dpool job: alone, or as one rank of an MLX ring group "
        "(MLX_RANK and MLX_HOSTFILE set as `mlx.launch --backend ring` sets them).",
    )
    parser.add_argument("job", help="the job file (job.toml)")
    parser.add_argument("--run-dir", required=True, help="where metrics, samples and checkpoints go; {rank} is replaced by the rank")
    parser.add_argument("--shares", help="sequences of each global batch per rank, comma-separated (default: equal)")
    parser.add_argument(
        "--generation", type=int,
        help="group (re)start count, recorded in metrics (default: one more than the resumed checkpoint's, 1 for a fresh start)",
    )
    parser.add_argument(
        "--resume-max", type=int, metavar="STEP",
        help="resume from no checkpoint (or state kept in memory) past STEP: the daemon's record of the metrics has no gap then",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--warm", action="store_true",
        help="build the model and data, then wait for the daemon's worker.go (rank, generation, shares, hostfile): "
        "a trainer a dpd keeps ready for the next generation",
    )
    parser.add_argument(
        "--export", metavar="OUT",
        help="train nothing: write the newest checkpoint of --run-dir (or --step N) to OUT, as `dpctl export` does "
        "(an mlx-lm adapter directory, or a model directory)",
    )
    parser.add_argument(
        "--fuse", action="store_true",
        help="with --export (mlx_lm jobs): a model directory with the adapters fused in, as `mlx_lm fuse` writes it",
    )
    parser.add_argument("--dequantize", action="store_true", help="with --export --fuse: a dequantized model, as `mlx_lm fuse --dequantize`")
    parser.add_argument(
        "--test", metavar="OUT",
        help="train nothing: the test loss (test.jsonl) of the newest checkpoint of --run-dir (or --step N), "
        "written as OUT/test.json, as `dpctl test` reports it",
    )
    parser.add_argument("--step", type=int, help="with --export or --test: the checkpoint step (default: the newest)")
    args = parser.parse_args(argv)
    if not args.run_dir.strip():
        parser.error("--run-dir: empty; give the folder for metrics, samples and checkpoints")
    if args.step is not None and not (args.export or args.test):
        parser.error("--step goes with --export or --test")
    if args.step is not None and args.step < 1:
        parser.error(f"--step {args.step}: a checkpoint's step is 1 or more")
    if (args.fuse or args.dequantize) and not args.export:
        parser.error("--fuse and --dequantize go with --export")
    if args.dequantize and not args.fuse:
        parser.error("--dequantize goes with --fuse")
    for flag, value in (("--export", args.export), ("--test", args.test)):
        if value is not None and not value.strip():
            parser.error(f"{flag}: empty; give the folder to write to")
    if args.export and args.test:
        parser.error("--export and --test: one at a time")
    if args.warm and (args.export or args.test or args.shares):
        parser.error("--warm takes its shares from worker.go, and does not export")

    # Before MLX is imported: re-exec with an optimized BLAS where the wheel bundles the reference one.
    reexec_with_openblas("dpool.trainer", argv)
    # A spare builds at a low priority while its node trains; at worker.go it trains at the usual one.
    from dpool.trainer.priority import lower

    at_go = lower() if args.warm and os.environ.get("DPOOL_WARM_LOW", "1") != "0" else None

    from dpool.protocol.checkpoints import EXIT_DISK
    from dpool.protocol.jobspec import JobFileError, load_job
    from dpool.protocol.logs import configure_logging, get_logger
    from dpool.trainer import loop
    from dpool.trainer.checkpoint import CheckpointError, CheckpointMismatch, CheckpointWriteError
    from dpool.trainer.colocate import RingSetupError
    from dpool.trainer.data import DataError
    from dpool.trainer.lm import ModelError
    from dpool.trainer.report import ReportError

    configure_logging(args.log_level)
    try:
        spec = load_job(args.job)
        # `{rank}` as a training run reads it: this process's MLX_RANK, rank 0's folder by hand.
        own_dir = Path(args.run_dir.replace("{rank}", os.environ.get("MLX_RANK", "0").strip() or "0"))
        if args.export:
            step, files = loop.export(
                spec, own_dir, Path(args.export), args.step, source=args.job, fuse=args.fuse, dequantize=args.dequantize,
            )
            print(f"exported step {step} of {spec.name} to {args.export}: {', '.join(files)}")
            return loop.EXIT_DONE
        if args.test:
            step, _ = loop.export(spec, own_dir, Path(args.test), args.step, source=args.job, test=True)
            print(f"test loss of step {step} of {spec.name}: {(Path(args.test) / 'test.json').read_text().strip()}")
            return loop.EXIT_DONE
        return loop.run(spec, args.run_dir, args.shares, args.generation, source=args.job, warm=args.warm, resume_max=args.resume_max, at_go=at_go)
    except (JobFileError, loop.UsageError, CheckpointMismatch, DataError, ModelError, ReportError, RingSetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return loop.EXIT_BAD_INPUT
    except CheckpointError as e:  # --export of a checkpoint that does not fit its job
        print(f"error: {e}", file=sys.stderr)
        return loop.EXIT_BAD_INPUT
    except (CheckpointWriteError, OSError) as e:  # a full disk, an unwritable run dir: this rank fails, with why
        print(f"error: {e}", file=sys.stderr)
        disk = not isinstance(e, OSError) or e.errno in DISK_ERRNOS
        return EXIT_DISK if disk else loop.EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:  # e.g. "[ring] connection to a peer was lost": the daemon restarts the group
        get_logger().error("trainer.failed", error=str(e))
        # Its `error:` line too: the daemon carries it with the exit, so a group stopped by this
        # rank's exit says that it lost a peer, not only "exit code 1" (it often arrives before
        # the exit of the rank that really failed).
        print(f"error: {e}", file=sys.stderr)
        return loop.EXIT_FAILED


if __name__ == "__main__":
    code = main()
    if code not in (0, 75):
        # A failed rank leaves at once, its `error:` line out: its daemon reports the exit while the
        # group is being stopped, and a SIGTERM that came during a slow teardown (the daemon link's
        # linger, MLX) would report the stop instead of this rank's own reason.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
