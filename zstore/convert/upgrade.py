"""``zstore upgrade STORE``: rewrite a store's manifest as this zstore writes it.

Metadata only, under the store's write lock (so no conversion or append publishes
meanwhile): no chunk is touched, and the store id and the record of appends stay, so
every cache entry of the store stays valid and a job reading it reads on (it keeps the
item table it opened).  A format-1 store (consolidated metadata) gets a format-2
manifest; a format-2 store whose root holds its history (written so before the history
moved beside the item table, :mod:`zstore.format.history`) gets a new item table
holding it and a root of constant size.  An append does the same; this is for stores
no append is coming to.
"""

from __future__ import annotations

from typing import Any

from zstore.convert._storelock import store_lock
from zstore.format import upgrade


def upgrade_store(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """Rewrite the manifest of the store at ``url`` where this zstore writes it
    otherwise (:func:`zstore.format.upgrade`); one line saying what was done."""
    with store_lock(url, storage_options):
        new = upgrade(url, storage_options)
    if new is None:
        return f"{url}: already in the current format; nothing to do"
    return (
        f"{url}: manifest rewritten in the current format: format 2, the store's history "
        f"beside the item table ({len(new.items)} items, store id {new.store_id} kept; no "
        "chunk was touched)"
    )
