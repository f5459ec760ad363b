"""Gradient-feature extraction, side by side, in one run (CPU): prints tables and writes JSON.

Reproduce (from the repository root)::

    python benchmarks/features_report.py                 # the sizes of the issue, ~10 minutes on 2 cores
    python benchmarks/features_report.py --quick         # small smoke run, seconds

Sections (each measured in this run; medians of ``--repeats`` timings after a warm-up):

1. Fused per-example features vs LESS-style materialise-then-project: batch-size-1 backward per
   example, flatten the weight gradients of the chosen layers, dense Rademacher projection as in
   TRAK's ``BasicProjector`` (``bernoulli_`` matrix regenerated block by block, 128 columns per
   block, every 16 examples, as LESS calls it). Same layers, same output dimension.
2. ``GradientFeaturizer.featurize`` time / one training step (forward + backward + AdamW step) on the
   same batches.
3. Peak memory of ``lm_head_features`` vs the authors' materialised ``log_softmax`` proxy, each in a
   fresh subprocess (peak RSS above the inputs, large allocations forced to mmap so freed memory
   returns to the OS and the peak is exact).

Results go to ``benchmarks/results/features.json`` (rendered into BENCHMARKS.md by another script).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "python_api"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "features.json"
TRAK_BLOCK = 128  # BasicProjector block size LESS uses
LESS_PROJECT_INTERVAL = 16  # LESS projects the stacked full gradients every 16 examples


# ---- setup --------------------------------------------------------------------------------------------


def build_llama(vocab: int, hidden: int, layers: int, intermediate: int, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(cfg)


def make_examples(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """Random token sequences; the first 25-75 % of each (the 'prompt') has labels -100."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, vocab, seq_len)
        labels = ids.copy()
        labels[: int(rng.uniform(0.25, 0.75) * seq_len)] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def timed(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


# ---- 1. LESS-style baseline --------------------------------------------------------------------------


def block_linear_names(model: torch.nn.Module) -> list[str]:
    """Every nn.Linear of the transformer blocks (the lm head excluded, as LESS projects LoRA/block weights)."""
    head = model.get_output_embeddings()
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


def less_full_gradients(model: torch.nn.Module, examples: list[dict], layer_names: list[str]) -> torch.Tensor:
    """(n, P) flattened weight gradients, one batch-size-1 forward + backward per example (as LESS)."""
    modules = dict(model.named_modules())
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    weights = [modules[n].weight for n in layer_names]
    for w in weights:
        w.requires_grad_(True)  # only the projected layers' gradients are computed: fair to the baseline
    model.eval()
    rows = []
    try:
        for ex in examples:
            out = model(input_ids=torch.tensor([ex["input_ids"]]), labels=torch.tensor([ex["labels"]]), use_cache=False)
            grads = torch.autograd.grad(out.loss, weights)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    finally:
        for p, f in flags.items():
            p.requires_grad_(f)
    return torch.stack(rows)


def trak_basic_project(
    grads: torch.Tensor,
    proj_dim: int,
    *,
    seed: int = 0,
    max_blocks: int | None = None,
    matrix: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, int]:
    """TRAK ``BasicProjector.project`` with Rademacher entries: regenerate a (P, 128) block per block.

    Returns (sketch, blocks computed, blocks total). With one block and ``matrix`` given, the matrix
    generated at construction is reused (BasicProjector's single-block fast path).
    """
    block = min(proj_dim, TRAK_BLOCK)
    n_blocks = math.ceil(proj_dim / block)
    sketch = torch.zeros(grads.shape[0], proj_dim)
    if n_blocks == 1 and matrix is not None:
        torch.matmul(grads, matrix, out=sketch)
        return sketch, 1, 1
    gen = torch.Generator()
    proj = torch.empty(grads.shape[1], block)
    done = 0
    for b in range(n_blocks if max_blocks is None else min(n_blocks, max_blocks)):
        gen.manual_seed(seed + 1000 * b)  # BasicProjector: one seeded generator state per block
        proj.bernoulli_(p=0.5, generator=gen)
        proj *= 2.0
        proj -= 1.0
        st, ed = b * block, min((b + 1) * block, proj_dim)
        sketch[:, st:ed] = grads @ proj[:, : ed - st]
        done += 1
    return sketch, done, n_blocks


def section_less(model, examples, dims, repeats, max_blocks) -> tuple[dict, list[dict]]:
    from clusterlm.selection.features import GradientFeaturizer

    names = block_linear_names(model)
    rows, targets, notes = [], [], []
    n = len(examples)
    t0 = time.perf_counter()
    full = less_full_gradients(model, examples, names)
    t_backward = time.perf_counter() - t0
    n_params = full.shape[1]
    for k_o, k_i in dims:
        d = k_o * k_i
        feat = GradientFeaturizer(model, features=names, dim=(k_o, k_i))
        ours = statistics.median(
            timed(lambda f=feat: f.featurize(examples, batch_tokens=2048, progress=False), repeats)
        )
        calls = math.ceil(n / LESS_PROJECT_INTERVAL)
        if d <= TRAK_BLOCK:
            # BasicProjector with proj_dim <= block_size generates its (P, D) matrix once, at construction:
            # not charged to the per-example cost (the baseline's best case).
            mat = torch.empty(n_params, d).bernoulli_(0.5).mul_(2).sub_(1)
            t_proj = statistics.median(
                timed(
                    lambda m=mat, d=d: [
                        trak_basic_project(full[i : i + LESS_PROJECT_INTERVAL], d, matrix=m)
                        for i in range(0, n, LESS_PROJECT_INTERVAL)
                    ],
                    repeats,
                    warmup=0,
                )
            )
            how = "1 block, matrix generated once (not charged)"
            del mat  # 4 bytes * P * D: free it before the next configuration
        else:
            t1 = time.perf_counter()
            _, measured, total = trak_basic_project(full[:LESS_PROJECT_INTERVAL], d, max_blocks=max_blocks)
            t_blocks = time.perf_counter() - t1
            t_proj = t_blocks * (total / measured) * calls
            how = f"{measured} of {total} blocks timed, x{total / measured:g} (identical blocks), {calls} call(s)"
        less_total = t_backward + t_proj
        ratio = less_total / ours
        rows.append(
            [
                f"{k_o}x{k_i} = {d}",
                f"{n_params / 1e6:.2f} M",
                f"{ours:.2f}",
                f"{t_backward:.2f}",
                f"{t_proj:.2f}",
                f"{less_total:.2f}",
                f"{ratio:.1f}x",
                how,
            ]
        )
        if d == max(a * b for a, b in dims):
            targets.append(
                {
                    "goal": f"fused per-example features >= 50x faster than LESS-style materialise-then-"
                    f"project (D={d})",
                    "measured": f"{ratio:.0f}x",
                    "met": ratio >= 50,
                }
            )
        if d <= TRAK_BLOCK:
            notes.append(
                f"D={d} fits one TRAK block: LESS's best case (no per-call regeneration); the per-example "
                f"backward dominates and the fused path is {ratio:.1f}x faster (below the 50x goal, which "
                "holds for D > 128 where the dense matrix must be regenerated every call)."
            )
    notes.insert(
        0,
        f"{n} examples of {len(examples[0]['input_ids'])} tokens; layers = every nn.Linear of the "
        f"blocks ({len(names)} layers, P = {n_params:,} weights; the lm head is left out as in LESS, and "
        "its 4 bytes * P * 128 TRAK block would not fit in memory here). Ours: GradientFeaturizer(features="
        "those names), "
        "batched (2048 tokens per batch), activation-only backward, Kronecker projection. LESS-style: "
        "batch-size-1 forward+backward per example, gradients flattened, TRAK BasicProjector Rademacher "
        "(bernoulli_ block regenerated per block per call, 128 columns, every 16 examples), float32 on "
        "CPU (LESS uses fp16 on GPU).",
    )
    section = {
        "heading": "Fused per-example features vs LESS-style materialise-then-project (CPU)",
        "columns": [
            "output dim D",
            "grad size P",
            "ours (s)",
            "LESS bs-1 backward (s)",
            "LESS projection (s)",
            "LESS total (s)",
            "speed-up",
            "how the projection was timed",
        ],
        "rows": rows,
        "notes": notes,
    }
    return section, targets


# ---- 2. featurize vs training step ------------------------------------------------------------------


def section_train_ratio(model, batches, repeats) -> tuple[dict, list[dict]]:
    from clusterlm.selection.features import GradientFeaturizer

    train_model = copy.deepcopy(model)
    train_model.train()
    opt = torch.optim.AdamW(train_model.parameters(), lr=1e-5)
    tensors = [(torch.tensor([e["input_ids"] for e in b]), torch.tensor([e["labels"] for e in b])) for b in batches]

    def train_steps():
        for ids, labels in tensors:
            loss = train_model(input_ids=ids, labels=labels, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    n_tok = sum(len(e["input_ids"]) for b in batches for e in b)
    n_ex = sum(len(b) for b in batches)
    t_train = statistics.median(timed(train_steps, repeats)) / len(batches)
    rows = [
        [
            "training step (fwd + bwd + AdamW)",
            f"{t_train:.3f}",
            "1.00",
            f"{n_ex / len(batches) / t_train:.1f}",
            f"{n_tok / len(batches) / t_train:.0f}",
            "-",
        ]
    ]
    targets = []
    goals = {"paper": 0.5, "lm_head": 0.5, "all-linear": 1.0}
    batch_tokens = max(len(b) * max(len(e["input_ids"]) for e in b) for b in batches)
    flat = [e for b in batches for e in b]
    for preset, goal in goals.items():
        feat = GradientFeaturizer(model, features=preset, dim=None if preset == "paper" else (64, 64))
        t = statistics.median(
            timed(lambda f=feat: f.featurize(flat, batch_tokens=batch_tokens, progress=False), repeats)
        ) / len(batches)
        ratio = t / t_train
        rows.append(
            [
                f"featurize layers={preset!r} (D={feat.feature_dim})",
                f"{t:.3f}",
                f"{ratio:.2f}",
                f"{n_ex / len(batches) / t:.1f}",
                f"{n_tok / len(batches) / t:.0f}",
                f"<= {goal}",
            ]
        )
        targets.append(
            {
                "goal": f"featurize('{preset}') / training step <= {goal}",
                "measured": f"{ratio:.2f}",
                "met": ratio <= goal,
            }
        )
    notes = [
        f"{len(batches)} batches of {len(batches[0])} x {len(batches[0][0]['input_ids'])} tokens; medians of "
        f"{repeats} runs after one warm-up, per batch. The training step computes logits and loss for every "
        "position (Hugging Face loss); featurize runs the body forward, a vocabulary pass only over answer "
        "tokens (no logits tensor), and for 'all-linear' an activation-only backward."
    ]
    section = {
        "heading": "Featurize time vs one training step on the same batches (CPU)",
        "columns": ["what", "seconds / batch", "ratio to training step", "examples/s", "tokens/s", "goal"],
        "rows": rows,
        "notes": notes,
    }
    return section, targets


# ---- 3. memory --------------------------------------------------------------------------------------


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(method: str, n_tok: int, vocab: int, hidden: int) -> None:
    """Run one lm-head feature computation and print its peak memory above the inputs (JSON)."""
    from cluster_kernels.lm_head_features import lm_head_features
    from cluster_kernels.projection import random_projection

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n_tok, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    labels = torch.randint(0, vocab, (n_tok,), generator=gen)
    cu = torch.tensor([0, n_tok // 2, n_tok])
    p_in = random_projection(hidden, 64, seed=0, name="in")
    p_out = random_projection(vocab, 64, seed=0, name="out")

    def materialised():  # the authors' proxy: full logits, log_softmax, gather
        logits = h @ weight.T
        logp = torch.log_softmax(logits, dim=-1)
        p_y = logp.gather(1, labels[:, None]).squeeze(1).exp()
        per_tok = (p_y - 1.0)[:, None] * h
        return torch.stack([per_tok[cu[i] : cu[i + 1]].mean(0) for i in range(len(cu) - 1)])

    fns = {
        "materialised": materialised,
        "paper": lambda: lm_head_features(h, weight, labels, cu, mode="paper", backend="torch"),
        "projected": lambda: lm_head_features(
            h, weight, labels, cu, p_in=p_in, p_out=p_out, mode="projected", backend="torch"
        ),
    }
    fn = fns[method]
    ref = fn()  # warm-up (and lazy initialisations) before the peak is reset
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    before = _rss("VmRSS:")
    t0 = time.perf_counter()
    res = fn()
    seconds = time.perf_counter() - t0
    peak = _rss("VmHWM:") - before
    err = None
    if method == "paper":
        err = float((res - materialised()).abs().max() / materialised().abs().max())
    del ref
    print(json.dumps({"method": method, "peak_bytes": peak, "seconds": seconds, "rel_err_vs_materialised": err}))


def section_memory(n_tok: int, vocab: int, hidden: int) -> tuple[dict, list[dict]]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    results = {}
    for method in ("materialised", "paper", "projected"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--memory-child",
                method,
                "--tokens",
                str(n_tok),
                "--vocab",
                str(vocab),
                "--hidden",
                str(hidden),
                "--threads",
                str(torch.get_num_threads()),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        results[method] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["materialised"]["peak_bytes"]
    rows = []
    labels = {
        "materialised": "authors' proxy: logits + log_softmax materialised",
        "paper": "lm_head_features(mode='paper'), torch path",
        "projected": "lm_head_features(mode='projected', 64x64), torch path",
    }
    for method, r in results.items():
        rows.append(
            [
                labels[method],
                f"{r['peak_bytes'] / 2**20:.1f}",
                f"{r['peak_bytes'] / base:.3f}",
                f"{r['seconds'] * 1e3:.0f}",
            ]
        )
    ratio = results["paper"]["peak_bytes"] / base
    notes = [
        f"T = {n_tok} tokens, V = {vocab}, d = {hidden}, float32; each measured in a fresh process after a "
        "warm-up: peak RSS above the inputs (large allocations forced to mmap).",
        f"paper-mode features equal the materialised proxy to rel. err. "
        f"{results['paper']['rel_err_vs_materialised']:.1e}.",
    ]
    section = {
        "heading": f"Peak memory of the lm-head features at V = {vocab}, T = {n_tok} (CPU)",
        "columns": ["method", "peak MiB", "ratio to materialised", "ms"],
        "rows": rows,
        "notes": notes,
    }
    targets = [
        {
            "goal": "lm_head_features peak memory <= 1/8 of the materialised log_softmax proxy",
            "measured": f"{ratio:.3f} ({1 / ratio:.0f}x less)",
            "met": ratio <= 1 / 8,
        }
    ]
    return section, targets


# ---- main -------------------------------------------------------------------------------------------


def print_section(section: dict) -> None:
    print(f"\n## {section['heading']}")
    widths = [max(len(str(c)), *(len(str(r[i])) for r in section["rows"])) for i, c in enumerate(section["columns"])]
    print(" | ".join(str(c).ljust(w) for c, w in zip(section["columns"], widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in section["rows"]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    for n in section["notes"]:
        print(f"  note: {n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--less-blocks", type=int, default=1, help="TRAK blocks timed per projection call")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's); fewer on a shared machine"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--memory-child", choices=["materialised", "paper", "projected"], help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=32000, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, args.tokens, args.vocab, args.hidden)
        return

    if args.quick:
        vocab, hidden, n_layers, inter, seq, n_less, n_batches, bsz = 2000, 64, 2, 128, 64, 4, 2, 4
        less_dims, mem = [(8, 16), (16, 16)], (256, 2000, 64)
    else:
        vocab, hidden, n_layers, inter, seq, n_less, n_batches, bsz = 32000, 256, 4, 688, 256, 16, 3, 8
        less_dims, mem = [(8, 16), (64, 64)], (512, 32000, 256)
    started = time.perf_counter()
    model = build_llama(vocab, hidden, n_layers, inter)
    examples = make_examples(max(n_less, n_batches * bsz), seq, vocab)
    batches = [examples[i * bsz : (i + 1) * bsz] for i in range(n_batches)]

    sections, targets = [], []
    for build in (
        lambda: section_less(model, examples[:n_less], less_dims, args.repeats, args.less_blocks),
        lambda: section_train_ratio(model, batches, args.repeats),
        lambda: section_memory(*mem),
    ):
        section, tgt = build()
        print_section(section)
        sections.append(section)
        targets.extend(tgt)
    model_note = (
        f"Model: LlamaForCausalLM from a config ({n_layers} layers, hidden {hidden}, intermediate {inter}, "
        f"vocab {vocab}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, float32); "
        f"random token sequences of {seq} tokens with 25-75 % prompt (-100 labels)."
    )
    sections[0]["notes"].insert(0, model_note)
    if args.threads:
        sections[0]["notes"].append(
            f"Run with --threads {args.threads}: every method here uses {args.threads} torch thread(s), which keeps "
            "the ratios stable when other jobs share the CPU (oversubscribed OpenMP threads slowed small ops 5-10x)."
        )
    if args.quick:
        for s in sections:
            s["notes"].append("--quick run: small sizes, not the issue's configuration.")
    print("\n## Targets")
    for t in targets:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['goal']}: {t['measured']}")
    report = {
        "title": "Gradient features: fused kernels vs materialising baselines",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": "python benchmarks/features_report.py"
        + (" --quick" if args.quick else "")
        + (f" --threads {args.threads}" if args.threads else ""),
        "sections": sections,
        "targets": targets,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(f"\nwrote {args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
