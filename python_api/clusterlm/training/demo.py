"""``clusterlm demo``: the whole method on the built-in data set, select then train, in one call.

:func:`run_demo` selects for ``world_size`` ranks on the built-in data (:mod:`clusterlm.data.demo`) with the
built-in tiny Llama (:mod:`clusterlm.selection.pipeline`), then trains the plan for a few steps on CPU ranks
(:func:`train_demo`, the reference trainer). It lives apart from :mod:`clusterlm.data.demo` because the models
are built from that data set: :mod:`clusterlm.models` imports it, and this module imports the models' users.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from clusterlm.config.demo import DemoConfig
from clusterlm.config.selection import SelectConfig
from clusterlm.config.training import TrainConfig
from clusterlm.data.demo import demo_data
from clusterlm.launch.launcher import SpawnFailed
from clusterlm.selection.pipeline import SelectJob, run_select
from clusterlm.training.run import train

__all__ = ["run_demo", "train_demo"]



def run_demo(config: DemoConfig | None = None) -> None:
    """Select on the built-in data for ``config.world_size`` ranks at ``config.ratio``, then train
    ``config.train_steps`` steps.

    Writes ``OUT/plan`` (plan, report) and ``OUT/train`` (metrics, curve); prints where.

    Raises:
        TypeError: ``config`` is not a :class:`DemoConfig`.
        RuntimeError: the training processes failed.
    """
    config = DemoConfig.merged(config, {})
    config.check()
    out, world_size, ratio, seed = Path(config.out), config.world_size, config.ratio, config.seed
    train_steps, progress = config.train_steps, config.progress
    t0 = time.perf_counter()
    demo = demo_data()
    print(f"built-in data set: {demo.train} (held-out: {demo.heldout})")
    run_select(SelectJob(model="tiny-llama", data=str(demo.train), out=out / "plan", progress=progress,
                         config=SelectConfig(world_size=world_size, ratio=ratio, seed=seed)))
    t_select = time.perf_counter() - t0
    if train_steps > 0:
        print(f"\n[train] {world_size} CPU ranks (gloo), {train_steps} steps on the plan", flush=True)
        summary = train_demo(out / "plan", out / "train", nproc=world_size, max_steps=train_steps, seed=seed,
                             progress=progress)
        before, after = summary.get("initial_eval_loss"), summary.get("final_eval_loss")
        if before is not None and after is not None:
            print(f"held-out answer-token loss: {before:.3f} before -> {after:.3f} after training")
        print(f"metrics: {out / 'train' / 'metrics.jsonl'}\ncurve:   {out / 'train' / 'training.png'}")
    print(f"plan:    {out / 'plan' / 'plan.json'}\nreport:  {out / 'plan' / 'report.png'}")
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s (selection {t_select:.1f} s)")


def train_demo(
    plan_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    nproc: int = 2,
    max_steps: int = 40,
    micro_batch_size: int = 8,
    lr: float = 1e-3,
    eval_every: int = 20,
    eval_max_examples: int | None = 128,
    seed: int = 0,
    progress: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """Train the demo model on the demo data with a plan made by ``clusterlm demo``; returns the summary.

    Args:
        plan_dir: the plan (made on the demo train split for ``nproc`` ranks).
        out_dir: output directory (an earlier run there is overwritten).
        nproc: processes (CPU ranks with gloo, or GPUs).
        max_steps / micro_batch_size / lr / eval_every / eval_max_examples / seed: trainer options.
        progress: progress bar.
        overrides: further :class:`clusterlm.TrainConfig` settings (e.g. ``fsdp=True``).

    Raises:
        RuntimeError: the training processes failed.
    """
    demo = demo_data()
    config = TrainConfig(plan=str(plan_dir), model="tiny-llama", data=str(demo.train), eval_data=str(demo.heldout),
                         out=str(out_dir), max_steps=max_steps, micro_batch_size=micro_batch_size, lr=lr,
                         warmup_steps=max(1, max_steps // 10), eval_every=eval_every, seed=seed, overwrite=True,
                         save_model=False, eval_max_examples=eval_max_examples, progress=progress, nproc=nproc)
    try:
        return train(config.replace(**dict(overrides))).summary
    except SpawnFailed as e:
        raise RuntimeError(f"train_demo: the trainer exited with status {e.code} (its output is above).") from None
