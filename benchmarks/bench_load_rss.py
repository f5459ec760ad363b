"""Host peak memory of loading a model in each dtype (issue 21): ``load_model(name, device, dtype)`` in a fresh process.

Each load runs in its own interpreter and reports ``ru_maxrss`` (peak resident set) and the weights' bytes, so the
numbers are the whole process's peak: interpreter, torch, transformers and the model, and, after the load, the
anonymous (heap) and file-backed (memory-mapped checkpoint pages) parts of the resident set.

    python benchmarks/bench_load_rss.py [--model smollm2-135m-instruct] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, torch
from clusterlm.models import load_model
model, _, _ = load_model(sys.argv[1], device=sys.argv[2], dtype=sys.argv[3])
weights = sum(p.numel() * p.element_size() for p in model.parameters())
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("RssAnon", "RssFile")))
anon, file = (int(status[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"anon_mib": anon, "file_mib": file, "dtype": sys.argv[3], "weights_mib": weights / 2**20,
                  "param_dtype": str(next(model.parameters()).dtype), "peak_rss_mib": peak}))
"""


def measure(model: str, device: str, dtype: str) -> dict:
    """One load in a fresh process: its peak RSS and weight bytes."""
    out = subprocess.run([sys.executable, "-c", CHILD, model, device, dtype], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    rows = [measure(args.model, args.device, d) for d in ("float32", "bfloat16")]
    print(f"| {args.model} on {args.device} | weights MiB | peak RSS MiB | after load: anonymous / file-backed MiB |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} ({r['param_dtype']}) | {r['weights_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
              f"{r['anon_mib']:.0f} / {r['file_mib']:.0f} |")


if __name__ == "__main__":
    main()
