"""The GPU run's features check: GPU features against CPU float32 features of the same examples, and speed.

Two numbers the GPU path must show (issue 21, item 6):

- agreement: the lm-head features (32 x 32, the default) of the first ``--n-ref`` examples computed on
  ``--device`` in ``--dtype`` (CUDA, bfloat16) against the same features on the CPU in float32, as the cosine
  per example (features are L2-normalised, so the cosine is their dot product);
- speed: tokens per second of the featurization of ``--n`` examples on ``--device`` against a plain forward of
  the same model in the same dtype over the same examples in the same padded batches (logits included, no
  features): the goal is at least 0.9x, since the features replace the lm head's logits by one fused pass.

Writes ``OUT/gpu_features_check.json`` and prints a summary. Runs anywhere: ``--device cpu --dtype float32``
(the test suite does so on tiny-llama) checks the script itself.

Usage::

    python benchmarks/gpu/compare_features.py --model smollm2-135m-instruct --data TRAIN.jsonl --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "python_api"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

COSINE_GOAL = 0.99  # bf16 weights and activations against float32: ~3 significant digits per entry
SPEED_GOAL = 0.9


def cosine_per_example(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of row ``i`` of ``a`` and row ``i`` of ``b`` (0 where a row is all zeros)."""
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"cosine_per_example: a and b must be 2-D of one shape, got {a.shape} and {b.shape}.")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    dots = (a64 * b64).sum(axis=1)
    return np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), 0.0)


def summarize(cos: np.ndarray, goal: float = COSINE_GOAL) -> dict[str, Any]:
    """Min, 1st percentile, median, mean and how many examples are below ``goal``."""
    if cos.size == 0:
        raise ValueError("summarize: no cosines (no examples were compared).")
    return {
        "n": int(cos.size), "min": float(cos.min()), "p01": float(np.percentile(cos, 1)),
        "median": float(np.median(cos)), "mean": float(cos.mean()), "below_goal": int((cos < goal).sum()),
        "goal": goal, "worst_example": int(cos.argmin()),
    }


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped as the featurizer groups them: sorted by length, ``len(batch) * longest <= batch_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * max(lengths[i], lengths[cur[-1]]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of ``fn`` (device work included)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def plain_forward(model: Any, examples: Sequence[dict[str, Any]], batch_tokens: int, pad_id: int) -> None:
    """The model's ordinary forward (logits included, no gradient) over ``examples`` in the featurizer's batches."""
    device = next(model.parameters()).device
    lengths = [len(ex["input_ids"]) for ex in examples]
    with torch.no_grad():
        for idx in length_batches(lengths, batch_tokens):
            longest = max(lengths[i] for i in idx)
            ids = torch.full((len(idx), longest), pad_id, dtype=torch.long)
            mask = torch.zeros(len(idx), longest, dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : lengths[i]] = torch.as_tensor(np.asarray(examples[i]["input_ids"]))
                mask[row, : lengths[i]] = 1
            model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)


def _examples(data: Any, n: int) -> list[dict[str, Any]]:
    return [{"input_ids": np.asarray(data[i]["input_ids"]), "labels": np.asarray(data[i]["labels"])}
            for i in range(min(n, len(data)))]


def _features(model: Any, examples: list[dict[str, Any]], batch_tokens: int) -> np.ndarray:
    from clusterlm.selection.features import GradientFeaturizer

    fz = GradientFeaturizer(model, features="lm_head", dim=(32, 32), seed=0)
    return np.asarray(fz.featurize(examples, batch_tokens=batch_tokens, progress=False))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Agreement and speed; the result dict that goes to ``gpu_features_check.json``."""
    import cluster_kernels
    from clusterlm.data import load_data
    from clusterlm.models import load_model

    model, tok, model_id = load_model(args.model, device=args.device, dtype=args.dtype, root=args.root)
    data = load_data(args.data, tok, max_length=args.max_length, progress=False)
    examples = _examples(data, args.n)
    device = next(model.parameters()).device
    _features(model, examples[:8], args.batch_tokens)  # warm-up: autotuning, compiles, the kernels' self-checks
    feats: dict[str, np.ndarray] = {}
    t_feat = timed(lambda: feats.setdefault("gpu", _features(model, examples, args.batch_tokens)), device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    plain_forward(model, examples[:8], args.batch_tokens, pad)
    t_fwd = timed(lambda: plain_forward(model, examples, args.batch_tokens, pad), device)
    tokens = int(sum(len(ex["input_ids"]) for ex in examples))
    backends = cluster_kernels.backends_used()
    ref_model, _, _ = load_model(args.model, device=args.ref_device, dtype=args.ref_dtype, root=args.root)
    ref = _features(ref_model, examples[: args.n_ref], args.batch_tokens)
    cos = cosine_per_example(feats["gpu"][: args.n_ref], ref)
    summary = summarize(cos)
    ratio = (tokens / t_feat) / (tokens / t_fwd)
    return {
        "model": model_id, "device": str(device), "dtype": str(args.dtype),
        "ref": f"{args.ref_device}/{args.ref_dtype}",
        "examples": len(examples), "tokens": tokens, "batch_tokens": args.batch_tokens,
        "features_tokens_per_s": tokens / t_feat, "forward_tokens_per_s": tokens / t_fwd,
        "speed_ratio": ratio, "speed_goal": SPEED_GOAL, "speed_met": bool(ratio >= SPEED_GOAL),
        "cosine": summary, "cosine_met": bool(summary["below_goal"] == 0), "backends": backends,
        "cosines": [round(float(c), 6) for c in cos],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", required=True, help="a prompt/response .jsonl (the demo's train.jsonl)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ref-device", default="cpu")
    ap.add_argument("--ref-dtype", default="float32")
    ap.add_argument("--n", type=int, default=512, help="examples timed on --device")
    ap.add_argument("--n-ref", type=int, default=64, help="of them, compared with the reference")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--root", default=None, help="demo directory for the tiny built-in models")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(args)
    (args.out / "gpu_features_check.json").write_text(json.dumps(res, indent=1) + "\n")
    c = res["cosine"]
    print(f"features vs {res['ref']}: cosine per example min {c['min']:.5f}, median {c['median']:.5f} over "
          f"{c['n']} examples ({c['below_goal']} below {c['goal']})")
    print(f"tokens/s: features {res['features_tokens_per_s']:,.0f}, plain forward {res['forward_tokens_per_s']:,.0f}, "
          f"ratio {res['speed_ratio']:.3f} (goal >= {SPEED_GOAL}); backends {res['backends']}")
    return 0 if res["cosine_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
