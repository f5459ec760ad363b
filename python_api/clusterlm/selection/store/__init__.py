"""FeatureStore: per-example features on disk, written in shards, resumable, read out of core.

Layout of a store directory::

    manifest.json        format and version, feature dim, shard size, the producing configuration, per-shard records
                         (file, rows, sha256 of the shard's input data, sha256 of its float32 rows, sha256 of its
                         signals), n_examples and ``complete`` when done
    shard_00000.npy      float32 (shard_size, dim) for examples [0, shard_size), ... (while running)
    shard_00000.signals.npy  float64 (shard_size, 2): each example's gradient norm and loss (while running)
    shard_00000.claim    while a process computes shard 0: its claim (locked; pid and host inside)
    features.npy         float32 (n_examples, dim), written when the run completes; read as np.memmap
    signals.npy          float64 (n_examples, 2), written with it (:meth:`FeatureStore.signals`)

Signals (:mod:`clusterlm.selection.store.signals`): the featurizer's free per-example signals
(:class:`clusterlm.selection.signals.ExampleSignals`: the norm of each feature before normalisation and the
example's loss) are written with each shard, before its features, and checksummed in its record
(``signals_sha256``); they are assembled into ``signals.npy`` with ``features.npy``. They are optional in the
format: a record without them (an older clusterlm's, version 2 without signals) reads as before and the store then
has no signals, so the format version stays 2 and stores written earlier keep working in both directions.

Crash safety: a shard is written to a temporary file, fsync'ed and renamed into place
(:func:`clusterlm.fileio.atomic_write`), and only then recorded in the manifest (itself replaced atomically).
A run killed at any point leaves complete shards and a manifest that lists only complete shards; a restart
skips them and recomputes the rest, so the result is identical to an uninterrupted run. The final
``features.npy`` is assembled shard by shard into a temporary file and renamed; shard files are removed only
after the manifest says ``complete``. Nothing half-written is ever listed.

Integrity: every shard record holds the sha256 of the shard's float32 rows (``sha256``), the same bytes
``features.npy`` holds at rows ``[index * shard_size, ...)``, so one checksum covers a row block in both
files. A shard is checked when it is read and when ``features.npy`` is assembled; ``features.npy`` is
checked block by block the first time :meth:`FeatureStore.features` opens it (once per file and store
object; ``verify=False`` skips it). A block that fails (a bit flip, a truncated or missing file) is
dropped from the manifest with a message naming it, and the next run of the featurizer on the store
recomputes just that block (blocks that fail in ``features.npy`` are re-listed as incomplete; their
sound neighbours are kept and read back from ``features.npy``). ``begin`` drops truncated or missing
shard files up front (a warning), so the same run recomputes them.

Versions: the manifest names its format and version (``"format": "clusterlm.features", "version": 2``;
read by :func:`clusterlm.fileio.read_versioned_json`, like plan.json). Version 2 is checksummed: a record without
its ``sha256`` fails its check like a bit flip (the block is dropped and recomputed). Stores of version 1
(``"format": "clusterlm.features/1"``, records that may lack ``sha256``) still read, with a warning that
their integrity cannot be checked; a resumed version-1 store stays version 1.

Full disks: ``features.npy`` is preallocated (``os.posix_fallocate``, where the file system has it) and
written with plain writes, never through a writable memory map, so a full disk is an ``OSError``
(ENOSPC / EDQUOT / EIO) naming the file and the bytes needed, not a SIGBUS; the temporary file is removed
and the shards are kept, so a rerun with space finishes the store.

Reads: ``features()`` returns a read-only ``np.memmap`` (nothing loaded until indexed), and
``iter_blocks`` streams fixed-size row blocks, so N may exceed memory.

Several writers: processes (ranks) may write disjoint shards of one store at the same time. Every
manifest update re-reads the manifest under an exclusive lock of the store directory (a blocking
:class:`clusterlm.fileio.FileLock`), so no writer's record is lost; a temporary file is locked by its writer
until it is renamed into place (:func:`clusterlm.fileio.atomic_write`), and the clean-up on ``begin`` removes
only temporary files and claims nobody holds (those of killed writers; :func:`clusterlm.fileio.remove_stale`). A
restarted writer therefore never disturbs one still running. ``reload()`` re-reads the manifest to see
what the others have finished.

Claims: so that two processes that fill the same shards (two ``select`` runs on one store) do every
shard once, a shard is claimed while it is computed: ``shard_<index>.claim``, a
:class:`clusterlm.fileio.FileLock` holding its holder's pid and host (the lock dies with the process, so a
killed writer's claim is free at once). :meth:`FeatureStore.claim` takes a claim if nobody holds it (False:
done, or a live process computes it); :meth:`wait_for_shards` waits for the shards others compute and
returns those left to do. :meth:`FeatureStore.shard_record` --
what the featurizers ask before computing a shard -- claims an unrecorded shard for its caller, and when
a live process holds it, waits for that process's record instead of computing it a second time.
``write_shard`` releases the claim, and ``finalize`` runs once (the others wait and return its result).
(Without ``fcntl``, or where the file system refuses ``flock``, there is no locking: claims always
succeed and one writer at a time is assumed.)

Modules: :mod:`~clusterlm.selection.store.feature_store` (``FeatureStore``: manifest, begin, write, read),
:mod:`~clusterlm.selection.store.claims` (shard claims), :mod:`~clusterlm.selection.store.checks` (checksums, dropped
blocks), :mod:`~clusterlm.selection.store.assembly` (``features.npy``), :mod:`~clusterlm.selection.store.signals`
(``signals.npy``) and :mod:`~clusterlm.selection.store.files` (file names, npy files).
"""

from clusterlm.selection.store.feature_store import FeatureStore
from clusterlm.selection.store.files import STORE_FORMAT, STORE_VERSION

__all__ = ["STORE_FORMAT", "STORE_VERSION", "FeatureStore"]
