"""What a node tells the pool about itself, found without importing MLX (the daemon never does)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Any

from dpool.daemon.netif import interface_of


def _chip() -> str:
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _backend() -> str:
    if sys.platform == "darwin":
        return "metal"
    if _version("mlx-cuda") or _version("mlx_cuda"):
        return "cuda"
    return "cpu"


def node_info(*, slots: int, advertise: str) -> dict[str, Any]:
    return {
        "platform": f"{sys.platform}-{platform.machine()}",
        "chip": _chip(),
        "cpus": os.cpu_count() or 1,
        "memory_bytes": _memory_bytes(),
        "mlx_version": _version("mlx") or "",
        "backend": _backend(),
        "python": platform.python_version(),
        "advertise": advertise,
        "slots": slots,
        "pid": os.getpid(),
        "interface": interface_of(advertise) or "",  # which link the ring uses: Thunderbolt, Ethernet, Wi-Fi
    }
