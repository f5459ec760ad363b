"""Ahead-of-time compile of every GPU kernel for real targets, without a GPU: registers, spills, shared memory.

Triton kernels: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32), options=...)`` for every GPU
autotune config the kernel's prune hook keeps for a key, float32 and bfloat16 (float16 too in the full set), the
key values the dispatchers produce, for sm_80, sm_90 (sm_90a PTX, which only Triton's bundled ``ptxas-blackwell``
accepts) and sm_100 when the installed Triton compiles for it. The kernel arguments are built by the launchers'
own ``*_kernel_args`` functions on meta tensors of realistic shapes and specialised exactly as Triton's runtime does
(``native_specialize_impl``: pointer alignment, integers divisible by 16, strides equal to 1), so what is compiled
is what a GPU would compile. ptxas's ``-v`` report comes from Triton's own ptxas run (same flags).

CUDA kernels: ``nvcc -Xptxas -v`` on every ``csrc/cuda/*.cu`` with the build's flags (and the host compiler's
``-Wall -Wextra``), sm_80 and sm_90 in one call per file, so its host code is compiled once.

Results are cached per compile (``$CLUSTER_KERNELS_AOT_CACHE``, default ``~/.cache/cluster_kernels/aot``) under a
key of the kernel source, signature, options, target and compiler versions, so a second run compiles nothing
that did not change. Compiles run in ``--workers`` processes (default 2).

Usage::

    python benchmarks/ptxas_report.py                 # the full set; writes benchmarks/results/ptxas.json
    python benchmarks/ptxas_report.py --set gate      # the test suite's set (the default featurization paths)
    python benchmarks/ptxas_report.py --json OUT      # results as JSON for the caller (the test uses this)

then ``python benchmarks/render_benchmarks.py`` renders the tables into ``benchmarks/results/ptxas.md`` and a
summary paragraph into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from cluster_kernels._cuda_build import (  # noqa: E402 - the repository on the path first
    cache_dir,
    compile_record,
    demangle,
    find_nvcc,
    record_paths,
    store_record,
)

# Shared memory a block may use (opt-in maximum): A100 163 KiB; H100/H200 and B200 227 KiB.
SMEM_LIMIT = {80: 166_912, 90: 232_448, 100: 232_448}
TRITON_TARGETS = (80, 90, 100)
GATE_TARGETS = (80, 90)  # the test suite's compile gate (tests/cluster_kernels/test_aot_compile.py); the report: all
CUDA_ARCHS = (80, 90)
RESULT_PATH = REPO / "benchmarks" / "results" / "ptxas.json"

# The same compiles with the configs and kernels before issue 21 (8 configs per kernel, 64-bit tile offsets).
BEFORE = (
    "Before issue 21 (8 configs per kernel, 64-bit offsets in every tile), similar shapes (project_linear_grads "
    "at 4096 x 4096 with token weights): lm_head_features float32 "
    "k_o = 32 spilled in 8 of 8 configs on sm_80 (780 to 17 848 bytes) and 8 of 8 on sm_90 (44 to 1 344), "
    "bfloat16 k_o = 32 in 0 of 8 on sm_80 and 4 of 8 on sm_90 (32 bytes); project_linear_grads float32 64 x 64 in "
    "8 of 8 on sm_80 (652 to 23 268) and 8 of 8 on sm_90 (664 to 1 964), float32 16 x 16 in 2 and 3 of 8, "
    "bfloat16 64 x 64 in 2 and 1 of 8, bfloat16 16 x 16 in 0 and 1 of 8 (sm_80 and sm_90)."
)
LMH = "lm_head_features"
PLG = "project_linear_grads"
SHAPES = {
    # SmolLM2-135M's head (the default model of the GPU run) and a Llama-7B linear layer.
    LMH: {"n_tok": 4096, "d": 576, "vocab": 49152},
    PLG: {"n_tok": 4096, "d_in": 4096, "d_out": 11008},
}


# --------------------------------------------------------------------------------------------------
# Which compiles: keys the dispatchers produce, and the configs the prune hooks keep for them
# --------------------------------------------------------------------------------------------------


def _key_label(kernel: str, key: dict[str, Any]) -> str:
    if kernel == LMH:
        return "paper (no read-out)" if not key["proj"] else f"projected, k_o = {key['k_o']}"
    extra = ", token weights" if key.get("weights") else ""
    return f"{key['k_o']} x {key['k_i']}{extra}"


def triton_keys(which: str) -> list[dict[str, Any]]:
    """The (kernel, dtype, key) triples to compile: ``gate`` = the default featurization paths, ``full`` = all."""
    out: list[dict[str, Any]] = []
    dtypes = ("float32", "bfloat16") if which == "gate" else ("float32", "bfloat16", "float16")
    lmh_keys = [{"proj": True, "k_o": 32}, {"proj": False, "k_o": 1}]
    plg_keys = [{"k_o": 16, "k_i": 16, "weights": False}, {"k_o": 64, "k_i": 64, "weights": False}]
    if which == "full":
        lmh_keys += [{"proj": True, "k_o": k} for k in (16, 64, 128)]
        plg_keys += [{"k_o": o, "k_i": i, "weights": False} for o in (16, 32, 64) for i in (16, 32, 64)
                     if (o, i) not in ((16, 16), (64, 64))]
    for dt in dtypes:
        out += [{"kernel": LMH, "dtype": dt, "key": k} for k in lmh_keys]
        out += [{"kernel": PLG, "dtype": dt, "key": k} for k in plg_keys]
    # the lm-head features' own reduction: float32 tokens x (k_o = k_i) with an identity P_out and token weights
    for k in (32,) if which == "gate" else (16, 32, 64):
        out.append({"kernel": PLG, "dtype": "float32", "key": {"k_o": k, "k_i": k, "weights": True}})
    return out


def configs_for(kernel: str, dtype: str, key: dict[str, Any]) -> list[tuple[int, ...]]:
    """The GPU autotune configs the kernel's prune hook keeps for this key (as the kernel module lists them)."""
    if kernel == LMH:
        from cluster_kernels.lm_head_features import lm_head_block_k, vocab_configs_for

        precision = "ieee" if dtype == "float32" else "tf32"
        return vocab_configs_for(precision, lm_head_block_k(key["k_o"]), key["proj"])
    from cluster_kernels.project_linear_grads import block_k, project_configs_for

    return project_configs_for("ieee" if dtype == "float32" else "tf32", block_k(key["k_o"]), block_k(key["k_i"]))


def triton_jobs(which: str, targets: Iterable[int]) -> list[dict[str, Any]]:
    """One job per (kernel, dtype, key, config, target)."""
    jobs = []
    for case in triton_keys(which):
        for cfg in configs_for(case["kernel"], case["dtype"], case["key"]):
            for cc in targets:
                jobs.append({**case, "config": list(cfg), "cc": cc, "label": _key_label(case["kernel"], case["key"])})
    return jobs


# --------------------------------------------------------------------------------------------------
# One Triton compile (runs in a worker process without TRITON_INTERPRET)
# --------------------------------------------------------------------------------------------------


def _kernel_and_args(job: dict[str, Any]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The JITFunction, its arguments (meta tensors, ints, constexprs) and the config's block sizes."""
    import importlib

    import torch

    dtype = getattr(torch, job["dtype"])
    meta = {"device": "meta"}
    key, cfg = job["key"], job["config"]
    if job["kernel"] == LMH:
        mod = importlib.import_module("cluster_kernels.lm_head_features")
        s = SHAPES[LMH]
        h = torch.empty(s["n_tok"], s["d"], dtype=dtype, **meta)
        weight = torch.empty(s["vocab"], s["d"], dtype=dtype, **meta)
        y = torch.empty(s["n_tok"], dtype=torch.int64, **meta)
        p_out = torch.empty(s["vocab"], key["k_o"], **meta) if key["proj"] else None
        f32 = torch.empty(s["n_tok"], **meta)
        readout = torch.empty(s["n_tok"], key["k_o"], **meta) if key["proj"] else f32
        args = mod.vocab_pass_kernel_args(h, weight, None, y, p_out, f32, f32, readout)
        blocks = {"BLOCK_T": cfg[0], "BLOCK_V": cfg[1], "BLOCK_D": cfg[2]}
        return mod.lm_head_vocab_kernel.fn, args, blocks
    mod = importlib.import_module("cluster_kernels.project_linear_grads")
    s = SHAPES[PLG]
    d_in, d_out = (SHAPES[LMH]["d"], key["k_o"]) if key["weights"] else (s["d_in"], s["d_out"])
    x = torch.empty(s["n_tok"], d_in, dtype=dtype, **meta)
    g = torch.empty(s["n_tok"], d_out, dtype=dtype, **meta)
    w = torch.empty(s["n_tok"], **meta) if key["weights"] else None
    p_in, p_out = torch.empty(d_in, key["k_i"], **meta), torch.empty(d_out, key["k_o"], **meta)
    partial = torch.empty(16, 4, key["k_o"], key["k_i"], **meta)
    items = tuple(torch.empty(64, dtype=torch.int64, **meta) for _ in range(4))
    args = mod.project_kernel_args(x, g, w, p_in, p_out, partial, items)
    return mod.project_linear_grads_kernel.fn, args, {"BLOCK_T": cfg[0], "BLOCK_D": cfg[1]}


def _source(fn: Any, args: dict[str, Any]) -> Any:
    """``ASTSource`` with the runtime's own specialisation of every argument."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = args[name]
        if fn.params[i].is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":  # integers equal to 1 (unit strides) become compile-time constants
            constexprs[name] = attr
        elif attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def parse_ptxas(log: str) -> dict[str, int]:
    """Registers, spill stores/loads, stack frame and static shared memory from one kernel's ``ptxas -v`` report."""
    out = {"regs": 0, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem_static": 0}
    if m := re.search(r"Used (\d+) registers", log):
        out["regs"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log):
        out["stack"], out["spill_stores"], out["spill_loads"] = (int(g) for g in m.groups())
    if m := re.search(r"(\d+) bytes smem", log):
        out["smem_static"] = int(m.group(1))
    if not re.search(r"Used \d+ registers", log):
        raise ValueError(f"no 'Used N registers' line in the ptxas report:\n{log[-2000:]}")
    return out


def compile_job(job: dict[str, Any]) -> dict[str, Any]:
    """Compile one job for its target; returns the ptxas numbers, Triton's shared memory, or the error."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    fn, args, blocks = _kernel_and_args(job)
    src = _source(fn, {**args, **blocks})
    cfg, cc = job["config"], job["cc"]
    options = {"num_warps": cfg[-2], "num_stages": cfg[-1]}
    key = hashlib.sha256(json.dumps([src.hash(), cc, options, triton.__version__]).encode()).hexdigest()
    cached = cache_dir() / f"{key}.json"
    if cached.exists():
        return {**json.loads(cached.read_text()), "cached": True}
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True  # a Triton cache hit would skip ptxas and its report
            kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
        res = {**parse_ptxas(log.getvalue()), "shared": int(kernel.metadata.shared), "error": None}
    except Exception as exc:  # noqa: BLE001 - the report records every failure
        res = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"}
    res["seconds"] = round(time.perf_counter() - t0, 2)
    if res["error"] is None:
        store_record(cached, res)
    return {**res, "cached": False}


def _worker(jobs_path: str, out_path: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    Path(out_path).write_text(json.dumps([{**job, **compile_job(job)} for job in jobs]))


def run_jobs(jobs: list[dict[str, Any]], workers: int, timeout: float = 3000.0) -> list[dict[str, Any]]:
    """Compile ``jobs`` in ``workers`` subprocesses (no TRITON_INTERPRET there); results in the jobs' order."""
    if not jobs:
        return []
    workers = max(1, min(workers, len(jobs)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="ptxas_report_") as tmp:
        procs = []
        for w in range(workers):
            shard = jobs[w::workers]
            jp, op = Path(tmp) / f"jobs{w}.json", Path(tmp) / f"out{w}.json"
            jp.write_text(json.dumps(shard))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(jp), str(op)]
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True), op, len(shard)))
        results: list[list[dict[str, Any]]] = []
        for proc, op, _ in procs:
            output, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0 or not op.exists():
                raise RuntimeError(f"ptxas_report worker failed (exit {proc.returncode}):\n{output[-4000:]}")
            results.append(json.loads(op.read_text()))
    merged = []
    for i in range(len(jobs)):
        merged.append(results[i % workers][i // workers])
    return merged


def gate_targets() -> list[int]:
    """The compile gate's targets (:data:`GATE_TARGETS`) the installed Triton compiles for."""
    return [cc for cc in GATE_TARGETS if triton_supports(cc)]


def aot_workers() -> int:
    """How many compile worker processes (``CLUSTER_KERNELS_AOT_WORKERS``, default 2)."""
    return int(os.environ.get("CLUSTER_KERNELS_AOT_WORKERS", "2"))


def gate_triton_rows() -> list[dict[str, Any]]:
    """The compile gate's Triton compiles (every gate config for :func:`gate_targets`; [] without them), from the
    cache where it has them: what tests/cluster_kernels/test_aot_compile.py checks and tests/prebuild.py makes."""
    targets = gate_targets()
    return run_jobs(triton_jobs("gate", targets), aot_workers()) if targets else []


def gate_cuda_records() -> list[dict[str, Any]]:
    """The compile gate's nvcc compiles (every ``csrc/cuda/*.cu`` for :data:`CUDA_ARCHS`), as :func:`cuda_compiles`."""
    return cuda_compiles(CUDA_ARCHS, aot_workers())


def triton_supports(cc: int) -> bool:
    """True when the installed Triton has an NVIDIA backend that compiles for ``sm_<cc>``."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend, get_ptxas

        CUDABackend(GPUTarget("cuda", cc, 32))
        return Path(get_ptxas(cc).path).exists()
    except Exception:  # noqa: BLE001 - no Triton, no NVIDIA backend, or too old for the target
        return False


# --------------------------------------------------------------------------------------------------
# CUDA kernels: nvcc -Xptxas -v
# --------------------------------------------------------------------------------------------------


def cuda_sources() -> list[Path]:
    """Every ``csrc/cuda/*.cu``."""
    return sorted((REPO / "csrc" / "cuda").glob("*.cu"))


def cuda_compiles(archs: Iterable[int] = CUDA_ARCHS, workers: int = 2) -> list[dict[str, Any]]:
    """Compile every .cu as the build does, for every arch in ``archs``, with ``-Xptxas -v`` and the host
    compiler's warnings on; one record per file (:func:`cluster_kernels._cuda_build.compile_record`). Records are
    cached like the Triton compiles (key: csrc/, nvcc's version, the archs and flags), and setup.py leaves the same
    records when it builds: after a build for these archs nothing is compiled again.

    Raises:
        RuntimeError: nvcc is missing or fails (the message has its output).
    """
    from concurrent.futures import ThreadPoolExecutor

    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (CUDA_HOME, CUDA_PATH, /usr/local/cuda or PATH): no CUDA toolkit")
    archs = tuple(archs)
    cached = record_paths(nvcc, archs, cuda_sources(), REPO / "csrc")

    def compile_one(src: Path) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            return compile_record(src, Path(tmp) / "k.o", [REPO / "csrc", sysconfig.get_paths()["include"]],
                                  nvcc=nvcc, archs=archs, cache=cached[src.name])

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # nvcc runs in subprocesses
        futures = {src.name: None if cached[src.name].exists() else pool.submit(compile_one, src)
                   for src in cuda_sources()}
        return [json.loads(cached[name].read_text()) if fut is None else fut.result()
                for name, fut in futures.items()]


def cuda_report(archs: Iterable[int] = CUDA_ARCHS, workers: int = 2) -> list[dict[str, Any]]:
    """The rows of :func:`cuda_compiles` (one per function and arch), every file's together.

    Raises:
        RuntimeError: nvcc is missing or fails (the message has its output).
    """
    rows = [r for rec in cuda_compiles(archs, workers) for r in rec["rows"]]
    names = demangle(sorted({r["function"] for r in rows}))  # cached rows get today's readable names too
    return [{**r, "name": names[r["function"]]} for r in rows]


# --------------------------------------------------------------------------------------------------
# Checks and the result file
# --------------------------------------------------------------------------------------------------


def problems(triton_rows: list[dict[str, Any]], cuda_rows: list[dict[str, Any]]) -> list[str]:
    """Compile errors, shared memory over the target's limit, keys where every config spills, spilling CUDA code."""
    out = []
    by_key: dict[tuple, list[dict[str, Any]]] = {}
    for r in triton_rows:
        where = f"{r['kernel']} {r['dtype']} [{r['label']}] config {tuple(r['config'])} sm_{r['cc']}"
        if r.get("error"):
            out.append(f"{where}: compile error: {r['error']}")
            continue
        smem = r["shared"] + r.get("smem_static", 0)
        if smem > SMEM_LIMIT[r["cc"]]:
            out.append(f"{where}: {smem} bytes of shared memory, above the sm_{r['cc']} limit {SMEM_LIMIT[r['cc']]}")
        by_key.setdefault((r["kernel"], r["dtype"], r["label"], r["cc"]), []).append(r)
    for (kernel, dtype, label, cc), rows in sorted(by_key.items()):
        if all(r["spill_stores"] > 0 for r in rows):
            worst = min(r["spill_stores"] for r in rows)
            out.append(f"{kernel} {dtype} [{label}] sm_{cc}: every config spills (least: {worst} bytes)")
    for r in cuda_rows:
        if r["spill_stores"] > 0 and not is_library_kernel(r["name"]):
            out.append(f"{r['file']}: {r['name']} ({r['arch']}) spills {r['spill_stores']} bytes")
    return out


def is_library_kernel(name: str) -> bool:
    """CUB / Thrust kernels our .cu files instantiate: reported in the table, not ours to keep spill-free."""
    return name.removeprefix("void ").startswith(("cub::", "thrust::"))


def _triton_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    table = []
    for r in sorted(rows, key=lambda r: (r["kernel"], r["dtype"], r["label"], r["config"], r["cc"])):
        cfg = r["config"]
        blocks = f"T{cfg[0]} V{cfg[1]} D{cfg[2]}" if r["kernel"] == LMH else f"T{cfg[0]} D{cfg[1]}"
        if r.get("error"):
            table.append([r["kernel"], r["dtype"], r["label"], blocks, cfg[-2], cfg[-1], f"sm_{r['cc']}", "error",
                          "–", "–"])
            continue
        table.append([r["kernel"], r["dtype"], r["label"], blocks, cfg[-2], cfg[-1], f"sm_{r['cc']}", r["regs"],
                      r["spill_stores"], round((r["shared"] + r.get("smem_static", 0)) / 1024, 1)])
    return {
        "heading": "Triton kernels: every GPU autotune config the prune hook keeps, per key and target",
        "columns": ["kernel", "dtype", "key", "blocks", "warps", "stages", "target", "registers",
                    "spill stores (bytes)", "shared (KiB)"],
        "rows": table,
        "notes": [
            "Compiled without a GPU by triton.compile for GPUTarget('cuda', cc, 32), arguments specialised as "
            "Triton's runtime does; lm_head_features at d = 576, V = 49 152 (SmolLM2-135M), project_linear_grads "
            "at 4096 x 11 008 (a Llama-7B MLP layer) and, with token weights, the lm-head features' own k x k "
            "reduction of 576-wide tokens.",
            "Shared-memory limits per block: sm_80 163 KiB, sm_90 and sm_100 227 KiB.",
            BEFORE,
        ],
    }


def _cuda_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    table = [[r["file"], r["name"], r["arch"], r["regs"], r["spill_stores"], r["stack"], r["smem_static"]]
             for r in sorted(rows, key=lambda r: (r["file"], r["name"], r["arch"]))]
    return {
        "heading": "CUDA kernels (csrc/cuda): nvcc -Xptxas -v with the build's flags",
        "columns": ["file", "function", "target", "registers", "spill stores (bytes)", "stack frame (bytes)",
                    "static shared (bytes)"],
        "rows": table,
        "notes": ["One row per entry function (and per non-inlined device function ptxas reports). CUB / Thrust "
                  "kernels that our files instantiate are listed but not held to the no-spill rule."],
    }


def result_file(triton_rows: list[dict[str, Any]], cuda_rows: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """The ``benchmarks/results`` JSON of this report."""
    import triton

    spilling = sum(1 for r in triton_rows if not r.get("error") and r["spill_stores"] > 0)
    cuda_spills = sum(1 for r in cuda_rows if r["spill_stores"] > 0 and not is_library_kernel(r["name"]))
    found = problems(triton_rows, cuda_rows)
    return {
        "title": "GPU kernels compiled ahead of time: registers, spills and shared memory per config and target",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, no GPU; triton {triton.__version__}, "
                   f"python {platform.python_version()}",
        "command": command,
        "sections": [_triton_table(triton_rows), _cuda_table(cuda_rows)],
        "targets": [
            {"goal": "every key has a spill-free config on every target; no shared memory above the limit",
             "measured": f"{len(triton_rows)} compiles, {spilling} spilling, {len(found)} problems",
             "met": not found},
            {"goal": "no CUDA kernel of ours spills", "measured": f"{len(cuda_rows)} functions, {cuda_spills} spilling",
             "met": cuda_spills == 0},
        ],
    }


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--worker":
        _worker(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=("gate", "full"), default="full")
    ap.add_argument("--workers", type=int, default=aot_workers())
    ap.add_argument("--json", type=Path, help="write the raw rows here instead of benchmarks/results/ptxas.json")
    ap.add_argument("--no-cuda", action="store_true", help="skip the nvcc part")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    targets = [cc for cc in TRITON_TARGETS if triton_supports(cc)]
    triton_rows = run_jobs(triton_jobs(args.set, targets), args.workers)
    cuda_rows = [] if args.no_cuda else cuda_report(CUDA_ARCHS, args.workers)
    seconds = time.perf_counter() - t0
    if args.json:
        args.json.write_text(json.dumps({"triton": triton_rows, "cuda": cuda_rows, "targets": targets,
                                         "seconds": seconds}))
    else:
        command = "python benchmarks/ptxas_report.py" + (" --set gate" if args.set == "gate" else "")
        RESULT_PATH.write_text(json.dumps(result_file(triton_rows, cuda_rows, command), indent=1) + "\n")
    found = problems(triton_rows, cuda_rows)
    for line in found:
        print("PROBLEM:", line, file=sys.stderr)
    print(f"{len(triton_rows)} Triton compiles on {targets}, {len(cuda_rows)} CUDA functions, {len(found)} problems, "
          f"{seconds:.0f} s")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
