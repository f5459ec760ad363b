"""bf16 autocast vs float32 for one training step of SmolLM2-135M-Instruct on this CPU.

Run::

    .venv/bin/python benchmarks/bench_bf16_cpu.py          # needs `make real-model`; ~2 min on 2 cores

Why: ``clusterlm train --bf16 on`` is fast on CPUs with native bf16 (AVX512-BF16 / AMX) and much slower on
CPUs without it (AVX2 only), where autocast's bf16 matmuls fall back to slow kernels. This measures the
forward, backward and AdamW step of one micro-batch in both modes, side by side in one process, and writes
``benchmarks/results/bf16_cpu.json`` (median of ``--repeats`` steps after one warm-up step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_description  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _cpu_bf16_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    found = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return ", ".join(found) or "none of avx2/avx512f/avx512_bf16/amx_bf16"


def step_times(model: torch.nn.Module, batch: torch.Tensor, bf16: bool, repeats: int) -> dict[str, float]:
    """Median seconds of forward, backward and optimizer step (one warm-up step first)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i:
            parts["forward"].append(t1 - t0)
            parts["backward"].append(t2 - t1)
            parts["optimizer"].append(t3 - t2)
    out = {k: statistics.median(v) for k, v in parts.items()}
    out["step"] = sum(out.values())
    out["tokens_per_s"] = batch.numel() / out["step"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="tokens per example")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bf16_cpu.json"))
    args = p.parse_args(argv)
    from clusterlm.models import load_model

    torch.set_num_threads(args.threads)
    model, _, model_id = load_model("smollm2-135m-instruct")
    model.train()
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), generator=gen)
    fp32 = step_times(model, batch, False, args.repeats)
    bf16 = step_times(model, batch, True, args.repeats)
    rows = [[name, f"{r['forward']:.2f}", f"{r['backward']:.2f}", f"{r['optimizer']:.2f}", f"{r['step']:.2f}",
             f"{r['tokens_per_s']:.1f}"] for name, r in (("float32", fp32), ("bf16 autocast", bf16))]
    out = {
        "title": "bf16 autocast vs float32 on CPU: one SmolLM2-135M-Instruct training step",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(f"1 process x {args.threads} thread(s); CPU flags: {_cpu_bf16_flags()}",
                                       ["torch", "transformers"]),
        "command": shlex.join(["python", "benchmarks/bench_bf16_cpu.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "sections": [{
            "heading": f"{model_id}, micro-batch {args.batch} x {args.tokens} tokens, AdamW (median of {args.repeats})",
            "columns": ["mode", "forward s", "backward s", "optimizer s", "step s", "tokens/s"],
            "rows": rows,
            "notes": [f"bf16 autocast step / float32 step = {bf16['step'] / fp32['step']:.2f}x"],
        }],
        "raw": {"float32": fp32, "bf16": bf16, "config": vars(args)},
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out["sections"][0], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
