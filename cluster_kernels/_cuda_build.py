"""Where nvcc is, which flags compile the CUDA part of ``cluster_kernels._C``, and what a compile reports.

One source of truth for ``setup.py`` and the compile gate (tests/cluster_kernels/test_aot_compile.py through
benchmarks/ptxas_report.py), so the gate checks the ``.cu`` files exactly as the build compiles them. Every compile
runs with ptxas's report and the host compiler's warnings on (:data:`REPORT_FLAGS`) and leaves a record
(:func:`compile_record`: registers, spills and shared memory per kernel, warnings in our sources) in the compile
cache under a key of the sources, flags, architectures and nvcc's version (:func:`record_paths`): the gate reads
the build's records and compiles only what the build did not. Standard library only: this module
never imports torch or numpy and never touches a GPU. ``import cluster_kernels._cuda_build`` runs the
package's ``__init__`` (which imports torch), so setup.py loads the file by path instead::

    spec = importlib.util.spec_from_file_location("_cuda_build", ROOT / "cluster_kernels" / "_cuda_build.py")
    cuda_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_build)

Environment:
    CUDA_HOME, CUDA_PATH: toolkit roots searched for ``bin/nvcc`` (then /usr/local/cuda, then PATH).
    CLUSTER_KERNELS_CUDA_ARCH: architectures to build for, e.g. "80;90" (default: A100 and H100/H200) or "90".
    CLUSTER_KERNELS_AOT_CACHE: the compile cache (default ``~/.cache/cluster_kernels/aot``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_ARCHS = "80;90"
ARCH_ENV = "CLUSTER_KERNELS_CUDA_ARCH"
CACHE_ENV = "CLUSTER_KERNELS_AOT_CACHE"

# Flags every .cu file is compiled with (besides -c, -o, the gencode flags and the include dirs).
NVCC_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC")
# ... and these, which change no code: ptxas's resource report and the host compiler's warnings (ours have none).
REPORT_FLAGS: tuple[str, ...] = ("-Xptxas", "-v", "-Xcompiler", "-Wall,-Wextra")


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


def arch_numbers(archs: str | Sequence[int] | None = None) -> tuple[int, ...]:
    """The architectures as numbers, e.g. ``(80, 90)``; ``archs`` as in :func:`gencode_flags`.

    Raises:
        ValueError: an architecture that is not a number (e.g. "sm_90": give "90").
    """
    if archs is None:
        archs = os.environ.get(ARCH_ENV, DEFAULT_ARCHS)
    names = _arch_list(archs) if isinstance(archs, str) else [str(a) for a in archs]
    bad = [a for a in names if not a.isdigit()]
    if bad:
        raise ValueError(f"{ARCH_ENV}: compute capabilities without the dot, e.g. '80;90', got {bad}.")
    return tuple(int(a) for a in names)


def gencode_flags(archs: str | Sequence[int] | None = None) -> list[str]:
    """``-gencode`` flags: machine code for every architecture plus PTX of the last one.

    Args:
        archs: ";"- or ","-separated compute capabilities without the dot, e.g. "90" or "80;90", or numbers
            (``(80, 90)``). None: ``$CLUSTER_KERNELS_CUDA_ARCH``, else "80;90" (the A100 and the H100/H200
            generations).

    Returns:
        e.g. ``["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90"]``; the PTX lets newer GPUs run the code after a JIT compile at
        load time.

    Raises:
        ValueError: no architecture given (empty string), or one that is not a number (:func:`arch_numbers`).
    """
    arch_list = arch_numbers(archs)
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
    archs: str | Sequence[int] | None = None,
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


# ---------------------------------------------------------------------------------------------------
# What a compile reports, and the cache of reports
# ---------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The compile cache: ``$CLUSTER_KERNELS_AOT_CACHE``, else ``~/.cache/cluster_kernels/aot``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cluster_kernels" / "aot")


def record_paths(nvcc: str, archs: Sequence[int], sources: Sequence[Path], csrc: Path) -> dict[str, Path]:
    """Where the record of each source's compile is cached: a key of every file under ``csrc`` (headers
    included), the flags, the architectures and nvcc's version.

    Returns:
        ``{source file name: cache path}``.
    """
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
    tree = hashlib.sha256(f"{version}|{tuple(int(a) for a in archs)}|{NVCC_FLAGS}|{REPORT_FLAGS}".encode())
    for path in sorted(Path(csrc).rglob("*")):
        if path.is_file():
            tree.update(path.name.encode() + path.read_bytes())
    return {src.name: cache_dir() / f"cuda-{hashlib.sha256(f'{tree.hexdigest()}-{src.name}'.encode()).hexdigest()}.json"
            for src in sources}


def parse_nvcc_ptxas(log: str) -> list[dict[str, Any]]:
    """Per function (mangled name) and arch: registers, spills, stack, static shared memory, from nvcc's log."""
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'", line):
            current = {"function": m.group(1), "arch": m.group(2), "regs": 0, "spill_stores": 0, "spill_loads": 0,
                       "stack": 0, "smem_static": 0}
            out.append(current)
        elif (m := re.search(r"Function properties for (\S+)", line)) and (current is None
                                                                           or current["function"] != m.group(1)):
            current = {"function": m.group(1), "arch": current["arch"] if current else "?", "regs": 0,
                       "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem_static": 0}
            out.append(current)
        elif current is not None:
            if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
                current["stack"], current["spill_stores"], current["spill_loads"] = (int(g) for g in m.groups())
            if m := re.search(r"Used (\d+) registers", line):
                current["regs"] = int(m.group(1))
            if m := re.search(r"(\d+) bytes smem", line):
                current["smem_static"] = int(m.group(1))
    return out


def demangle(names: list[str]) -> dict[str, str]:
    """Readable names of mangled C++ symbols (``c++filt``; the names as given where it is missing)."""
    try:
        proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=60)
        pretty = proc.stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        pretty = names
    if len(pretty) != len(names):
        pretty = names
    # Without the parameter list; "(anonymous namespace)::" goes first, or the cut would end the name there.
    return {n: re.sub(r"\(.*$", "", p.replace("(anonymous namespace)::", "")) for n, p in zip(names, pretty,
                                                                                          strict=True)}


def compile_record(
    src: str | os.PathLike,
    obj: str | os.PathLike,
    include_dirs: Sequence[str | os.PathLike],
    *,
    nvcc: str,
    archs: Sequence[int],
    cache: Path,
) -> dict[str, Any]:
    """Compile one ``.cu`` for every arch in one nvcc call (its host code once), with :data:`REPORT_FLAGS`, and
    store its record at ``cache`` (its :func:`record_paths` entry) for the next reader.

    Returns:
        ``file``, ``rows`` (one per function and arch: ``function``, ``name``, ``arch``, ``target``, registers,
        spills, stack, static shared memory), ``warnings`` (lines of nvcc's output about our ``csrc/`` sources)
        and ``object_bytes``.

    Raises:
        RuntimeError: nvcc fails (the message has the command and the end of its output).
    """
    name = Path(src).name
    cmd = nvcc_command(src, obj, include_dirs, nvcc=nvcc, archs=archs, extra=REPORT_FLAGS)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {name} ({' '.join(cmd)}):\n{log[-4000:]}")
    funcs = parse_nvcc_ptxas(log)
    names = demangle([f["function"] for f in funcs])
    record = {
        "file": name,
        "rows": [{**f, "file": name, "name": names[f["function"]], "target": int(re.sub(r"\D", "", f["arch"]))}
                 for f in funcs],
        "warnings": [line for line in log.splitlines() if "csrc/" in line and "warning" in line.lower()],
        "object_bytes": Path(obj).stat().st_size if Path(obj).exists() else 0,
    }
    try:
        store_record(cache, record)
    except OSError:  # a cache that cannot be written only costs the next reader this compile
        pass
    return record


def store_record(path: Path, record: Any) -> None:
    """Cache a record, complete or not at all (concurrent compiles write side by side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
