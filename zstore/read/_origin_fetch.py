"""Chunk bytes from the tiers, else the origin, in one concurrent batch: the part of
:class:`zstore.read._chunks.ChunkSource` that fetches.  Ranges of one object that touch
are merged into requests of up to COALESCE_BYTES; with ``fetch="shard"`` a miss reads
its object whole and, without an SSD tier that keeps it whole, puts every chunk of it
in the tiers."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from zstore.cache import TieredCache
from zstore.errors import OriginError
from zstore.format import EMPTY, ArrayLayout, decode_index
from zstore.origin import Origin, Request
from zstore.read._replaced import StoreCheck


def range_key(obj: str, start: int, stop: int) -> str:
    """The tiers' key of bytes ``start:stop`` of ``obj`` (a chunk of a shard object): the
    reads by ranges, the whole-shard fills and ``zstore cache warm`` name it alike."""
    return f"{obj}#r{start}-{stop}"


def index_key(obj: str, layout: ArrayLayout) -> str:
    """The tiers' key of shard object ``obj``'s index (its last ``index_bytes``)."""
    return f"{obj}#s{layout.index_bytes}"


COALESCE_BYTES = 512 * 1024  # adjacent chunk ranges are merged into requests up to this size


class OriginFetch:
    """Fetching chunk bytes through the tiers (the part of ``ChunkSource`` that does)."""

    if TYPE_CHECKING:
        url: str
        origin: Origin
        tiers: TieredCache | None
        fetch: str
        check: StoreCheck | None

    def fetch_many(
        self,
        keys: list[str],
        requests: list[Request],
        *,
        ram: bool,
        layouts: dict[str, ArrayLayout],
        ranges: Collection[str] = (),
        reused: bool = False,
        wait: bool = True,
    ) -> list[bytes | memoryview | None]:
        """Values for cache ``keys`` from the tiers, else the origin (one concurrent batch).

        None stands for an object missing at the origin (a chunk never written).  With
        ``fetch="shard"`` a miss reads its object whole, unless the object is in
        ``ranges`` (another process is fetching it whole now).  ``reused``: the tiers'
        hits are read into the origin's reused memory (chunks, which are dropped once
        decoded or built; never shard indexes, which are kept).  ``wait=False``: keys
        whose node lock is held now are fetched without it, and not kept in the tiers.
        """
        by_key = dict(zip(keys, requests))

        def fetch(miss: list[str]) -> list[bytes | memoryview | None]:
            return self._from_origin([by_key[k] for k in miss], layouts, ranges)

        if self.tiers is None:
            return fetch(keys)
        # The ranges of an object another process is putting in the tiers whole are
        # neither kept (each its own SSD value, beside the whole object) nor locked.
        passing = {k for k, r in by_key.items() if r[0] in ranges} if ranges else ()
        into = self.origin.buffer if reused else None
        return self.tiers.get_many(keys, fetch, ram=ram, passing=passing, into=into, wait=wait)

    def _from_origin(
        self,
        requests: list[Request],
        layouts: dict[str, ArrayLayout],
        ranges: Collection[str] = (),
    ) -> list[bytes | memoryview | None]:
        if self.fetch != "shard":
            return self._read(requests)
        # Whole objects, but the ranges only of those another process is fetching whole
        # now: one concurrent round for both.  A shard index (a suffix) is read by its
        # range: admission weighs the encoded form's shards by their indexes, and an
        # index fetched as its whole object read ~7 MB per shard and put every chunk
        # in the tiers before the read fetched the object whole again (4 ranks,
        # S3-like: the first batch spent 0.45-0.77 s on it).
        ranged = {r for r in requests if r[0] in ranges or (r[1] is not None and r[1] < 0)}
        objects = sorted({r[0] for r in requests if r not in ranged})
        direct = [r for r in requests if r in ranged]
        got = self._read([(o, None, None) for o in objects] + direct)
        whole = dict(zip(objects, got))
        by_range = dict(zip(direct, got[len(objects) :]))
        for obj, data in whole.items():
            if data is not None and obj in layouts:
                self._fill_shard(obj, layouts[obj], data, requests)
        out: list[bytes | memoryview | None] = []
        for obj, start, stop in requests:
            if (obj, start, stop) in ranged:
                out.append(by_range[(obj, start, stop)])
            else:
                data = whole[obj]
                out.append(None if data is None else _slice(data, start, stop))
        return out

    def _fill_shard(
        self, obj: str, layout: ArrayLayout, data: bytes | memoryview, requested: list[Request]
    ) -> None:
        """Put every chunk of a whole shard into the tiers (``fetch="shard"``)."""
        if self.tiers is None or len(data) < layout.index_bytes:
            return
        index = decode_index(layout, data[-layout.index_bytes :], f"{self.url}: {obj}")
        skip = {(r[1], r[2]) for r in requested if r[0] == obj}
        chunks = []
        for offset, nbytes in index:
            if offset == EMPTY:
                continue
            start, stop = int(offset), int(offset) + int(nbytes)
            if (start, stop) not in skip:
                chunks.append((range_key(obj, start, stop), data[start:stop]))
        self.tiers.fill_many(chunks, ram=not self.tiers.decoded)  # one transaction per tier

    def _read(self, requests: list[Request]) -> list[bytes | memoryview | None]:
        merged, parts = coalesce(requests, COALESCE_BYTES)
        # The store's root, read in the same round (see _replaced); not beside shard
        # indexes alone (suffixes): no value is read through an index but by a round
        # of chunks, which checks it.
        check = self.check if any(r[1] is None or r[1] >= 0 for r in merged) else None
        asked = merged + [check.request] if check is not None else merged
        try:
            datas: list[bytes | memoryview | None] = list(self.origin.read_many(asked))
        except FileNotFoundError:  # some object is missing: find which, one by one
            datas = []
            for r in asked:
                try:
                    datas.append(self.origin.read(*r))
                except FileNotFoundError:
                    datas.append(None)
        except OriginError:
            # an object shorter than the ranges its index gave (read cut short, again and
            # again): a store replaced under the job says so, not "reading failed"
            if check is not None:
                check.now(self.origin)
            raise
        if check is not None:
            check.verify(datas.pop())
        if self.tiers is not None:
            self.tiers.stats.add("origin_requests", len(merged))
            self.tiers.stats.add("origin_bytes", sum(len(d) for d in datas if d is not None))
        out: list[bytes | memoryview | None] = []
        for m, offset, n in parts:
            got = datas[m]
            out.append(got if n is None or got is None else memoryview(got)[offset : offset + n])
        return out


def coalesce(
    requests: list[Request], limit: int
) -> tuple[list[Request], list[tuple[int, int, int | None]]]:
    """Merge byte ranges of one object that touch into requests of up to ``limit`` bytes.

    A window's chunks lie next to each other in their shard, so its ~10 ranges per
    array become a few requests: fewer round trips and per-request costs (S3 bills
    each GET), the same bytes.  Returns the requests to make and, per given request,
    (index of the request that holds it, offset in it, length; None = all of it).
    Suffix and whole-object requests pass through unmerged.
    """
    merged: list[Request] = []
    parts: list[tuple[int, int, int | None]] = [(0, 0, None)] * len(requests)
    ranged = sorted(
        (r[0], r[1], r[2], i)
        for i, r in enumerate(requests)
        if r[1] is not None and r[1] >= 0 and r[2] is not None
    )
    for key, start, stop, i in ranged:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last[0] == key
            and last[1] is not None
            and last[2] == start
            and stop - last[1] <= limit
        ):
            merged[-1] = (key, last[1], stop)
        else:
            merged.append((key, start, stop))
        parts[i] = (len(merged) - 1, start - merged[-1][1], stop - start)  # type: ignore
    for i, r in enumerate(requests):
        if not (r[1] is not None and r[1] >= 0 and r[2] is not None):
            merged.append(r)
            parts[i] = (len(merged) - 1, 0, None)
    return merged, parts


def _slice(data: bytes | memoryview, start: int | None, stop: int | None) -> bytes | memoryview:
    if start is not None and start < 0:
        return data[start:]
    return data[start or 0 : stop]
