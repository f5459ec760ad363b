"""How long a 2-rank run takes to notice each fault, and what it loses (issue 37): the table of docs/training.md.

    python benchmarks/bench_faults.py            # about 5 minutes on 2 CPU cores; writes benchmarks/results/faults.json
    python benchmarks/bench_faults.py --render-only   # rewrite faults.json's tables from its raw rows

Every scenario trains the tiny model on 16 short examples (``--plan full``, 2 gloo ranks, a checkpoint every
``SAVE_EVERY`` steps) and injects one fault once the run has logged ``AT`` steps:

* preemption: SIGTERM to the ``clusterlm train`` process; measured: seconds to the exit (status 75), steps lost
  (those after the checkpoint it wrote: 0 by design);
* a dead rank: SIGKILL to rank 1 with ``--max-restarts 1``; measured: seconds until the launcher logs the restart,
  and steps redone (those after the last periodic checkpoint);
* a hung rank: SIGSTOP to rank 1 with ``--dist-timeout 20``; measured: seconds to the failed exit;
* a dead rank without restarts: SIGKILL to rank 1; measured: seconds to the failed exit (the others stopped).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clusterlm.launch.ranks import rank_pids

STEPS, SAVE_EVERY, AT = 400, 10, 15
OUT = Path(__file__).resolve().parent / "results" / "faults.json"


def _losses(out: Path) -> dict[int, float]:
    try:
        text = (out / "metrics.jsonl").read_text(encoding="utf-8")
    except OSError:
        return {}
    recs = []
    for line in text.splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:
            continue
    return {r["step"]: r["loss"] for r in recs if r.get("kind") == "train"}


def _rank_pid(root: int, rank: int) -> int:
    pids = rank_pids(root)
    if rank not in pids:
        raise RuntimeError(f"rank {rank} not found under {root}: {pids}")
    return pids[rank]


def scenario(name: str, data: Path, root: Path, extra: list[str], fault: str) -> dict:
    out = root / name
    cmd = [sys.executable, "-m", "clusterlm", "train", "--plan", "full", "--model", "tiny-llama", "--data",
           str(data), "--out", str(out), "--no-progress", "--no-save-model", "--nproc", "2", "--max-steps",
           str(STEPS), "--micro-batch-size", "1", "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "100",
           "--log-every", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while max(_losses(out), default=0) < AT:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: ended early: {proc.stderr.read()[-1000:]}")
        time.sleep(0.02)
    at = max(_losses(out))
    victim = proc.pid if fault == "SIGTERM" else _rank_pid(proc.pid, 1)
    os.kill(victim, getattr(signal, fault))
    t0 = time.monotonic()
    noticed = None
    lines = []
    for line in proc.stderr:  # the restart line (a restart run) or the end of the run
        lines.append(line.rstrip())
        if noticed is None and line.startswith("clusterlm"):
            noticed = time.monotonic() - t0
    proc.wait()
    took = time.monotonic() - t0
    if fault == "SIGSTOP":
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass
    ckpts = sorted(int(p.stem.split("_")[1]) for p in (out / "ckpt").glob("step_*.pt"))
    last_ckpt = max((c for c in ckpts if c <= at), default=0)
    message = next((x for x in lines if x.startswith("clusterlm")), "")
    return {"fault": name, "signal": fault, "options": " ".join(extra), "fault_at_step": at, "exit_status":
            proc.returncode, "noticed_s": round(noticed if noticed is not None else took, 1), "ended_s": round(took, 1),
            "steps_lost": 0 if fault == "SIGTERM" else at - last_ckpt, "message": message[:300]}


def result(rows: list[dict], date: str) -> dict:
    """The rows in the format of every result file (``render_benchmarks.py`` renders it into BENCHMARKS.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import machine_description

    hung = next(r for r in rows if r["signal"] == "SIGSTOP")
    table = [[r["fault"], r["signal"] + (f" ({r['options']})" if r["options"] else ""), r["fault_at_step"],
              f"{r['noticed_s']} s", f"{r['ended_s']} s", r["exit_status"], r["steps_lost"]] for r in rows]
    return {
        "title": "Faults of a 2-rank run: how long the job takes to notice them, and what it loses",
        "date": date, "machine": machine_description("2 gloo ranks x 1 thread", ["torch"]),
        "command": "python benchmarks/bench_faults.py",
        "sections": [{"heading": "Faults (tiny model, 400 steps, a checkpoint every 10 steps, the fault at step ~15)",
                      "columns": ["fault", "injected", "at step", "noticed after", "run ended after", "exit",
                                  "steps lost"], "rows": table,
                      "notes": ["noticed: the launcher's first line about it (the restart, the preemption, the failed "
                                "rank); steps lost: those after the last complete checkpoint (a preemption "
                                "checkpoints the step it stops at); each fault's message is in raw.rows"]}],
        "targets": [
            {"goal": "preemption: exit 75 with the current step checkpointed (0 steps lost)",
             "measured": f"exit {rows[0]['exit_status']}, {rows[0]['steps_lost']} steps lost",
             "met": rows[0]["exit_status"] == 75 and rows[0]["steps_lost"] == 0},
            {"goal": "hung rank: the run fails within --dist-timeout 20 s + 20 s, naming the rank",
             "measured": f"{hung['ended_s']} s; " + ("names rank 1" if "rank 1" in hung["message"] else "no rank"),
             "met": hung["ended_s"] <= 40 and "rank 1" in hung["message"]},
        ],
        "raw": {"steps": STEPS, "save_every": SAVE_EVERY, "rows": rows},
    }


def main() -> None:
    if "--render-only" in sys.argv:  # rewrite the result from its raw rows (no run)
        old = json.loads(OUT.read_text(encoding="utf-8"))
        OUT.write_text(json.dumps(result(old["raw"]["rows"], old["date"]), indent=1) + "\n", encoding="utf-8")
        return
    root = Path(tempfile.mkdtemp(prefix="bench_faults_"))
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def add_{i}(x):", "response": f"    return x + {i}\n"}) + "\n"
                            for i in range(16)), encoding="utf-8")
    rows = [
        scenario("preemption", data, root, [], "SIGTERM"),
        scenario("dead rank, --max-restarts 1", data, root, ["--max-restarts", "1", "--preemption-grace", "10"],
                 "SIGKILL"),
        scenario("dead rank", data, root, ["--preemption-grace", "10"], "SIGKILL"),
        scenario("hung rank, --dist-timeout 20", data, root, ["--dist-timeout", "20", "--preemption-grace", "10"],
                 "SIGSTOP"),
    ]
    OUT.write_text(json.dumps(result(rows, time.strftime("%Y-%m-%d")), indent=1) + "\n", encoding="utf-8")
    print("| fault | noticed after | run ended after | exit | steps lost |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['fault']} | {r['noticed_s']} s | {r['ended_s']} s | {r['exit_status']} | {r['steps_lost']} |")
    print(f"written: {OUT}")


if __name__ == "__main__":
    main()
