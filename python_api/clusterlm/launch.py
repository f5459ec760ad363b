"""Processes: the one torchrun launcher and the one process-group initialiser of ``train`` and ``select``.

Launching. ``clusterlm train --nproc N`` and ``clusterlm select --nproc N`` both run torch's own launcher
(``python -m torch.distributed.run``, what ``torchrun`` runs) in a subprocess::

    python -m torch.distributed.run --nproc-per-node N --standalone -m clusterlm.train ARGS
    python -m torch.distributed.run --nproc-per-node 8 --nnodes 2 --rdzv-backend c10d \\
        --rdzv-endpoint node0:29500 --rdzv-id run1 -m clusterlm.train ARGS        # on every node

(:func:`torchrun_command`, :func:`spawn`). One process on one node is ``python -m <module> ARGS``.

Joining. Every rank calls :func:`init_distributed`: under torchrun (:data:`TORCHRUN_ENV` set, world size
> 1) it joins the env:// process group — nccl on CUDA (this rank's device ``LOCAL_RANK``), gloo on CPU —
and returns where the process sits (:class:`DistInfo`); otherwise it returns rank 0 of 1 without a group.
:func:`is_main`, :func:`barrier`, :func:`all_gather_floats` and :func:`all_gather_objects` work with or
without a group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "SELECT_MODULE", "TORCHRUN_ENV", "TRAIN_MODULE", "DistInfo", "all_gather_floats", "all_gather_objects", "barrier",
    "in_process_group", "init_distributed", "is_main", "spawn", "strip_options", "torchrun_command", "under_torchrun",
]

# What torchrun sets in every rank's environment (the rendezvous address included).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# The -m entry points of the two multi-process commands.
TRAIN_MODULE = "clusterlm.train"
SELECT_MODULE = "clusterlm.select"


# ---------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------


def under_torchrun() -> bool:
    """True in a process that torchrun (``torch.distributed.run``) started: all of :data:`TORCHRUN_ENV` set."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def torchrun_command(
    argv: Sequence[str],
    nproc: int,
    *,
    module: str = TRAIN_MODULE,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "clusterlm",
) -> list[str]:
    """The ``python -m torch.distributed.run ... -m MODULE ARGV`` command line.

    Args:
        argv: the module's arguments.
        nproc: processes on this node.
        module: the ``-m`` module every rank runs (``clusterlm.train``, ``clusterlm.select``).
        nnodes: nodes; > 1 needs ``rdzv_endpoint`` (c10d rendezvous), 1 runs ``--standalone``.
        rdzv_endpoint: ``host:port`` of the rendezvous.
        rdzv_id: run id shared by the nodes.

    Raises:
        ValueError: ``nnodes > 1`` without an endpoint.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(int(nproc))]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError(
                f"{module.rsplit('.', 1)[-1]}: --nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (a node all others "
                "can reach), got none."
            )
        cmd += ["--nnodes", str(int(nnodes)), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    else:
        cmd.append("--standalone")
    return [*cmd, "-m", module, *argv]


def strip_options(argv: Sequence[str], options: Sequence[str]) -> list[str]:
    """``argv`` without the value-taking ``options`` (``--opt VALUE`` and ``--opt=VALUE``): the launcher's own."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(f"{o}=") for o in options):
            out.append(a)
    return out


def spawn(
    module: str,
    argv: Sequence[str],
    nproc: int,
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "clusterlm",
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``python -m MODULE ARGV`` on ``nproc`` processes of this node (and ``nnodes`` nodes); the exit status.

    More than one process (or node) goes through :func:`torchrun_command`; one is a plain child process.
    ``OMP_NUM_THREADS`` defaults to 1 (torch's launcher would set it with a warning; the ranks set torch's
    thread count themselves).

    Args:
        module: e.g. ``clusterlm.train``, ``clusterlm.select``.
        argv: the module's arguments.
        nproc / nnodes / rdzv_endpoint / rdzv_id: see :func:`torchrun_command`.
        env: extra environment variables for the processes.
    """
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if nproc == 1 and nnodes == 1:
        cmd = [sys.executable, "-m", module, *argv]
    else:
        cmd = torchrun_command(argv, nproc, module=module, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                               rdzv_id=rdzv_id)
    return subprocess.run(cmd, env=full_env, check=False).returncode


# ---------------------------------------------------------------------------------------------------
# Joining
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits.

    Attributes:
        rank / world_size / local_rank: torch.distributed coordinates (0 / 1 / 0 without a process group).
        backend: the process group's backend ("gloo", "nccl"), None without a group.
        device: this rank's torch device (``cuda:LOCAL_RANK`` on GPUs).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        """A process group is initialised (collectives go to the other ranks)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that logs and writes files."""
        return self.rank == 0


def in_process_group() -> bool:
    """True once a torch.distributed process group is initialised in this process."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _use_cuda(device: str) -> bool:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"init_distributed: device must be 'auto', 'cpu' or 'cuda', got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("init_distributed: device 'cuda' but torch sees no CUDA device; use --device cpu or auto.")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def init_distributed(backend: str | None = None, *, device: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (env://), or run as a single process.

    Without ``WORLD_SIZE`` in the environment (or with ``WORLD_SIZE=1``) no group is initialised and rank 0
    of 1 is returned; an already initialised group is returned as it is.

    Args:
        backend: "gloo", "nccl", ... (default: nccl on CUDA, else gloo).
        device: "auto" (CUDA when available), "cpu" or "cuda". On CUDA the process's device is set to
            ``LOCAL_RANK``.

    Returns:
        :class:`DistInfo`.

    Raises:
        ValueError: ``WORLD_SIZE > 1`` but ``RANK``, ``MASTER_ADDR`` or ``MASTER_PORT`` is missing (launch
            with torchrun); nccl or ``device="cuda"`` without CUDA.
    """
    dist = torch.distributed
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = _use_cuda(device)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("init_distributed: backend='nccl' needs CUDA, which is not available; use 'gloo'.")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if in_process_group():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), dev)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if world <= 1:
        return DistInfo(0, 1, 0, None, dev)
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(
            f"init_distributed: WORLD_SIZE={world} but {', '.join(missing)} not set; launch the processes with "
            "torchrun (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)."
        )
    backend = backend or ("nccl" if use_cuda else "gloo")
    dist.init_process_group(backend, init_method="env://", device_id=dev if backend == "nccl" else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), dev)


def is_main() -> bool:
    """True on rank 0, or when no process group is initialised (write plans, logs and reports only here)."""
    return not in_process_group() or torch.distributed.get_rank() == 0


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group)."""
    if in_process_group():
        torch.distributed.barrier()


def all_gather_floats(values: Sequence[float], di: DistInfo) -> np.ndarray:
    """(world_size, len(values)) float64: every rank's values (this rank's alone without a group)."""
    local = torch.tensor(list(values), dtype=torch.float64, device=di.device)
    if not di.distributed:
        return local.cpu().numpy()[None]
    gathered = [torch.empty_like(local) for _ in range(di.world_size)]
    torch.distributed.all_gather(gathered, local)
    return torch.stack(gathered).cpu().numpy()


def all_gather_objects(obj: Any, di: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not di.distributed:
        return [obj]
    out: list[Any] = [None] * di.world_size
    torch.distributed.all_gather_object(out, obj)
    return out
