"""This rank's rows of the distributed K-means, read in chunks: nothing of a memory-mapped input stays resident.

Rows of a ``np.memmap`` come from its file through ``preadv`` into reused buffers (a page fault on the map
costs more than the copy, and maps a whole block, up to a large folio, that would stay resident); without a
file behind it, the map is read directly and its pages handed back (``MADV_DONTNEED``) after each chunk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from cluster_kernels._checks import DataScale
from cluster_kernels._collectives import OP

FAULT_BLOCK = max(mmap.PAGESIZE, 1 << 16)  # Linux maps up to 64 KiB of cached pages around a fault
SCATTER_ROWS = 16  # scattered rows read from a memory map between two releases (when no file path is known)



class Shard:
    """Chunked access to this rank's rows as prepared float64 (centred, or unit rows for cosine).

    Rows of a ``np.memmap`` are read from its file with ``preadv`` into reused buffers (a page fault on the
    map costs more than the copy, and maps a whole block, up to a large folio, that would stay resident);
    without a file behind it, a map is read directly and its pages handed back (``MADV_DONTNEED``) after
    each chunk. Either way the data never stay resident; only one chunk is in memory at a time.
    """

    def __init__(self, x: np.ndarray, chunk_rows: int, spherical: bool) -> None:
        self.x = x
        self.n, self.d = x.shape
        self.row_bytes = self.d * x.itemsize
        self.chunk_rows = chunk_rows
        self.spherical = spherical
        self.mean = torch.zeros(self.d, dtype=torch.float64)
        self.scale = DataScale()  # rows are clustered as x * 2**-scale.exponent (cluster_kernels._checks.data_scale)
        self._buf: np.ndarray | None = None  # reused chunk of prepared rows (no allocation per chunk)
        self._raw: np.ndarray | None = None  # reused chunk of rows as stored
        mm = getattr(x, "_mmap", None)
        # Copy-on-write maps ("c") may hold the caller's private edits, which only the map shows.
        self._mm = mm if (mm is not None and getattr(x, "mode", "c") != "c" and x.flags.c_contiguous) else None
        self._file: tuple[str, int] | None = None  # (path, file offset of local row 0)
        self._fd: int | None = None
        if self._mm is not None:
            self._base = np.frombuffer(self._mm, dtype=np.uint8).ctypes.data
            offset, path = getattr(x, "offset", None), getattr(x, "filename", None)
            if isinstance(offset, int) and path and hasattr(os, "preadv"):
                # np.memmap maps from the allocation-granularity boundary below its offset.
                self._file = (path, offset - offset % mmap.ALLOCATIONGRANULARITY + x.ctypes.data - self._base)

    def chunks(self) -> Iterator[tuple[int, int]]:
        for s in range(0, self.n, self.chunk_rows):
            yield s, min(self.n, s + self.chunk_rows)

    def release(self, s: int = 0, e: int | None = None) -> None:
        """Hand the pages of rows ``[s, e)`` of a memory map back (they stay in the page cache)."""
        if self._mm is None or self.n == 0:
            return
        e = self.n if e is None else e
        first = self.x.ctypes.data - self._base + s * self.row_bytes
        last = first + (e - s) * self.row_bytes
        # Outward to whole fault-around blocks: a page fault maps the aligned block around it, so pages
        # beside the rows read are resident too (handing back a page that is still needed only costs a
        # re-fault from the page cache).
        start = first // FAULT_BLOCK * FAULT_BLOCK
        length = min(len(self._mm), -(-last // FAULT_BLOCK) * FAULT_BLOCK) - start
        if length > 0:
            self._mm.madvise(mmap.MADV_DONTNEED, start, length)

    def _pread(self, row: int, out: np.ndarray) -> None:
        """Fill ``out`` (consecutive rows, C-contiguous) from the file, starting at local row ``row``."""
        if self._fd is None:
            self._fd = os.open(self._file[0], os.O_RDONLY)
        want = out.nbytes
        got = os.preadv(self._fd, [memoryview(out.reshape(-1).view(np.uint8))], self._file[1] + row * self.row_bytes)
        if got != want:
            raise OSError(f"{OP}: short read of {self._file[0]} ({got} of {want} bytes); was the file truncated?")

    def block(self, s: int, e: int) -> np.ndarray:
        """Rows ``[s, e)`` (at most ``chunk_rows``) as stored; a reused buffer, valid until the next call."""
        if self._file is None:
            return self.x[s:e]
        if self._raw is None:
            self._raw = np.empty((self.chunk_rows, self.d), dtype=self.x.dtype)
        out = self._raw[: e - s]
        self._pread(s, out)
        return out

    def prepare(self, block: np.ndarray, out: np.ndarray | None = None) -> torch.Tensor:
        """float64 rows in the working frame minus the mean (one pass when the frame is not rescaled, the float32
        -> float64 conversion being exact), or unit rows.

        With ``out`` (a reused buffer of at least ``len(block)`` rows) nothing is allocated.
        """
        out = np.empty(block.shape, dtype=np.float64) if out is None else out[: len(block)]
        if self.scale.exponent:  # exact: float64 copy times a power of two (in two steps, see times_pow2)
            out[...] = block
            p = -self.scale.exponent
            out *= 2.0 ** (p // 2)
            out *= 2.0 ** (p - p // 2)
            block = out
        if self.spherical:
            out[...] = block
            out /= np.sqrt(np.einsum("ij,ij->i", out, out))[:, None]
            return torch.from_numpy(out)
        np.subtract(block, self.mean_np, out=out)
        return torch.from_numpy(out)

    def prepared(self, s: int, e: int) -> torch.Tensor:
        """Prepared rows ``[s, e)`` (at most ``chunk_rows``) in the shard's buffer: valid until the next call."""
        if self._buf is None:
            self._buf = np.empty((self.chunk_rows, self.d), dtype=np.float64)
        rows = self.prepare(self.block(s, e), self._buf)
        self.release(s, e)
        return rows

    @property
    def mean(self) -> torch.Tensor:
        return torch.from_numpy(self.mean_np)

    @mean.setter
    def mean(self, value: torch.Tensor) -> None:
        self.mean_np = np.ascontiguousarray(value.numpy(), dtype=np.float64)

    def rows(self, idx: np.ndarray) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """Prepared rows of the sorted local indices ``idx``, ``chunk_rows`` at a time (buffer reused)."""
        if self._buf is None:
            self._buf = np.empty((self.chunk_rows, self.d), dtype=np.float64)
        for s in range(0, len(idx), self.chunk_rows):
            part = idx[s : s + self.chunk_rows]
            yield part, self.prepare(self.take(part), self._buf)

    def take(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` (sorted local indices) as an in-memory array of the input dtype."""
        raw = np.empty((len(idx), self.d), dtype=self.x.dtype)
        if self._file is None:
            for b in range(0, len(idx), SCATTER_ROWS):
                sub = idx[b : b + SCATTER_ROWS]
                raw[b : b + len(sub)] = self.x[sub]
                self.release(int(sub[0]), int(sub[-1]) + 1)
            return raw
        breaks = np.nonzero(np.diff(idx) != 1)[0] + 1  # one read per run of consecutive rows
        for a, b in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(idx)]]), strict=True):
            self._pread(int(idx[a]), raw[a:b])
        return raw

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@functools.cache
def _libc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``).

    After a large array is freed, glibc serves arrays up to its size from the heap instead of fresh maps,
    and a heap only shrinks from its top: without this, memory freed by one phase (the init sample, a
    large distance block) stays resident through the whole run.
    """
    trim = _libc_trim()
    if trim is not None:
        trim(0)
