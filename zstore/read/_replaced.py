"""Whether the store a reader opened is still the one at its URL.

A conversion with ``--overwrite`` deletes a store and writes another at the same URL.
A job that opened the old one keeps its manifest (its items, their lengths, its shard
indexes in the tiers) but would read the new store's objects: where a shard's index was
fetched after the overwrite, its chunks decode without error, and the job trains on the
new store's values under the old store's items, mixed with the old values its tiers
hold.  So every round of origin reads that reads values (chunks, or whole shard
objects) also reads the store's root ``zarr.json`` (~1 KB; in the same concurrent
round, not after it).  An overwrite rewrites the root before it writes any object, so
no value of another store is returned or put in the tiers: the round raises
:class:`StoreReplacedError` instead.  A round of shard indexes alone is not checked: an
index of the new store decodes nothing by itself, and the chunks read through it come
in a checked round (where its offsets hit the tiers, they hold the old store's bytes).
Values read outside those rounds (a batch record, an array read through zarr) are
checked right after with :meth:`StoreCheck.now`.  ``zstore.open_store``'s store
(:mod:`zstore.read._zarr_store`) reads the root beside each of its origin rounds, as
the reader's rounds do.  An append rewrites the root too,
keeping the store id: the job goes on with the view it opened (appends rewrite no
object).  But a store restored from a backup (or a copy put in its place) also has the
store id, and appended to since, it may hold other data under the job's appended items'
names: so the root's record of appends (:mod:`zstore.format.lineage`) must begin with
the job's, or the round raises :class:`StoreReplacedError` too."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from zstore.errors import StoreReplacedError
from zstore.format import MANIFEST_ATTR, append_ids
from zstore.origin import Origin, Request

ROOT = "zarr.json"


class StoreCheck:
    """Checks the root a round of origin reads found against the store id opened."""

    def __init__(self, url: str, store_id: str, appends: Sequence[str] = ()) -> None:
        self.url, self.store_id = url, store_id
        self.appends = list(appends)  # the ids of the appends the job's view holds
        self._seen: bytes | None = None  # the root last found to be this store's

    @property
    def request(self) -> Request:
        return (ROOT, None, None)

    def verify(self, root: Any) -> None:
        """Raise :class:`StoreReplacedError` unless ``root`` (the root object's bytes, or
        None where it is missing) is this store's."""
        if root is None:
            raise StoreReplacedError(
                f"{self.url}: the store was removed while this job read it (its root "
                "zarr.json is gone); restore it, or restart the job on the store now there"
            )
        data = bytes(root)
        if data == self._seen:
            return
        try:
            header = json.loads(data).get("attributes", {}).get(MANIFEST_ATTR, {})
            now = str(header.get("store_id", ""))
            appends = append_ids(header)
        except (ValueError, AttributeError, KeyError, TypeError):
            now, appends = "", []
        if now != self.store_id:
            raise StoreReplacedError(
                f"{self.url}: the store was replaced while this job read it (store id "
                f"{self.store_id} when opened, {now or 'none, a conversion in progress'} "
                "now; a conversion with --overwrite?); nothing of the new store was "
                "used: restart the job to read it"
            )
        if appends[: len(self.appends)] != self.appends:
            raise StoreReplacedError(
                f"{self.url}: the store was replaced while this job read it: it has the "
                "store id the job opened, but not the appends the job's items came "
                f"from ({len(self.appends)} when opened; {len(appends)} now, "
                f"{sum(a == b for a, b in zip(appends, self.appends))} of them the "
                "same): restored from a backup, or another copy put in its place? "
                "Nothing of it was used: restart the job to read the store now there"
            )
        self._seen = data

    def now(self, origin: Origin) -> None:
        """Read the root from ``origin`` now and :meth:`verify` it."""
        try:
            root = origin.read(ROOT)
        except FileNotFoundError:
            root = None
        self.verify(root)
