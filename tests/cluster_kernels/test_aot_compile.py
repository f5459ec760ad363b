"""Compile gate: every GPU kernel compiled for real targets here, without a GPU, and ptxas's report checked.

Triton: both kernels, every GPU autotune config their prune hooks keep for the default featurization paths
(lm-head 32 x 32 and the paper proxy; all-linear 16 x 16 and 64 x 64; the lm-head features' own 32 x 32
reduction), float32 and bfloat16, for sm_80 and sm_90 (``python benchmarks/ptxas_report.py`` adds sm_100 when the
installed Triton compiles for it).
CUDA: every ``csrc/cuda/*.cu`` for sm_80 and sm_90 (one nvcc call per file, host warnings on). Fails on a
compile error, on a warning of the host compiler in our sources, on shared memory above a target's limit, on a
key for which every config spills registers, and on a CUDA kernel of ours that spills (CUB / Thrust kernels the
files instantiate are reported, not held to it).

The compiles run in worker processes (``benchmarks/ptxas_report.py``; ``CLUSTER_KERNELS_AOT_WORKERS``, default 2)
and their reports are cached in ``~/.cache/cluster_kernels/aot`` under a key of the kernel source, signature,
options, target and compiler versions: an unchanged kernel is not compiled again. A session makes the same compiles
first, before its workers start, when the cache lacks them (tests/prebuild.py), so they never run beside other
tests' ranks. ``python benchmarks/ptxas_report.py`` compiles the full set (every key, float16 too) into
BENCHMARKS.md's table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from cluster_kernels._cuda_build import find_nvcc, parse_nvcc_ptxas

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ptxas_report", REPO / "benchmarks" / "ptxas_report.py")
ptxas_report = importlib.util.module_from_spec(_spec)
sys.modules["ptxas_report"] = ptxas_report
_spec.loader.exec_module(ptxas_report)

TARGETS = ptxas_report.gate_targets()
needs_triton_nvidia = pytest.mark.skipif(
    not TARGETS, reason="needs Triton with its NVIDIA backend (pip install triton): it compiles without a GPU"
)


@pytest.fixture(scope="module")
def triton_rows() -> list[dict]:
    return ptxas_report.gate_triton_rows()


@pytest.fixture(scope="module")
def cuda_compiles() -> dict[str, dict]:
    """Every .cu compiled once, for sm_80 and sm_90 (one record per file: rows, warnings, object size): the records
    the build left in the compile cache (setup.py compiles for these architectures by default), or compiled here."""
    if find_nvcc() is None:
        pytest.skip("nvcc not found (CUDA_HOME, CUDA_PATH, /usr/local/cuda or PATH): no CUDA toolkit")
    return {rec["file"]: rec for rec in ptxas_report.gate_cuda_records()}


@pytest.fixture(scope="module")
def cuda_rows(cuda_compiles: dict[str, dict]) -> list[dict]:
    return [r for rec in cuda_compiles.values() for r in rec["rows"]]


@needs_triton_nvidia
def test_the_gate_covers_both_kernels_both_dtypes_and_the_targets():
    jobs = ptxas_report.triton_jobs("gate", TARGETS)
    assert {j["kernel"] for j in jobs} == {"lm_head_features", "project_linear_grads"}
    assert {j["dtype"] for j in jobs} == {"float32", "bfloat16"}
    assert {80, 90} <= {j["cc"] for j in jobs}
    labels = {(j["kernel"], j["dtype"], j["label"]) for j in jobs}
    for dt in ("float32", "bfloat16"):
        assert ("lm_head_features", dt, "projected, k_o = 32") in labels
        assert ("project_linear_grads", dt, "16 x 16") in labels
        assert ("project_linear_grads", dt, "64 x 64") in labels


@needs_triton_nvidia
def test_every_triton_config_compiles_within_the_shared_memory_limit(triton_rows):
    bad = [p for p in ptxas_report.problems(triton_rows, []) if "compile error" in p or "shared memory" in p]
    assert not bad, "\n".join(bad)


@needs_triton_nvidia
def test_every_key_has_a_spill_free_config_on_every_target(triton_rows):
    bad = [p for p in ptxas_report.problems(triton_rows, []) if "every config spills" in p]
    assert not bad, "\n".join(bad)


@needs_triton_nvidia
def test_the_default_featurization_paths_have_no_spilling_config(triton_rows):
    """Stricter than the rule: the prune hooks keep only spill-free configs for the default paths."""
    spilling = [
        f"{r['kernel']} {r['dtype']} [{r['label']}] {tuple(r['config'])} sm_{r['cc']}: {r['spill_stores']} bytes"
        for r in triton_rows
        if not r.get("error") and r["spill_stores"] > 0
    ]
    assert not spilling, "\n".join(spilling)


@pytest.mark.parametrize("source", [p.name for p in ptxas_report.cuda_sources()])
def test_cuda_source_compiles_without_warnings_of_ours(source: str, cuda_compiles: dict[str, dict]) -> None:
    """Each .cu file setup.py builds compiles with the build's flags (machine code for sm_80 and sm_90, PTX of
    sm_90), and the host compiler's -Wall -Wextra finds nothing in our sources."""
    rec = cuda_compiles[source]
    assert rec["object_bytes"] > 0, f"{source}: nvcc wrote no object file"
    assert not rec["warnings"], f"warnings in our sources ({source}):\n" + "\n".join(rec["warnings"])


def test_cuda_kernels_do_not_spill(cuda_rows):
    assert {r["target"] for r in cuda_rows} == set(ptxas_report.CUDA_ARCHS)
    # every .cu file that defines a kernel has its rows (host-only files, e.g. the auction drivers, have none)
    with_kernels = {p.name for p in ptxas_report.cuda_sources() if "__global__" in p.read_text(encoding="utf-8")}
    assert with_kernels and {r["file"] for r in cuda_rows} == with_kernels
    bad = ptxas_report.problems([], cuda_rows)
    assert not bad, "\n".join(bad)


def test_kernel_args_cover_every_kernel_parameter():
    """The launchers' argument builders (which the gate uses) name every non-autotuned kernel parameter."""
    pytest.importorskip("triton")
    import torch

    lmh = importlib.import_module("cluster_kernels.lm_head_features")
    plg = importlib.import_module("cluster_kernels.project_linear_grads")
    meta = {"device": "meta"}
    h = torch.empty(10, 8, dtype=torch.bfloat16, **meta)
    f = torch.empty(10, **meta)
    args = lmh.vocab_pass_kernel_args(h, torch.empty(50, 8, dtype=torch.bfloat16, **meta), None,
                                      torch.empty(10, dtype=torch.int64, **meta), torch.empty(50, 33, **meta), f, f,
                                      torch.empty(10, 33, **meta))
    assert set(args) | {"BLOCK_T", "BLOCK_V", "BLOCK_D"} == set(lmh.lm_head_vocab_kernel.arg_names)
    assert (args["BLOCK_K"], args["PRECISION"], args["LOWP"]) == (64, "tf32", True)
    x = torch.empty(10, 8, **meta)
    items = tuple(torch.empty(3, dtype=torch.int64, **meta) for _ in range(4))
    args = plg.project_kernel_args(x, torch.empty(10, 6, **meta), None, torch.empty(8, 16, **meta),
                                   torch.empty(6, 40, **meta), torch.empty(2, 1, 40, 16, **meta), items)
    assert set(args) | {"BLOCK_T", "BLOCK_D"} == set(plg.project_linear_grads_kernel.arg_names)
    assert (args["BLOCK_KO"], args["BLOCK_KI"], args["PRECISION"]) == (64, 16, "ieee")


def test_prune_hooks_keep_what_the_config_rules_say():
    pytest.importorskip("triton")
    import triton

    lmh = importlib.import_module("cluster_kernels.lm_head_features")
    plg = importlib.import_module("cluster_kernels.project_linear_grads")
    configs = [triton.Config({"BLOCK_T": c[0], "BLOCK_D": c[1]}, num_warps=c[2], num_stages=c[3])
               for c in plg.PLG_GPU_CONFIGS]
    kept = plg.prune_project_configs(configs, {}, PRECISION="ieee", BLOCK_KO=64, BLOCK_KI=64)
    assert [(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_D"], c.num_warps, c.num_stages) for c in kept] == \
        plg.project_configs_for("ieee", 64, 64)
    assert all(c.kwargs["BLOCK_T"] <= 32 and c.num_warps == 8 for c in kept)
    configs = [triton.Config({"BLOCK_T": c[0], "BLOCK_V": c[1], "BLOCK_D": c[2]}, num_warps=c[3], num_stages=c[4])
               for c, _, _ in lmh.LMH_GPU_CONFIGS]
    kept = lmh.prune_vocab_configs(configs, {}, PRECISION="tf32", BLOCK_K=32, HAS_PROJ=True)
    assert len(kept) == len(lmh.vocab_configs_for("tf32", 32, True)) > 0
    one = [triton.Config({"BLOCK_T": 16, "BLOCK_V": 32, "BLOCK_D": 32}, num_warps=1)]  # the interpreter's
    assert lmh.prune_vocab_configs(one, {}, PRECISION="ieee", BLOCK_K=16, HAS_PROJ=False) == one


PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'lm_head_vocab_kernel' for 'sm_90a'
ptxas info    : Function properties for lm_head_vocab_kernel
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8 bytes smem
"""

NVCC_LOG = """\
ptxas info    : Compiling entry function '_Z6kernelPd' for 'sm_80'
ptxas info    : Function properties for _Z6kernelPd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 380 bytes cmem[0]
ptxas info    : Function properties for _Z6helperv
    16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function '_Z5otherv' for 'sm_80'
ptxas info    : Function properties for _Z5otherv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 360 bytes cmem[0]
"""


def test_ptxas_reports_are_parsed():
    assert ptxas_report.parse_ptxas(PTXAS_LOG) == {
        "regs": 255, "spill_stores": 12, "spill_loads": 16, "stack": 8, "smem_static": 8}
    with pytest.raises(ValueError, match="no 'Used N registers' line"):
        ptxas_report.parse_ptxas("ptxas fatal   : Unresolved extern function")
    rows = parse_nvcc_ptxas(NVCC_LOG)
    assert [(r["function"], r["arch"], r["regs"], r["spill_stores"], r["smem_static"]) for r in rows] == [
        ("_Z6kernelPd", "sm_80", 40, 0, 4096), ("_Z6helperv", "sm_80", 0, 4, 0), ("_Z5otherv", "sm_80", 12, 0, 0)]


def test_problems_names_errors_shared_memory_all_spilling_keys_and_cuda_spills():
    base = {"kernel": "project_linear_grads", "dtype": "float32", "label": "64 x 64", "cc": 80, "error": None,
            "shared": 1024, "smem_static": 0, "regs": 200, "spill_stores": 0}
    rows = [dict(base, config=[32, 32, 8, 2]), dict(base, config=[16, 64, 8, 3], spill_stores=8)]
    assert ptxas_report.problems(rows, []) == []
    rows[0]["spill_stores"] = 24
    assert ptxas_report.problems(rows, []) == [
        "project_linear_grads float32 [64 x 64] sm_80: every config spills (least: 8 bytes)"]
    rows.append(dict(base, config=[8, 8, 8, 8], shared=200_000))
    rows.append(dict(base, config=[9, 9, 9, 9], error="PTXASError: ptxas fatal"))
    cub = "void cub::CUB_300001_SM_800::detail::select::DeviceSelectSweepKernel<int>"
    found = ptxas_report.problems(rows, [{"file": "k.cu", "name": "f", "arch": "sm_90", "spill_stores": 4},
                                         {"file": "k.cu", "name": cub, "arch": "sm_80", "spill_stores": 12}])
    assert any("200000 bytes of shared memory, above the sm_80 limit 166912" in p for p in found)
    assert any("compile error: PTXASError" in p for p in found)
    assert found[-1] == "k.cu: f (sm_90) spills 4 bytes"


def test_the_build_and_the_gate_share_one_key_per_source(tmp_path):
    """setup.py and the gate look records up by record_paths: equal inputs give the same paths; a changed header, other
    architectures or another cache give others (the gate then compiles instead of reading a stale record)."""
    from cluster_kernels import _cuda_build

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: no CUDA toolkit")
    csrc = tmp_path / "csrc"
    (csrc / "cuda").mkdir(parents=True)
    src = csrc / "cuda" / "k.cu"
    src.write_text("__global__ void k() {}\n")
    (csrc / "cuda" / "k.cuh").write_text("#pragma once\n")
    keys = _cuda_build.record_paths(nvcc, (80, 90), [src], csrc)
    assert keys == _cuda_build.record_paths(nvcc, [80, 90], [src], csrc) and keys["k.cu"].name.startswith("cuda-")
    assert keys != _cuda_build.record_paths(nvcc, (90,), [src], csrc)
    (csrc / "cuda" / "k.cuh").write_text("#pragma once\n// changed\n")
    assert keys != _cuda_build.record_paths(nvcc, (80, 90), [src], csrc)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_cuda_build.CACHE_ENV, str(tmp_path / "other"))
        assert _cuda_build.record_paths(nvcc, (80, 90), [src], csrc)["k.cu"].parent == tmp_path / "other"


def test_architectures_default_to_a100_and_h100_and_a_bad_one_is_named(monkeypatch):
    from cluster_kernels import _cuda_build

    monkeypatch.delenv(_cuda_build.ARCH_ENV, raising=False)
    assert _cuda_build.arch_numbers() == (80, 90) == ptxas_report.CUDA_ARCHS  # the build's records serve the gate
    assert _cuda_build.gencode_flags()[-1] == "-gencode=arch=compute_90,code=compute_90"
    assert _cuda_build.arch_numbers("90") == (90,)
    with pytest.raises(ValueError, match="CLUSTER_KERNELS_CUDA_ARCH.*'80;90'.*sm_90"):
        _cuda_build.arch_numbers("sm_90")
