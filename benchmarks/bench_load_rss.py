"""Host peak memory of loading a model in each dtype (issue 21): ``load_model(name, device, dtype)`` in a fresh process.

Each load runs in its own interpreter and reports ``ru_maxrss`` (peak resident set) and the weights' bytes, so the
numbers are the whole process's peak: interpreter, torch, transformers and the model, and, after the load, the
anonymous (heap) and file-backed (memory-mapped checkpoint pages) parts of the resident set.

    python benchmarks/bench_load_rss.py [--model smollm2-135m-instruct] [--device cpu]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_description  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys, threading, time, torch
from clusterlm.models import load_model

def anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024

peak_anon, loading = [anon_mib()], True

def sample():  # the anonymous part of the peak: a float32 host copy would show here, mapped file pages do not
    while loading:
        peak_anon[0] = max(peak_anon[0], anon_mib())
        time.sleep(0.002)

sampler = threading.Thread(target=sample)
sampler.start()
model, _, _ = load_model(sys.argv[1], device=sys.argv[2], dtype=sys.argv[3])
loading = False
sampler.join()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("RssAnon", "RssFile")))
anon, file = (int(status[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"anon_mib": anon, "file_mib": file, "dtype": sys.argv[3], "weights_mib": weights / 2**20,
                  "param_dtype": str(next(model.parameters()).dtype), "peak_rss_mib": peak,
                  "peak_anon_mib": max(peak_anon[0], anon)}))
"""


def measure(model: str, device: str, dtype: str) -> dict:
    """One load in a fresh process: its peak RSS and weight bytes."""
    out = subprocess.run([sys.executable, "-c", CHILD, model, device, dtype], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load_rss.json"))
    args = ap.parse_args(argv)
    rows = [measure(args.model, args.device, d) for d in ("float32", "bfloat16")]
    table = [[f"{r['dtype']} ({r['param_dtype']})", f"{r['weights_mib']:.0f}", f"{r['peak_rss_mib']:.0f}",
              f"{r['peak_anon_mib']:.0f}", f"{r['anon_mib']:.0f} / {r['file_mib']:.0f}"] for r in rows]
    f32, b16 = rows
    notes = [
        "Anonymous memory is the process's own heap: a float32 host copy of the weights would raise it. The "
        "checkpoint's memory-mapped pages (file-backed, page cache) count in peak RSS only.",
        f"bfloat16 peak anonymous - float32 peak anonymous = {b16['peak_anon_mib'] - f32['peak_anon_mib']:.0f} MiB "
        f"vs bfloat16 weights {b16['weights_mib']:.0f} MiB: the weights are converted tensor by tensor from the "
        "mapped file, no float32 copy.",
    ]
    result = {
        "title": f"Host memory of loading {args.model} per dtype (issue 21)",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description("1 process", ["torch", "transformers"]),
        "command": shlex.join(["python", "benchmarks/bench_load_rss.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "sections": [{"heading": f"load_model({args.model!r}, device={args.device!r}, dtype=...) in a fresh process",
                      "columns": ["dtype", "weights MiB", "peak RSS MiB", "peak anonymous MiB (sampled every 2 ms)",
                                  "after load: anonymous / file-backed MiB"],
                      "rows": table, "notes": notes}],
        "raw": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for line in [" | ".join(result["sections"][0]["columns"]), *(" | ".join(r) for r in table), *notes]:
        print(line)
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
