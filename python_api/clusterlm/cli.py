"""Command line: ``clusterlm <command>`` (also ``python -m clusterlm``).

Commands:
    select  features -> capacity-constrained K-means -> balanced selection -> DIR/plan.{json,npz} and
            DIR/report.png, with a summary table.
    train   the reference DDP trainer on a plan (or a baseline: full, random:<ratio>); --nproc N spawns
            the ranks through torch.distributed.run.
    compare full data, random, cluster (default and paper presets), S2L, IFD and LESS through the same
            trainer: selection seconds, training seconds, held-out loss (compare.json/.md/.png).
    report  redraw DIR/report.png and print the summary of a saved plan.
    demo    the whole method on the built-in data set (Python standard-library functions, a small
            Llama model): select for 2 ranks at 31 %, then a short 2-process training run on CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEMO_OUT = "runs/demo"


def _stage(step: str, text: str) -> float:
    print(f"[{step}] {text}", flush=True)
    return time.perf_counter()


def _size_arg(value: str) -> int | str | None:
    """Cluster-size bounds: an int, 'budget', '<f>x' or 'none'."""
    if value.lower() == "none":
        return None
    if value.isdigit():
        return int(value)
    return value


def _feature_tokens_arg(value: str) -> int | str:
    """Feature window: an int >= 2 or 'all' (whole examples)."""
    if value.lower() == "all":
        return "all"
    if value.isdigit() and int(value) >= 2:
        return int(value)
    raise argparse.ArgumentTypeError(f"expected an int >= 2 or 'all', got {value!r}")


def _dim_arg(value: str) -> int | tuple[int, int]:
    if "x" in value:
        k_o, k_i = value.split("x", 1)
        return int(k_o), int(k_i)
    return int(value)


_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _select_argv_for_ranks(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` (the launcher's option, not the ranks')."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def launch_select(argv: list[str], nproc: int) -> int:
    """Run ``clusterlm select`` on ``nproc`` processes through torch's launcher (``-m clusterlm.select``)."""
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank unless the user asks otherwise
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "clusterlm.select", *argv]
    return subprocess.run(cmd, env=env, check=False).returncode


def _run_select_distributed(args: argparse.Namespace) -> Any:
    """One rank of ``torchrun -m clusterlm.select``: sharded features, distributed K-means, plan on rank 0."""
    from types import SimpleNamespace

    import numpy as np

    from cluster_kernels.distributed import allgather_rows, distributed_capacity_kmeans
    from clusterlm.data import CHAT_TEMPLATE_MODES, load_data
    from clusterlm.distributed import barrier, featurize_sharded, init_distributed
    from clusterlm.models import load_model
    from clusterlm.report import draw_report, save_report_data
    from clusterlm.select import PRESETS, _l2_normalise, build_featurizer, resolve_feature_tokens, select_from_features
    from clusterlm.store import FeatureStore

    info = init_distributed()
    main_rank = info.rank == 0
    show = main_rank and not args.no_progress
    out = Path(args.out)
    if args.preset not in PRESETS:
        raise ValueError(f"select: preset must be one of {PRESETS}, got {args.preset!r}.")
    features = args.features or ("paper" if args.preset == "paper" else "lm_head")
    t0 = _stage("1/4", f"model {args.model} on {info.world_size} processes") if main_rank else time.perf_counter()
    model, tokenizer, model_id = load_model(args.model)
    data = load_data(args.data, tokenizer, max_length=args.max_length, progress=show,
                     chat_template=CHAT_TEMPLATE_MODES[args.chat_template])
    store_dir = Path(args.feature_store) if args.feature_store else out / "features"
    if main_rank:
        _stage("2/4", f"gradient features ({features}), sharded over {info.world_size} processes -> {store_dir}")
    featurizer = build_featurizer(model, features, dim=args.dim, seed=args.seed,
                                  max_tokens=resolve_feature_tokens(args.preset, args.feature_tokens))
    t1 = time.perf_counter()
    part = featurize_sharded(featurizer, data, store_dir, rank=info.rank, world_size=info.world_size,
                             batch_tokens=args.batch_tokens, progress=show)
    x_local = part.local()
    timings = {"features": time.perf_counter() - t1}

    def clustering(n_clusters: int, *, min_size: Any, max_size: Any, n_init: int, max_iter: int, seed: int,
                   l2_normalize: bool) -> Any:
        xl = _l2_normalise(x_local) if l2_normalize else x_local  # per row: the same as normalising globally
        # init_sample_size = N: k-means++ on all rows, so the plan equals the single-process one
        res = distributed_capacity_kmeans(xl, n_clusters, min_size=min_size, max_size=max_size, n_init=n_init,
                                          max_iter=max_iter, seed=seed, init_sample_size=len(data), progress=show)
        return SimpleNamespace(labels=allgather_rows(np.asarray(res.labels, dtype=np.int64)),
                               distances=allgather_rows(np.asarray(res.distances, dtype=np.float64)),
                               inertia=res.inertia, n_iter=res.n_iter, converged=res.converged)

    full = FeatureStore(store_dir).features()
    plan = select_from_features(
        full, world_size=args.world_size, lengths=data.lengths, ratio=args.ratio, budget=args.budget,
        token_ratio=args.token_ratio, token_budget=args.token_budget, preset=args.preset, seed=args.seed,
        max_cluster_size=args.max_cluster_size,
        min_cluster_size=args.min_cluster_size, within_cluster=args.within_cluster, allocation=args.allocation,
        token_balance=None if args.token_balance is None else args.token_balance == "on",
        clusters_per_rank=args.clusters_per_rank, fingerprint=data.fingerprint(), model_id=model_id,
        timings=timings, clustering=clustering,
        extra_config={"features": featurizer.config() | {"layers_preset": features},
                      "selection_processes": info.world_size},
    )
    plan.config["data"] = {"source": str(args.data), "max_length": args.max_length, "n_truncated": data.n_truncated,
                           "format": data.format}
    if main_rank:
        _stage("3/4", f"writing {out}/plan.json, plan.npz")
        plan.save(out)
        save_report_data(out, full, seed=args.seed)
        _stage("4/4", f"drawing {out}/report.png")
        draw_report(out, plan)
        print()
        print(plan.summary())
        print(f"\nplan:   {out / 'plan.json'} (+ plan.npz)\nreport: {out / 'report.png'}  "
              f"[{time.perf_counter() - t0:.1f} s]")
    barrier()
    return plan


def run_select(args: argparse.Namespace) -> Any:
    """Load model and data, select, save the plan and its report; returns the plan.

    ``--nproc N`` (N > 1) re-launches the command on N processes through ``torch.distributed.run``; under
    torchrun (``torchrun -m clusterlm.select ...``) every process featurizes its shard of the data into
    one feature store and the K-means runs distributed (:func:`cluster_kernels.distributed_capacity_kmeans`);
    rank 0 writes the plan. The plan is the same as the single-process one.
    """
    if all(k in os.environ for k in _TORCHRUN_ENV) and int(os.environ["WORLD_SIZE"]) > 1:
        return _run_select_distributed(args)
    if getattr(args, "nproc", 1) > 1:
        argv = _select_argv_for_ranks(args, args.argv) if getattr(args, "argv", None) else None
        if argv is None:
            raise ValueError("select: --nproc needs the command line (use `clusterlm select ... --nproc N`).")
        rc = launch_select(argv, args.nproc)
        if rc != 0:
            raise RuntimeError(f"select: the {args.nproc} selection processes failed (exit status {rc}); see above.")
        from clusterlm.plan import Plan

        return Plan.load(args.out)
    from clusterlm.data import CHAT_TEMPLATE_MODES, load_data
    from clusterlm.models import load_model
    from clusterlm.report import draw_report, save_report_data
    from clusterlm.select import select

    out = Path(args.out)
    t0 = _stage("1/4", f"model {args.model}")
    model, tokenizer, model_id = load_model(args.model)
    data = load_data(args.data, tokenizer, max_length=args.max_length, progress=not args.no_progress,
                     chat_template=CHAT_TEMPLATE_MODES[args.chat_template])
    truncated = f", {data.n_truncated} truncated to {args.max_length} tokens" if data.n_truncated else ""
    print(f"      data {args.data}: {len(data)} examples ({data.format}, rendering {data.rendering}), "
          f"{int(data.lengths.sum())} tokens{truncated} "
          f"[{time.perf_counter() - t0:.1f} s]")
    _stage("2/4", f"gradient features ({args.features or 'preset default'}) + K-means, world size {args.world_size}")
    plan, feats = select(
        model, data, world_size=args.world_size, ratio=args.ratio, budget=args.budget,
        token_ratio=args.token_ratio, token_budget=args.token_budget, preset=args.preset,
        features=args.features, dim=args.dim, feature_tokens=args.feature_tokens, seed=args.seed,
        max_cluster_size=args.max_cluster_size,
        min_cluster_size=args.min_cluster_size, within_cluster=args.within_cluster, allocation=args.allocation,
        token_balance=None if args.token_balance is None else args.token_balance == "on",
        clusters_per_rank=args.clusters_per_rank, feature_store=args.feature_store, progress=not args.no_progress,
        batch_tokens=args.batch_tokens, model_id=model_id, return_features=True,
    )
    plan.config["data"] = {"source": str(args.data), "max_length": args.max_length, "n_truncated": data.n_truncated,
                           "format": data.format}
    t0 = _stage("3/4", f"writing {out}/plan.json, plan.npz")
    plan.save(out)
    save_report_data(out, feats, seed=args.seed)
    _stage("4/4", f"drawing {out}/report.png")
    draw_report(out, plan)
    print()
    print(plan.summary())
    print(f"\nplan:   {out / 'plan.json'} (+ plan.npz)\nreport: {out / 'report.png'}")
    return plan


def cmd_select(args: argparse.Namespace) -> int:
    run_select(args)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from clusterlm.plan import Plan
    from clusterlm.report import draw_report

    plan = Plan.load(args.dir)
    path = draw_report(args.dir, plan)
    print(plan.summary())
    print(f"\nreport: {path}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from clusterlm.train import cmd_train as train_command

    return train_command(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from clusterlm.demo import demo_data
    from clusterlm.train import train_demo

    t0 = time.perf_counter()
    demo = demo_data()
    print(f"built-in data set: {demo.train} (held-out: {demo.heldout})")
    out = Path(args.out)
    sel = build_parser().parse_args(
        ["select", "--model", "tiny-llama", "--data", str(demo.train), "--world-size", str(args.world_size),
         "--ratio", str(args.ratio), "--out", str(out / "plan"), "--seed", str(args.seed)]
        + (["--no-progress"] if args.no_progress else [])
    )
    run_select(sel)
    t_select = time.perf_counter() - t0
    if args.train_steps > 0:
        print(f"\n[train] {args.world_size} CPU ranks (gloo), {args.train_steps} steps on the plan", flush=True)
        summary = train_demo(out / "plan", out / "train", nproc=args.world_size, max_steps=args.train_steps,
                             seed=args.seed, progress=not args.no_progress)
        before, after = summary.get("initial_eval_loss"), summary.get("final_eval_loss")
        if before is not None and after is not None:
            print(f"held-out answer-token loss: {before:.3f} before -> {after:.3f} after training")
        print(f"metrics: {out / 'train' / 'metrics.jsonl'}\ncurve:   {out / 'train' / 'training.png'}")
    print(f"plan:    {out / 'plan' / 'plan.json'}\nreport:  {out / 'plan' / 'report.png'}")
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s (selection {t_select:.1f} s)")
    return 0


def _add_select_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="built-in name (tiny-llama, tiny-llama-pretrained, smollm2-135m-instruct), a .gguf file, "
                   "or a local HF model directory")
    p.add_argument("--data", required=True, help=".jsonl/.json/.parquet with prompt/response, "
                   "instruction/input/output or messages columns")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs) that will train")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--ratio", type=float, help="fraction of the data to keep, e.g. 0.31")
    budget.add_argument("--budget", type=int, help="number of examples to keep")
    budget.add_argument("--token-ratio", type=float, help="fraction of the tokens to keep, e.g. 0.31 (default preset)")
    budget.add_argument("--token-budget", type=int, help="number of tokens to keep (default preset)")
    p.add_argument("--out", required=True, help="directory for plan.json, plan.npz and report.png")
    p.add_argument("--preset", choices=("default", "paper"), default="default")
    p.add_argument("--features", default=None, help="lm_head | paper | all-linear | lora (default: the preset's)")
    p.add_argument("--dim", type=_dim_arg, default=None, help="projected feature size: 1024 or 32x32 (default)")
    p.add_argument("--feature-tokens", type=_feature_tokens_arg, default=None,
                   help="feature window: tokens per example the features look at (answer start + some prompt), or "
                   "'all'; default: 64 (--preset default), all (--preset paper)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-cluster-size", type=_size_arg, default="1.5x", help="int, '<f>x' of N/C, or none")
    p.add_argument("--min-cluster-size", type=_size_arg, default="budget", help="int, 'budget', or none")
    p.add_argument("--within-cluster", choices=("farthest", "nearest", "random", "kcenter"), default="farthest")
    p.add_argument("--allocation", choices=("cluster-per-rank", "stratified"), default="cluster-per-rank")
    p.add_argument("--token-balance", choices=("on", "off"), default=None, help="default: on (off for --preset paper)")
    p.add_argument("--clusters-per-rank", type=int, default=1)
    p.add_argument("--feature-store", default=None, help="directory to keep features in (resumable)")
    p.add_argument("--max-length", type=int, default=1024, help="truncate examples to this many tokens")
    p.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="render prompt/response data through the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per featurization forward")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--nproc", type=int, default=1,
                   help="selection processes on this machine (torch.distributed.run; sharded features and "
                   "distributed K-means; the plan is the same as with 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clusterlm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_sel = sub.add_parser("select", help="select per-rank training examples and write a plan")
    _add_select_args(p_sel)
    p_sel.set_defaults(func=cmd_select)
    p_train = sub.add_parser("train", help="reference DDP trainer on a plan (torchrun; gloo on CPU, nccl on GPU)")
    from clusterlm.train import add_train_args

    add_train_args(p_train)
    p_train.set_defaults(func=cmd_train)
    p_cmp = sub.add_parser("compare", help="all selection methods through the same trainer: time and held-out loss")
    from clusterlm.compare import add_compare_args, cmd_compare

    add_compare_args(p_cmp)
    p_cmp.set_defaults(func=cmd_compare)
    p_rep = sub.add_parser("report", help="redraw report.png and print the summary of a saved plan")
    p_rep.add_argument("dir", help="plan directory")
    p_rep.set_defaults(func=cmd_report)
    p_demo = sub.add_parser("demo", help="the whole method on the built-in standard-library code data set")
    p_demo.add_argument("--world-size", type=int, default=2)
    p_demo.add_argument("--ratio", type=float, default=0.31)
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.add_argument("--out", default=DEMO_OUT)
    p_demo.add_argument("--train-steps", type=int, default=40, help="optimizer steps of the demo training (0: skip)")
    p_demo.add_argument("--no-progress", action="store_true")
    p_demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # the subcommand's own arguments, for --nproc re-launches
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
