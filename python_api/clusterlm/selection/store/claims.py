"""Shard claims: two processes that fill one store compute every shard once.

A shard is claimed while it is computed: ``shard_<index>.claim``, a :class:`clusterlm.fileio.FileLock` holding its
holder's pid and host (the lock dies with the process, so a killed writer's claim is free at once).
:class:`ShardClaims` is the part of :class:`clusterlm.selection.store.FeatureStore` that takes, waits for and releases
claims.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from clusterlm.fileio import FileLock, holder_record

__all__ = ["ShardClaims"]

_LOG = logging.getLogger("clusterlm.selection.store")


class ShardClaims:
    """Claims of a :class:`~clusterlm.selection.store.FeatureStore` (its ``path``, ``_claims``, ``_implicit``,
    ``_writer``,
    ``complete``, ``reload()`` and ``_shards()`` are the store's)."""

    def _claim_path(self, key: int | str) -> Path:
        return self.path / (f"shard_{key:05d}.claim" if isinstance(key, int) else f"{key}.claim")

    def claim(self, index: int) -> bool:
        """Claim shard ``index`` for this process to compute it (released by ``write_shard`` or :meth:`release`).

        Returns:
            True when this object now holds the claim and the shard is not stored yet (or another object of
            this process holds it: a process never waits for itself); False when it is stored (or the store
            is complete) or another live process holds the claim. The claim of a process that died is free.
        """
        index = int(index)
        if self.reload().complete or str(index) in self._shards():
            return False
        if index in self._claims:
            return True
        if not self.path.is_dir():
            return True
        lock = FileLock(self._claim_path(index), remove=True)
        if not lock.acquire():
            who = holder_record(self._claim_path(index)) or {}
            return who.get("pid") == os.getpid() and who.get("host") == socket.gethostname()
        self._claims[index] = lock
        if self.reload().complete or str(index) in self._shards():  # finished while we took the lock
            self.release(index)
            return False
        return True

    def release(self, index: int | str) -> None:
        """Give up a claim this object holds (nothing happens when it holds none)."""
        key = int(index) if not isinstance(index, str) else index
        lock = self._claims.pop(key, None)
        if self._implicit == key:
            self._implicit = None
        if lock is not None:
            lock.release()

    def claim_holder(self, index: int) -> dict[str, Any] | None:
        """``{"pid", "host", "since"}`` of the live process (not this object) that holds shard ``index``'s
        claim, or None."""
        if int(index) in self._claims:
            return None
        return holder_record(self._claim_path(int(index)))

    def _held_elsewhere(self, index: int) -> bool:
        """Another live process holds the claim (one of this process is never waited for)."""
        who = self.claim_holder(index)
        return who is not None and (who.get("pid"), who.get("host")) != (os.getpid(), socket.gethostname())

    def wait_for_shards(self, indices: Iterable[int], *, timeout: float | None = None) -> list[int]:
        """Wait while live processes compute any of ``indices``; return those still not stored.

        The returned shards are claimed by nobody (their writer died, or nobody took them): the caller's to
        compute. An empty list means every one is stored.

        Raises:
            TimeoutError: ``timeout`` seconds passed while others still held some.
        """
        pending = [int(i) for i in indices]
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while True:
            done = self.reload()._shards()
            pending = [i for i in pending if str(i) not in done]
            held = [i for i in pending if self._held_elsewhere(i)]
            if not held:
                return pending
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"FeatureStore: shards {held[:10]} of {self.path} are still being computed.")
            time.sleep(delay)
            delay = min(2 * delay, 0.25)

    def shard_record(self, index: int) -> dict[str, Any] | None:
        """The manifest record of shard ``index`` (file, rows, data_sha256, sha256), or None if not complete.

        On a store this object writes to (after :meth:`begin`), None means "compute it": the shard is then
        claimed for the caller (until its ``write_shard``, the next ``shard_record`` of another shard, or
        :meth:`close`), and while another live process holds the shard's claim this waits for that process's
        record and returns it, so two runs never compute one shard. Without ``begin`` it only reads.
        """
        index = int(index)
        rec = self._shards().get(str(index))
        if rec is not None or self.complete or not self._writer:
            return rec
        if self._implicit is not None and self._implicit != index:
            self.release(self._implicit)  # the caller did not write the last shard it asked about
        announced, delay = False, 0.01
        while True:
            if self.claim(index):
                self._implicit = index
                return None
            rec = self._shards().get(str(index))  # claim() re-read the manifest
            if rec is not None or self.complete:
                return rec
            if not announced:
                who = self.claim_holder(index) or {}
                _LOG.warning(
                    "FeatureStore: shard %d of %s is being computed by process %s on %s; waiting for it.",
                    index,
                    self.path,
                    who.get("pid", "?"),
                    who.get("host", "?"),
                )
                announced = True
            time.sleep(delay)
            delay = min(2 * delay, 0.25)
