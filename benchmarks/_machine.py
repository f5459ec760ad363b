"""The machine and software a benchmark ran on, for the ``machine`` field of ``results/*.json``."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def version(*dists: str) -> str:
    """Installed version of the first of ``dists`` that is installed, else ``"not installed"``."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_sha() -> str:
    """Short commit of the checkout, or ``"no commit"``."""
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no commit"


def machine_description(parallelism: str, libraries: Sequence[str | tuple[str, ...]] = ()) -> str:
    """CPU (and GPU when present), cores, memory, OS, Python, our version and commit, library versions.

    Args:
        parallelism: how the run used the cores, e.g. ``"2 ranks x 1 thread"``.
        libraries: distribution names (a tuple: alternatives, the first installed is reported).
    """
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"; GPU {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    libs = ", ".join(f"{lib if isinstance(lib, str) else lib[0]} {version(*((lib,) if isinstance(lib, str) else lib))}"
                     for lib in libraries)
    return (f"{cpu_model()}, {os.cpu_count()} logical cores ({parallelism}), {mem_gb:.0f} GiB{gpu}; "
            f"{platform.platform()}; Python {platform.python_version()}; cluster-kernels {version('cluster-kernels')} "
            f"(git {git_sha()})" + (f"; {libs}" if libs else ""))
