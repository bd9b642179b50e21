"""An optimized BLAS for Linux CPU workers.

`mlx[cpu]` wheels on Linux bundle the reference BLAS (~5 GFLOP/s for a 1024^2 float32 matmul);
Debian's OpenBLAS, preloaded, serves the same symbols at ~270 GFLOP/s and makes a training step
~6x faster. The loader reads LD_PRELOAD only at process start, so the trainer re-executes itself
once with it set (same PID, so a supervising daemon does not notice). `DPOOL_BLAS=reference`
turns this off; `DPOOL_BLAS=/path/to/libopenblas.so` picks a library.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
MARK = "DPOOL_BLAS_PRELOADED"


def mlx_uses_reference_blas() -> bool:
    """True when the installed mlx wheel bundles the reference BLAS (the Linux `mlx[cpu]` wheel)."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    site = os.path.dirname(next(iter(spec.submodule_search_locations)))
    return bool(glob.glob(os.path.join(site, "mlx_cpu.libs", "libblas*.so*")))


def find_openblas() -> str | None:
    choice = os.environ.get("DPOOL_BLAS", "")
    if choice and choice not in ("auto", "openblas"):
        return choice if os.path.isfile(choice) else None
    arch = os.uname().machine
    for pattern in CANDIDATES:
        path = pattern.format(arch=arch)
        if os.path.isfile(path):
            return path
    return None


def preload_env(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment to re-exec with, or None when nothing should change."""
    env = dict(os.environ if env is None else env)
    if sys.platform != "linux" or env.get(MARK) or env.get("DPOOL_BLAS") == "reference":
        return None
    if not mlx_uses_reference_blas():
        return None
    lib = find_openblas()
    if lib is None or lib in env.get("LD_PRELOAD", ""):
        return None
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[MARK] = lib
    return env


def reexec_with_openblas(module: str, argv: list[str]) -> None:
    """Replace this process with itself plus the preload (returns only when nothing changes)."""
    env = preload_env()
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def active_blas() -> str:
    """The BLAS this process computes with: the OpenBLAS preloaded (by the re-exec, or by the user's
    own LD_PRELOAD), else the wheel's bundled one."""
    preloaded = [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if "openblas" in os.path.basename(p)]
    return os.environ.get(MARK) or (preloaded[0] if preloaded else "bundled")
