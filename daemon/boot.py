"""dpd's entry point. For `dpd run` it starts the zygote (trainer/zygote.py) first, then imports the
daemon: the zygote's imports (MLX, numpy, the trainer: ~0.6 CPU-s) run alongside the daemon's own
(ZeroMQ, structlog, the protocol: ~0.5 s) rather than after them, so a node that joins a running
job can start its first trainer about that much sooner. Nothing heavy is imported here.
"""

from __future__ import annotations

import contextlib
import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    zygote = None
    if args[:1] == ["run"] and not {"-h", "--help"} & set(args):
        from dpool.daemon.childenv import UMASK, start_zygote, zygote_wanted

        os.umask(UMASK)  # as `dpd run` sets it: the zygote's trainers inherit it
        if zygote_wanted():
            with contextlib.suppress(OSError):  # the daemon tries again once it runs, and says why if it fails
                zygote = start_zygote()

    from dpool.daemon import cli

    return cli.main(args, zygote)


if __name__ == "__main__":
    sys.exit(main())
