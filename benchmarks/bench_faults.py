"""How long a 2-rank run takes to notice each fault, and what it loses (issues 37 and 52): the table of
docs/training.md.

    python benchmarks/bench_faults.py            # about 6 minutes on 2 CPU cores; writes benchmarks/results/faults.json
    python benchmarks/bench_faults.py --preemption-only   # the preemption rows only (about 2 minutes); the others kept
    python benchmarks/bench_faults.py --render-only   # rewrite faults.json's tables from its raw rows

Every scenario trains the tiny model on 16 short examples (``--plan full``, 2 gloo ranks, a checkpoint every
``SAVE_EVERY`` steps) and injects one fault once the run has logged ``AT`` steps:

* preemption: SIGTERM to the ``clusterlm train`` process; SIGTERM, SIGUSR1 or SIGINT to its whole process group (the
  launcher and its agent get it directly, and the agent passes it to the ranks: what Ctrl-C and a scheduler's group
  signal do); SIGTERM to rank 1 only (what ``srun`` does to one task); measured: seconds to the exit (status 75),
  steps lost (those after the checkpoint it wrote: 0 by design);
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


def scenario(name: str, data: Path, root: Path, extra: list[str], fault: str, target: str = "rank 1") -> dict:
    """One run with ``fault`` (a signal name) sent to ``target``: "launcher", "group" (its process group) or
    "rank 1"."""
    out = root / name.replace(" ", "_").replace(",", "")
    cmd = [sys.executable, "-m", "clusterlm", "train", "--plan", "full", "--model", "tiny-llama", "--data",
           str(data), "--out", str(out), "--no-progress", "--no-save-model", "--nproc", "2", "--max-steps",
           str(STEPS), "--micro-batch-size", "1", "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "100",
           "--log-every", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a job step's or a terminal's
    while max(_losses(out), default=0) < AT:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: ended early: {proc.stderr.read()[-1000:]}")
        time.sleep(0.02)
    at = max(_losses(out))
    victim = _rank_pid(proc.pid, 1)
    if target == "group":
        os.killpg(proc.pid, getattr(signal, fault))
    else:
        os.kill(proc.pid if target == "launcher" else victim, getattr(signal, fault))
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
    message = next((x for x in lines if x.startswith("clusterlm")), "")
    if proc.returncode == 75:  # preempted: the steps logged after the step it checkpointed
        lost = max(_losses(out)) - json.loads((out / "preempted.json").read_text(encoding="utf-8"))["step"]
    else:
        ckpts = sorted(int(p.stem.split("_")[1]) for p in (out / "ckpt").glob("step_*.pt"))
        lost = at - max((c for c in ckpts if c <= at), default=0)
    injected = fault + {"launcher": " to the launcher", "group": " to the process group",
                        "rank 1": " to rank 1" if name.startswith("preemption") else ""}[target]
    return {"fault": name, "signal": injected, "options": " ".join(extra), "fault_at_step": at,
            "exit_status": proc.returncode, "noticed_s": round(noticed if noticed is not None else took, 1),
            "ended_s": round(took, 1), "steps_lost": lost, "message": message[:300], "date": time.strftime("%Y-%m-%d")}


PREEMPTIONS = [("preemption", "SIGTERM", "launcher"), ("preemption, group SIGTERM", "SIGTERM", "group"),
               ("preemption, group SIGUSR1", "SIGUSR1", "group"), ("preemption, group SIGINT", "SIGINT", "group"),
               ("preemption, one rank", "SIGTERM", "rank 1")]


def result(rows: list[dict], date: str) -> dict:
    """The rows in the format of every result file (``render_benchmarks.py`` renders it into BENCHMARKS.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import machine_description

    hung = next(r for r in rows if r["signal"].startswith("SIGSTOP"))
    preempted = [r for r in rows if r["fault"].startswith("preemption")]
    table = [[r["fault"], r["signal"] + (f" ({r['options']})" if r["options"] else ""), r["fault_at_step"],
              f"{r['noticed_s']} s", f"{r['ended_s']} s", r["exit_status"], r["steps_lost"]] for r in rows]
    dates = sorted({r.get("date", date) for r in rows})
    return {
        "title": "Faults of a 2-rank run: how long the job takes to notice them, and what it loses",
        "date": date, "machine": machine_description("2 gloo ranks x 1 thread", ["torch"]),
        "command": "python benchmarks/bench_faults.py",
        "sections": [{"heading": "Faults (tiny model, 400 steps, a checkpoint every 10 steps, the fault at step ~15)",
                      "columns": ["fault", "injected", "at step", "noticed after", "run ended after", "exit",
                                  "steps lost"], "rows": table,
                      "notes": ["noticed: the launcher's first line about it (the restart, the preemption, the failed "
                                "rank); steps lost: those after the last complete checkpoint (a preemption "
                                "checkpoints the step it stops at); each fault's message is in raw.rows"]
                      + ([f"rows measured on {', '.join(dates)} (raw.rows: each row's date)"] if len(dates) > 1
                         else [])}],
        "targets": [
            {"goal": "preemption, whichever processes get the signal: exit 75 with the current step checkpointed "
                     "(0 steps lost)",
             "measured": "; ".join(f"{r['signal']}: exit {r['exit_status']}, {r['steps_lost']} lost"
                                   for r in preempted),
             "met": all(r["exit_status"] == 75 and r["steps_lost"] == 0 for r in preempted)},
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
    rows = [scenario(name, data, root, [], fault, target) for name, fault, target in PREEMPTIONS]
    if "--preemption-only" in sys.argv:  # the other rows as measured before
        old = json.loads(OUT.read_text(encoding="utf-8"))["raw"]["rows"]
        rows += [{"date": old_date(), **r} for r in old if not r["fault"].startswith("preemption")]
    else:
        rows += [
            scenario("dead rank, --max-restarts 1", data, root, ["--max-restarts", "1", "--preemption-grace", "10"],
                     "SIGKILL"),
            scenario("dead rank", data, root, ["--preemption-grace", "10"], "SIGKILL"),
            scenario("hung rank, --dist-timeout 20", data, root, ["--dist-timeout", "20", "--preemption-grace", "10"],
                     "SIGSTOP"),
        ]
    OUT.write_text(json.dumps(result(rows, time.strftime("%Y-%m-%d")), indent=1) + "\n", encoding="utf-8")
    print("| fault | injected | noticed after | run ended after | exit | steps lost |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['fault']} | {r['signal']} | {r['noticed_s']} s | {r['ended_s']} s | {r['exit_status']} | "
              f"{r['steps_lost']} |")
    print(f"written: {OUT}")


def old_date() -> str:
    """The date of the result file's rows (those a --preemption-only run keeps)."""
    return json.loads(OUT.read_text(encoding="utf-8"))["date"]


if __name__ == "__main__":
    main()
