"""GPU benchmark of the gradient-feature kernels: Triton time vs the bytes-moved floor, tokens/s.

Run on a CUDA machine (``benchmarks/gpu/run_all.sh`` calls it)::

    python benchmarks/gpu/bench_features_gpu.py --out DIR

Writes ``DIR/gpu_features.json`` (the ``benchmarks/results`` format) and prints the tables. Every
section is independent: a failure is recorded in the JSON (and the exit code is 1) instead of
losing the other numbers. ``--smoke`` runs tiny sizes, also on CPU under ``TRITON_INTERPRET=1``, to
check the script itself.

Floors. ``project_linear_grads`` must read ``x`` and ``g`` once: floor = bytes / copy bandwidth (the
bandwidth of a large device-to-device copy measured in the same run). ``lm_head_features`` is
compute-bound at large ``T``: its floor is the time cuBLAS takes for the logits GEMM ``h W^T`` alone
(the kernel must at least do that GEMM), and its bytes floor is reading ``h`` and ``W`` once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "python_api"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def bench(fn, reps: int = 20) -> float:  # reps: CPU (smoke) runs only
    """Median seconds of ``fn`` (CUDA events via triton.testing.do_bench on GPU, perf_counter on CPU)."""
    if ON_GPU:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) / 1e3
    fn()
    times = []
    for _ in range(max(1, reps // 10)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_bandwidth(n_bytes: int) -> float:
    """Achievable device bandwidth (bytes/s) from a large copy: read + write."""
    a = torch.empty(n_bytes // 4, dtype=torch.float32, device=DEVICE)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / bench(lambda: b.copy_(a))


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if ON_GPU else f"CPU ({platform.processor() or 'unknown'}), interpreter"
    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = "missing"
    return f"{gpu}; torch {torch.__version__}, triton {tv}, python {platform.python_version()}"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    return (got.double() - ref.double()).abs().max().item() / (scale if scale > 0 else 1.0)


def varlen(n_tok: int, n_ex: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n_tok), n_ex - 1, replace=False))
    return torch.tensor(np.concatenate([[0], cuts, [n_tok]]), dtype=torch.int64, device=DEVICE)


# ---- sections -----------------------------------------------------------------------------------------


def section_project_linear_grads(smoke: bool, bandwidth: float) -> tuple[dict, list[dict]]:
    from cluster_kernels.project_linear_grads import project_linear_grads, project_linear_grads_ref
    from cluster_kernels.projection import random_projection

    # correctness at a moderate size against the float64 definition
    n_check, d_in, d_out = (96, 48, 40) if smoke else (2048, 1024, 768)
    n_tok = n_check
    cu = varlen(n_tok, 5)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n_tok, d_in, generator=gen).to(DEVICE)
    g = torch.randn(n_tok, d_out, generator=gen).to(DEVICE)
    p_in = random_projection(d_in, 32, seed=0, name="c/in", device=DEVICE)
    p_out = random_projection(d_out, 16, seed=0, name="c/out", device=DEVICE)
    ref = project_linear_grads_ref(x, g, cu, p_in, p_out)
    err32 = rel_err(project_linear_grads(x, g, cu, p_in, p_out, backend="triton"), ref)
    err16 = rel_err(project_linear_grads(x.bfloat16(), g.bfloat16(), cu, p_in, p_out, backend="triton"), ref)

    shapes = [(256, 64, 48, 16)] if smoke else [(16384, 4096, 4096, 64), (16384, 4096, 11008, 64)]
    dtypes = [torch.float32] if smoke else [torch.bfloat16, torch.float32]
    rows = []
    for n_tok, d_in, d_out, k in shapes:
        cu = varlen(n_tok, 32 if not smoke else 4)
        p_in = random_projection(d_in, k, seed=0, name="b/in", device=DEVICE)
        p_out = random_projection(d_out, k, seed=0, name="b/out", device=DEVICE)
        for dtype in dtypes:
            x = torch.randn(n_tok, d_in, device=DEVICE, dtype=dtype)
            g = torch.randn(n_tok, d_out, device=DEVICE, dtype=dtype)
            elem = x.element_size()
            n_bytes = n_tok * (d_in + d_out) * elem + 4 * (d_in + d_out) * k + 4 * (len(cu) - 1) * k * k
            flops = 2 * n_tok * (d_in * k + d_out * k + k * k)
            t_triton = bench(
                lambda x=x, g=g, cu=cu, p_in=p_in, p_out=p_out: project_linear_grads(
                    x, g, cu, p_in, p_out, backend="triton"
                )
            )
            t_torch = bench(
                lambda x=x, g=g, cu=cu, p_in=p_in, p_out=p_out: project_linear_grads(
                    x, g, cu, p_in, p_out, backend="torch"
                )
            )
            floor = n_bytes / bandwidth
            rows.append(
                [
                    f"{n_tok} x ({d_in} -> {d_out}), k={k}x{k}",
                    str(dtype).replace("torch.", ""),
                    f"{t_triton * 1e3:.3f}",
                    f"{floor * 1e3:.3f}",
                    f"{t_triton / floor:.2f}",
                    f"{n_bytes / t_triton / 1e9:.0f}",
                    f"{flops / t_triton / 1e12:.1f}",
                    f"{t_torch * 1e3:.3f}",
                    f"{n_tok / t_triton / 1e6:.1f}",
                ]
            )
    section = {
        "heading": "project_linear_grads: Triton kernel vs bytes-moved floor",
        "columns": [
            "tokens x (d_in -> d_out), k",
            "dtype",
            "triton ms",
            "floor ms",
            "time / floor",
            "GB/s",
            "TFLOP/s",
            "torch path ms",
            "Mtok/s",
        ],
        "rows": rows,
        "notes": [
            f"floor = bytes of x, g, projections and output / copy bandwidth {bandwidth / 1e9:.0f} GB/s "
            "measured in this run; 32 examples of random lengths per batch.",
            f"correctness vs float64 definition ({n_check} tokens): fp32 rel. err {err32:.1e}, bf16 inputs "
            f"{err16:.1e}.",
        ],
    }
    targets = [
        {
            "goal": "project_linear_grads (Triton, fp32) matches the float64 reference to 1e-5",
            "measured": f"{err32:.1e}",
            "met": err32 <= 1e-5,
        }
    ]
    return section, targets


def section_lm_head(smoke: bool, bandwidth: float) -> tuple[dict, list[dict]]:
    from cluster_kernels.lm_head_features import lm_head_features, lm_head_features_ref
    from cluster_kernels.projection import random_projection

    # correctness (fp32, small) against the float64 definition
    n_check, vocab, d = (40, 100, 32) if smoke else (512, 32000, 512)
    n_tok = n_check
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n_tok, d, generator=gen).to(DEVICE)
    w = (torch.randn(vocab, d, generator=gen) / d**0.5).to(DEVICE)
    y = torch.randint(0, vocab, (n_tok,), generator=gen).to(DEVICE)
    cu = varlen(n_tok, 4)
    p_in = random_projection(d, 64, seed=0, name="l/in", device=DEVICE)
    p_out = random_projection(vocab, 64, seed=0, name="l/out", device=DEVICE)
    errs, errs_bf16 = {}, {}
    for mode, kw in (("paper", {}), ("projected", dict(p_in=p_in, p_out=p_out))):
        ref = lm_head_features_ref(h, w, y, cu, mode=mode, **kw)
        errs[mode] = rel_err(lm_head_features(h, w, y, cu, mode=mode, backend="triton", **kw), ref)
        if ON_GPU:  # bf16 tensor-core logits (the interpreter has no bf16 arithmetic, so GPU only)
            hb, wb = h.bfloat16(), w.bfloat16()
            ref_b = lm_head_features_ref(hb, wb, y, cu, mode=mode, **kw)
            errs_bf16[mode] = rel_err(lm_head_features(hb, wb, y, cu, mode=mode, backend="triton", **kw), ref_b)

    configs = [(128, 100, 32)] if smoke else [(8192, 32000, 4096), (8192, 128256, 4096)]
    rows = []
    for n_tok, vocab, d in configs:
        dtype = torch.float32 if smoke else torch.bfloat16
        h = torch.randn(n_tok, d, device=DEVICE, dtype=dtype)
        w = (torch.randn(vocab, d, device=DEVICE) / d**0.5).to(dtype)
        y = torch.randint(0, vocab, (n_tok,), device=DEVICE)
        cu = varlen(n_tok, 16 if not smoke else 4)
        p_in = random_projection(d, 64, seed=0, name="l/in", device=DEVICE)
        p_out = random_projection(vocab, 64, seed=0, name="l/out", device=DEVICE)
        t_gemm = bench(lambda h=h, w=w: h @ w.T)
        n_bytes = (n_tok * d + vocab * d) * h.element_size()
        for mode, kw in (("paper", {}), ("projected", dict(p_in=p_in, p_out=p_out))):
            fn = lambda h=h, w=w, y=y, cu=cu, mode=mode, kw=kw: lm_head_features(  # noqa: E731
                h, w, y, cu, mode=mode, backend="triton", **kw
            )
            t = bench(fn)
            mem = "-"
            if ON_GPU:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                mem = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}"
            rows.append(
                [
                    f"T={n_tok}, V={vocab}, d={d}",
                    mode,
                    f"{t * 1e3:.2f}",
                    f"{t_gemm * 1e3:.2f}",
                    f"{t / t_gemm:.2f}",
                    f"{n_bytes / bandwidth * 1e3:.3f}",
                    f"{n_tok / t / 1e6:.2f}",
                    mem,
                ]
            )
        mat_mem = "-"
        if ON_GPU:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            logp = torch.log_softmax((h @ w.T).float(), dim=-1)
            _ = logp.gather(1, y[:, None]).exp()
            torch.cuda.synchronize()
            mat_mem = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}"
            del logp
        t_mat = bench(lambda h=h, w=w, y=y: torch.log_softmax((h @ w.T).float(), dim=-1).gather(1, y[:, None]))
        rows.append(
            [
                f"T={n_tok}, V={vocab}, d={d}",
                "materialised log_softmax (authors)",
                f"{t_mat * 1e3:.2f}",
                f"{t_gemm * 1e3:.2f}",
                f"{t_mat / t_gemm:.2f}",
                "-",
                f"{n_tok / t_mat / 1e6:.2f}",
                mat_mem,
            ]
        )
    section = {
        "heading": "lm_head_features: Triton kernel vs the logits-GEMM floor",
        "columns": [
            "shape",
            "mode",
            "ms",
            "cuBLAS h W^T ms (floor)",
            "time / floor",
            "bytes floor ms",
            "Mtok/s",
            "peak extra MiB",
        ],
        "rows": rows,
        "notes": [
            "floor = the cuBLAS GEMM computing the logits alone (the kernel also does the online "
            "log-sum-exp, and for 'projected' the (T, V) x (V, 64) read-out); bytes floor = reading h and W "
            "once at the copy bandwidth. bf16 inputs, all tokens counted.",
            f"correctness vs float64 definition (T={n_check}, fp32): paper {errs['paper']:.1e}, "
            f"projected {errs['projected']:.1e}.",
        ],
    }
    targets = [
        {
            "goal": f"lm_head_features (Triton, fp32, {mode}) matches the float64 reference to 1e-5",
            "measured": f"{err:.1e}",
            "met": err <= 1e-5,
        }
        for mode, err in errs.items()
    ]
    targets += [
        {
            "goal": f"lm_head_features (Triton, bf16 inputs, {mode}) within 3e-2 of the float64 reference "
            "on the same inputs",
            "measured": f"{err:.1e}",
            "met": err <= 3e-2,
        }
        for mode, err in errs_bf16.items()
    ]
    return section, targets


def section_featurize(smoke: bool) -> tuple[dict, list[dict]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from clusterlm.selection.features import GradientFeaturizer

    vocab, hidden, layers, inter, seq, bsz, n_batches = (
        (500, 64, 2, 128, 32, 2, 1) if smoke else (32000, 1024, 8, 2816, 1024, 8, 3)
    )
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096,
    )
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    model = LlamaForCausalLM(cfg).to(DEVICE, dtype)
    rng = np.random.default_rng(0)
    data = []
    for _ in range(bsz * n_batches):
        ids = rng.integers(0, vocab, seq)
        labels = ids.copy()
        labels[: int(rng.uniform(0.25, 0.75) * seq)] = -100
        data.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    n_tok = seq * len(data)

    def sync():
        if ON_GPU:
            torch.cuda.synchronize()

    def wall(fn, reps=3):
        fn()
        sync()
        times = []
        for _ in range(reps if not smoke else 1):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.tensor([e["input_ids"] for e in data], device=DEVICE)
    labels = torch.tensor([e["labels"] for e in data], device=DEVICE)

    def train():
        for b in range(n_batches):
            sl = slice(b * bsz, (b + 1) * bsz)
            model(input_ids=ids[sl], labels=labels[sl], use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model.train()
    t_train = wall(train)
    opt.state.clear()  # free the AdamW moments before featurizing
    rows = [["training step (fwd + bwd + AdamW)", f"{t_train / n_batches * 1e3:.0f}", "1.00", f"{n_tok / t_train:.0f}"]]
    targets = []
    for preset, goal in (("paper", 0.5), ("lm_head", 0.5), ("all-linear", 1.0)):
        feat = GradientFeaturizer(model, features=preset, dim=None if preset == "paper" else (64, 64))
        t = wall(lambda f=feat: f.featurize(data, batch_tokens=bsz * seq, progress=False))
        rows.append([f"featurize {preset!r}", f"{t / n_batches * 1e3:.0f}", f"{t / t_train:.2f}", f"{n_tok / t:.0f}"])
        targets.append(
            {
                "goal": f"GPU featurize('{preset}') / training step <= {goal}",
                "measured": f"{t / t_train:.2f}",
                "met": t / t_train <= goal,
            }
        )
    section = {
        "heading": "GradientFeaturizer on the GPU: tokens/s and ratio to a training step",
        "columns": ["what", "ms / batch", "ratio to training step", "tokens/s"],
        "rows": rows,
        "notes": [
            f"Llama from a config: {layers} layers, hidden {hidden}, intermediate {inter}, vocab {vocab}, "
            f"{dtype}; {n_batches} batches of {bsz} x {seq} tokens, 25-75 % prompt tokens."
        ],
    }
    return section, targets


# ---- main -------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description="GPU benchmark of the gradient-feature kernels")
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_features.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (also runs on CPU with TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if not ON_GPU and not (args.smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        print(
            "bench_features_gpu: no CUDA device; run it on a GPU machine (or with --smoke and TRITON_INTERPRET=1 "
            "to check the script).",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    bandwidth = copy_bandwidth(64 << 20 if args.smoke else 2 << 30)
    sections, targets, failures = [], [], []
    for name, build in (
        ("project_linear_grads", lambda: section_project_linear_grads(args.smoke, bandwidth)),
        ("lm_head_features", lambda: section_lm_head(args.smoke, bandwidth)),
        ("featurize", lambda: section_featurize(args.smoke)),
    ):
        try:
            section, tgt = build()
        except Exception as exc:  # noqa: BLE001 - keep the other sections' numbers
            traceback.print_exc()
            failures.append(name)
            section, tgt = (
                {"heading": f"{name}: FAILED", "columns": ["error"], "rows": [[repr(exc)[:500]]], "notes": []},
                [],
            )
        if ON_GPU:
            torch.cuda.empty_cache()
        sections.append(section)
        targets.extend(tgt)
        print(f"\n## {section['heading']}")
        print(" | ".join(section["columns"]))
        for r in section["rows"]:
            print(" | ".join(str(c) for c in r))
        for n in section["notes"]:
            print(f"  note: {n}")
    report = {
        "title": "Gradient features on the GPU: Triton kernels vs floors" + (" (smoke run)" if args.smoke else ""),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": "python benchmarks/gpu/bench_features_gpu.py --out DIR" + (" --smoke" if args.smoke else ""),
        "sections": sections,
        "targets": targets,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_features.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out / 'gpu_features.json'} in {time.perf_counter() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
