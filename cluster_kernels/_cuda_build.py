"""Where nvcc is and which flags compile the CUDA part of ``cluster_kernels._C``.

One source of truth for ``setup.py`` and the compile-only test (tests/cluster_kernels/test_kmeans_cuda.py),
so the test compiles the ``.cu`` files exactly as the build does. Standard library only: this module
never imports torch or numpy and never touches a GPU. ``import cluster_kernels._cuda_build`` runs the
package's ``__init__`` (which imports torch), so setup.py loads the file by path instead::

    spec = importlib.util.spec_from_file_location("_cuda_build", ROOT / "cluster_kernels" / "_cuda_build.py")
    cuda_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_build)

Environment:
    CUDA_HOME, CUDA_PATH: toolkit roots searched for ``bin/nvcc`` (then /usr/local/cuda, then PATH).
    CLUSTER_KERNELS_CUDA_ARCH: architectures to build for, e.g. "90" (default) or "80;90".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

DEFAULT_ARCHS = "90"
ARCH_ENV = "CLUSTER_KERNELS_CUDA_ARCH"

# Flags every .cu file is compiled with (besides -c, -o, the gencode flags and the include dirs).
NVCC_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC")


def find_nvcc() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``/usr/local/cuda/bin``, then ``PATH``.

    Returns:
        The path as a string, or None when no CUDA toolkit is found.
    """
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _arch_list(archs: str) -> list[str]:
    return [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()]


def gencode_flags(archs: str | None = None) -> list[str]:
    """``-gencode`` flags: machine code for every architecture plus PTX of the last one.

    Args:
        archs: ";"- or ","-separated compute capabilities without the dot, e.g. "90" or "80;90".
            None: ``$CLUSTER_KERNELS_CUDA_ARCH``, else "90" (the H100/H200 generation).

    Returns:
        e.g. ``["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]``;
        the PTX lets newer GPUs run the code after a JIT compile at load time.

    Raises:
        ValueError: no architecture given (empty string).
    """
    if archs is None:
        archs = os.environ.get(ARCH_ENV, DEFAULT_ARCHS)
    arch_list = _arch_list(archs)
    if not arch_list:
        raise ValueError(f"no CUDA architecture in {archs!r}; set {ARCH_ENV} to e.g. '90' or '80;90'.")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arch_list]
    last = arch_list[-1]
    flags.append(f"-gencode=arch=compute_{last},code=compute_{last}")
    return flags


def nvcc_command(
    src: str | os.PathLike,
    obj: str | os.PathLike,
    include_dirs: Sequence[str | os.PathLike],
    *,
    nvcc: str | None = None,
    archs: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The nvcc command line that compiles one ``.cu`` file to an object file, as setup.py runs it.

    Args:
        src, obj: source and object file.
        include_dirs: ``-I`` directories (the build passes ``csrc`` and Python's include directory).
        nvcc: compiler path (default: :func:`find_nvcc`).
        archs: as :func:`gencode_flags`.
        extra: more flags, appended last (e.g. ``["-Xcompiler", "-Wall"]``).

    Raises:
        RuntimeError: no nvcc was given or found.
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found: install a CUDA toolkit or set CUDA_HOME to it.")
    cmd = [nvcc, "-c", str(src), "-o", str(obj), *NVCC_FLAGS, *gencode_flags(archs)]
    cmd += [f"-I{d}" for d in include_dirs]
    cmd += list(extra)
    return cmd
