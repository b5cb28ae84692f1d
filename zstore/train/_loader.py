"""``WindowLoader``: batches straight from the tiers into reused batch buffers.

The tiers already hold the data in shared memory, so moving windows between processes
(what a DataLoader's workers do) is pure cost: measured here, 2 workers delivered a
tenth of what one process reads from the RAM tier.  This loader reads each batch in
the training process: one thread plans the batch (the misses of all its windows go to
the tiers and the origin in one concurrent round), a few threads copy the windows into
preallocated batch buffers (numpy releases the GIL for large copies), and the next
batches are read while the training step runs.

A batch buffer is reused only once nothing refers to it any more: a batch the user
keeps (or any view of it) is never overwritten; a new buffer is made instead.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from zstore.buffers import small_page_array
from zstore.errors import ConfigError, ZstoreError
from zstore.read import window_shape
from zstore.train.dataset import WindowDataset

#: Batches smaller than this are copied by the thread that plans them: handing 32 short
#: windows (2 MB) to the copy threads and waiting for them cost more than the copies
#: (one thread: ~18k windows/s; with 2 copy threads: ~12k, on 2 cores).
INLINE_BYTES = 8 * 2**20


class LoaderError(ZstoreError, RuntimeError):
    """Reading a batch failed; the message names the item and the window."""


class _Buffers:
    """One batch's arrays (field -> (batch, *window shape)), pinned when asked."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]], size: int, pin: bool):
        self.shapes = shapes
        self.arrays: dict[str, np.ndarray] = {}
        self._pinned: list[torch.Tensor] = []  # owners of pinned memory
        for name, (shape, dtype) in shapes.items():
            if pin:
                owner = torch.empty((size, *shape), dtype=_torch_dtype(dtype), pin_memory=True)
                self._pinned.append(owner)
                self.arrays[name] = owner.numpy()
            else:
                # small pages: see zstore.buffers.small_page_array
                self.arrays[name] = small_page_array((size, *shape), dtype)
        self.event: Any = None  # a device copy from these buffers still running
        self._base = self._counts()  # references while nothing else holds the arrays

    def _counts(self) -> list[int]:
        return [sys.getrefcount(a) for a in self.arrays.values()]

    def free(self) -> bool:
        """True when no batch handed out refers to these arrays any more: a batch (or any
        view of it) holds one more reference through its tensors' storage."""
        return all(n <= base for n, base in zip(self._counts(), self._base))


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class WindowLoader:
    """An iterable of batches of a :class:`WindowDataset`, read in this process.

    Args:
        dataset: the windows to batch (fixed-size windows: ``window_seconds`` set).
        batch_size: windows per batch.
        sampler: the order of indices (e.g. ``DistributedSampler``); default
            sequential, or random with ``shuffle=True``.
        shuffle: random order (seeded by ``seed`` and the epoch) when no sampler is given.
        drop_last: drop a last batch smaller than ``batch_size``.
        threads: threads copying windows into the batch (2 suits 2-4 cores per rank).
        prefetch: batches read ahead while the training step runs.
        pin_memory: fill page-locked buffers (a no-op without CUDA).
        device: move each batch there (non-blocking from pinned buffers).
        seed: the shuffle's seed.

    Batches are dicts like the default collate's: one tensor (batch, ...) per field,
    ``length`` (int64), ``start`` (float64 seconds) and ``item`` (list of names), in the
    sampler's order.  Call :meth:`set_epoch` before each epoch: it reaches the sampler
    and the dataset.  A dataset ``transform`` runs in the loader's threads, per window
    (heavy Python transforms belong in a DataLoader's workers or on the GPU).
    """

    def __init__(
        self,
        dataset: WindowDataset,
        batch_size: int,
        *,
        sampler: Sampler[int] | Sequence[int] | None = None,
        shuffle: bool = False,
        drop_last: bool = False,
        threads: int = 2,
        prefetch: int = 2,
        pin_memory: bool = False,
        device: str | torch.device | None = None,
        seed: int = 0,
    ):
        if not isinstance(dataset, WindowDataset):
            raise ConfigError(
                f"WindowLoader reads a zstore.WindowDataset, got "
                f"{type(dataset).__name__}; use torch's DataLoader for others"
            )
        if dataset.window_seconds is None:
            raise ConfigError(
                "WindowLoader batches fixed-size windows; this dataset returns "
                "whole items (window_seconds=None): set window_seconds, or use "
                "a DataLoader with zstore.collate_pad"
            )
        for name, value, least in (
            ("batch_size", batch_size, 1),
            ("threads", threads, 1),
            ("prefetch", prefetch, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(
                    f"{name} must be a whole number of at least {least}, got {value!r}"
                )
        self.dataset, self.batch_size = dataset, batch_size
        self.threads, self.prefetch, self.seed = threads, prefetch, int(seed)
        self.device = torch.device(device) if device is not None else None
        self.pin_memory = bool(
            pin_memory or (self.device is not None and self.device.type == "cuda")
        )
        self.pin_memory = self.pin_memory and torch.cuda.is_available()
        if sampler is None:
            sampler = (
                RandomSampler(dataset, generator=self._generator(0))
                if shuffle
                else SequentialSampler(dataset)
            )
        self.sampler = sampler
        self.drop_last = drop_last
        self._pool: list[_Buffers] = []
        self._pool_lock = threading.Lock()  # the batch thread takes, the consumer returns

    def _generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: the sampler's order and the dataset's windows."""
        self.dataset.set_epoch(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        elif isinstance(self.sampler, RandomSampler):
            self.sampler.generator = self._generator(epoch)

    def __len__(self) -> int:
        return len(BatchSampler(self.sampler, self.batch_size, self.drop_last))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = iter(BatchSampler(self.sampler, self.batch_size, self.drop_last))
        copier = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="zstore-copy")
        planner = cf.ThreadPoolExecutor(1, thread_name_prefix="zstore-batch")
        pending: deque[cf.Future] = deque()
        try:
            for indices in batches:
                pending.append(planner.submit(self._read, list(indices), copier))
                if len(pending) > self.prefetch:
                    yield self._deliver(pending.popleft().result())
            while pending:
                yield self._deliver(pending.popleft().result())
        finally:  # also on break or an error: no thread keeps reading
            for fut in pending:
                fut.cancel()
            planner.shutdown(wait=True, cancel_futures=True)
            copier.shutdown(wait=True, cancel_futures=True)

    def _read(self, indices: list[int], copier: cf.ThreadPoolExecutor) -> dict[str, Any]:
        ds = self.dataset
        if ds.transform is not None:
            return self._read_transformed(indices, copier)
        placed = [ds.placed(i) for i in indices]
        located = [p[:4] for p in placed]
        buffers = self._buffers(located)
        outs = [
            {name: arr[b, ...] for name, arr in buffers.arrays.items()} for b in range(len(indices))
        ]

        nbytes = sum(arr.nbytes for arr in buffers.arrays.values())

        def copy(jobs: list[Any]) -> None:  # the copies shared by the threads, not one each
            shared = deque(jobs)
            list(copier.map(_run_shared, [shared] * min(self.threads, len(jobs))))

        try:
            windows = [(item, spans, position) for item, spans, _, _, position in placed]
            # small windows are copied here, in turn: handing them over costs more
            ds.reader.read_batch(windows, outs, copy if nbytes >= INLINE_BYTES else None)
        except Exception as e:
            raise self._error(located, indices, e) from e
        batch: dict[str, Any] = {
            name: torch.from_numpy(arr[: len(indices)]) for name, arr in buffers.arrays.items()
        }
        batch["item"] = [item for item, _, _, _ in located]
        batch["start"] = torch.tensor([start for _, _, start, _ in located], dtype=torch.float64)
        batch["length"] = torch.tensor([length for _, _, _, length in located], dtype=torch.int64)
        if ds.attrs:  # collated as torch's DataLoader does: the same batch either way
            from torch.utils.data import default_collate

            try:
                values = [ds.attrs_of(p[4]) for p in placed]
                batch.update({k: default_collate([v[k] for v in values]) for k in ds.attrs})
            except Exception as e:
                raise self._error(located, indices, e) from e
        batch["_buffers"] = buffers
        return batch

    def _read_transformed(
        self, indices: list[int], copier: cf.ThreadPoolExecutor
    ) -> dict[str, Any]:
        from torch.utils.data import default_collate

        def one(i: int) -> Any:
            try:
                return self.dataset[i]
            except Exception as e:
                raise self._error([self.dataset.locate(i)], [i], e) from e

        return default_collate(list(copier.map(one, indices)))

    def _error(self, located: list[Any], indices: list[int], e: Exception) -> LoaderError:
        names = ", ".join(
            f"'{item}' at {start:.2f} s (index {i})"
            for (item, _, start, _), i in zip(located[:4], indices[:4])
        )
        more = f" and {len(indices) - 4} more" if len(indices) > 4 else ""
        odd = self._odd_shape(located) if isinstance(e, ValueError) else None
        return LoaderError(
            f"{self.dataset.url}: reading the batch of windows {names}{more} "
            f"failed: {type(e).__name__}: {e}" + (f" ({odd})" if odd else "")
        )

    def _odd_shape(self, located: list[Any]) -> str | None:
        """Which window of a batch has another shape than the first (apart from time:
        the windows of one batch share it), to name its item in the error."""
        try:
            first, spans, _, _ = located[0]
            want = self._shapes(first, spans)
            for item, spans, _, _ in located[1:]:
                for name, (got, _) in self._shapes(item, spans).items():
                    if got != want[name][0]:
                        return (
                            f"'{item}' has '{name}' windows of shape {got} where '{first}' "
                            f"has {want[name][0]}: batch items of one shape together, or "
                            "read such items one by one (ds[i])"
                        )
        except Exception:  # the error being reported is the one that matters
            return None
        return None

    def _shapes(
        self, item: str, spans: dict[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The shape and dtype of ``item``'s window of each field (``spans``)."""
        shapes = {}
        for name, span in spans.items():
            layout = self.dataset.reader.layout(item, name)
            shapes[name] = (window_shape(layout, span), layout.dtype)
        return shapes

    def _buffers(self, located: list[Any]) -> _Buffers:
        """A free set of batch buffers of the right shapes (new if none is free)."""
        item, spans, _, _ = located[0]
        shapes = self._shapes(item, spans)
        with self._pool_lock:
            found = self._take(shapes)
        return found if found is not None else _Buffers(shapes, self.batch_size, self.pin_memory)

    def _take(self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> _Buffers | None:
        for buffers in list(self._pool):
            if buffers.shapes != shapes:  # every set holds batch_size windows
                self._pool.remove(buffers)
                continue
            if buffers.free():
                if buffers.event is not None:  # its last device copy must be done
                    buffers.event.synchronize()
                    buffers.event = None
                self._pool.remove(buffers)  # in flight until delivered, then back
                return buffers
        return None

    def _deliver(self, batch: dict[str, Any]) -> dict[str, Any]:
        buffers: _Buffers | None = batch.pop("_buffers", None)
        if self.device is not None:
            for name, value in batch.items():
                if isinstance(value, torch.Tensor):
                    batch[name] = value.to(self.device, non_blocking=self.pin_memory)
            if buffers is not None and self.device.type == "cuda":
                buffers.event = torch.cuda.Event()
                buffers.event.record()
        if buffers is not None:
            # Back to the pool, reused once released.  At most prefetch + 2 sets are
            # kept: past that, one the user still holds becomes theirs alone.
            with self._pool_lock:
                self._pool.append(buffers)
                if len(self._pool) > self.prefetch + 2:
                    held = [b for b in self._pool if not b.free()]
                    self._pool.remove(held[0] if held else self._pool[0])
        return batch


def _run_shared(jobs: deque[Any]) -> None:
    """Run the batch's copy jobs one at a time, each thread taking the next one as it
    finishes its last.  A batch's jobs alternate its fields (a window's ``wav``, its
    ``act``, the next window's ``wav``, ...): dealt out in fixed shares (every other
    job to each of 2 threads), one thread got every ``wav`` and the other only the
    small fields, and the windows were decoded and copied at one thread's pace
    (one rank, cold NFS-like origin: 0.79 s of copying in one thread against 0.23 s
    in the other over an epoch; docs/benchmarks-notes.md)."""
    while True:
        try:
            job = jobs.popleft()  # atomic: threads never take the same job
        except IndexError:
            return
        job()
