"""PlanSampler: a rank's examples of a :class:`clusterlm.plan.Plan`, in an order shared by all ranks.

Every rank builds ``PlanSampler(plan, rank, seed=seed)`` with the *same* plan and seed. Each epoch the
sampler yields ``plan.indices(rank)[perm]`` where ``perm`` is one permutation of the positions
``0 .. m-1`` drawn from ``(seed, epoch)``: the same on every rank, because every rank has the same m.
Position ``j`` of every rank therefore still holds examples of the same length quantile (that is how
the plan aligns tokens across ranks), so per-step token balance survives reshuffling, while the order
changes from epoch to epoch. With ``epoch_shuffle=False`` the plan order is used as is.

Resuming mid-epoch. A DataLoader fetches indices ahead of training (prefetching, worker processes),
so a sampler cannot know how many examples were *trained on* by counting what it yielded. The
trainer does the counting:

    sampler.set_epoch(epoch)
    for batch in loader:
        train_step(batch)
        sampler.advance(len(batch))          # examples trained on, after the step completed
        if time_to_checkpoint:
            save({"sampler": sampler.state_dict(), ...})

and on restart ``sampler.load_state_dict(saved["sampler"])`` before the loop: the next iteration
starts at the saved position of the saved epoch (``set_epoch`` with the same epoch keeps it; a new
epoch starts at 0). ``len(sampler)`` is the number of indices the next iteration yields.

The Hugging Face ``Trainer`` skips already-trained batches itself (``skip_first_batches``); it only
needs ``set_epoch`` and the fact that an epoch's order depends on nothing but ``(seed, epoch)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from clusterlm.plan import Plan

__all__ = ["PlanSampler"]

# Mixed into the seed so the epoch permutations are not the same stream as other seed-0 generators.
_STREAM = 0x5A3B1E


class PlanSampler(Sampler[int]):
    """Yields one rank's data set indices of a plan, reshuffled per epoch identically on every rank.

    Args:
        plan: the plan (the same on every rank).
        rank: this process's rank, in ``[0, plan.world_size)``.
        epoch_shuffle: permute positions each epoch with a permutation drawn from ``(seed, epoch)``;
            False visits the plan order every epoch.
        seed: shuffle seed; must be the same on every rank.

    Raises:
        TypeError: plan is not a :class:`~clusterlm.plan.Plan`.
        ValueError: rank outside ``[0, plan.world_size)`` or a negative seed.
    """

    def __init__(self, plan: Plan, rank: int, *, epoch_shuffle: bool = True, seed: int = 0) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"PlanSampler: plan must be a clusterlm.plan.Plan, got {type(plan).__name__}.")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < plan.world_size:
            raise ValueError(
                f"PlanSampler: rank must be an int in [0, {plan.world_size}) (the plan's world size), got {rank!r}; "
                "use a plan made for this run's world size."
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"PlanSampler: seed must be a non-negative int, got {seed!r}.")
        self.plan = plan
        self.rank = int(rank)
        self.epoch_shuffle = bool(epoch_shuffle)
        self.seed = int(seed)
        self._indices = plan.indices(self.rank)
        self.epoch = 0
        self._position = 0  # examples of this epoch the trainer reported as trained (advance)
        self._start = 0  # where the next iteration begins

    def order(self, epoch: int | None = None) -> np.ndarray:
        """(m,) int64 data set indices of ``epoch`` (default: the current one) in visit order."""
        epoch = self.epoch if epoch is None else int(epoch)
        if not self.epoch_shuffle:
            return self._indices.copy()
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, _STREAM]))
        return self._indices[rng.permutation(len(self._indices))]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields.

        A different epoch starts at position 0; the current epoch keeps a position restored by
        :meth:`load_state_dict`, so ``load_state_dict`` followed by ``set_epoch(saved epoch)`` resumes.

        Raises:
            ValueError: a negative or non-integer epoch.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"PlanSampler.set_epoch: epoch must be a non-negative int, got {epoch!r}.")
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._position = 0
            self._start = 0

    def __len__(self) -> int:
        return len(self._indices) - self._start

    def __iter__(self) -> Iterator[int]:
        # Eager (not a generator): the resume offset is consumed when the DataLoader creates its iterator.
        order = self.order()
        start = self._start
        # The resume offset applies to one iteration only; a further pass over the same epoch is complete.
        self._start = 0
        self._position = start
        return iter(order[start:].tolist())

    def advance(self, n: int) -> None:
        """Record that ``n`` more examples of the current epoch were trained on (called by the trainer).

        Raises:
            ValueError: n negative, or the position would pass the end of the epoch.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"PlanSampler.advance: n must be a non-negative int, got {n!r}.")
        if self._position + n > len(self._indices):
            raise ValueError(
                f"PlanSampler.advance: position {self._position} + {n} passes the end of the epoch "
                f"({len(self._indices)} examples); call set_epoch(next epoch) before training on it."
            )
        self._position += int(n)

    @property
    def position(self) -> int:
        """Examples of the current epoch trained on so far (as reported with :meth:`advance`)."""
        return self._position

    def state_dict(self) -> dict[str, Any]:
        """Epoch and position (and what they refer to) for :meth:`load_state_dict`."""
        return {
            "epoch": self.epoch,
            "position": self._position,
            "rank": self.rank,
            "seed": self.seed,
            "epoch_shuffle": self.epoch_shuffle,
            "per_rank": len(self._indices),
            "data_sha256": str(self.plan.fingerprint["sha256"]),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration yields the saved epoch's order from the saved position.

        Args:
            state: a :meth:`state_dict` (``epoch`` and ``position`` are required; the other keys, when
                present, must match this sampler).

        Raises:
            ValueError: missing keys, a position outside ``[0, m]``, or a state saved for another
                rank, seed, shuffle setting or plan.
        """
        for key in ("epoch", "position"):
            if key not in state:
                raise ValueError(f"PlanSampler.load_state_dict: state lacks {key!r}; pass a PlanSampler.state_dict().")
        mine = self.state_dict()
        differs = [
            f"{k} saved {state[k]!r}, this sampler {mine[k]!r}"
            for k in ("rank", "seed", "epoch_shuffle", "per_rank", "data_sha256")
            if k in state and state[k] != mine[k]
        ]
        if differs:
            raise ValueError(
                "PlanSampler.load_state_dict: the state belongs to another sampler (" + "; ".join(differs) + "); "
                "resume with the same plan, rank and seed."
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._indices):
            raise ValueError(
                f"PlanSampler.load_state_dict: need epoch >= 0 and position in [0, {len(self._indices)}], got "
                f"epoch {epoch}, position {position}."
            )
        self.epoch = epoch
        self._position = position
        self._start = position
