"""A store's history: what it was made from, kept beside its item table, not in its root.

The converter records, per store, its source files' identities and the options it read
them with (``"fingerprint"``), every source's name (``"sources"``), each appended
file's identity (``"appended"``), what the scan left out (``"skipped"``) and a checksum
of each item's values (``"digests"``: items that copy another,
:mod:`zstore.convert._copies`).  Only the converter reads them: a rerun of a finished
conversion does nothing, an append skips the files the store holds and names new items
that copy old ones, ``zstore info`` lists what was left out.  Readers never do.

They grow with the files (~110 bytes a source file, ~270 an appended one), and the
root ``zarr.json`` is read by every reader at open and beside every round of origin
reads (a store replaced under a job: :mod:`zstore.read._replaced`).  Kept in the root,
a store made from 3,000 files had a root of 367 KB, read 3.8x the bytes of the chunks
on an S3-like origin.  So the history is an attribute of the item table's own
``zarr.json`` (:data:`HISTORY_ATTR`), published with the table before the root names
it, and the root keeps a summary of constant size (:data:`HISTORY`): the counts of
sources and appended files, and a digest of the conversion's fingerprint, which is all
a rerun of a finished conversion compares.  Stores written before keep the history in
the root; they are read as they are, and the next append moves it out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from zstore.errors import StoreFormatError
from zstore.origin import Origin

#: the header keys of the history (in the root of stores written before)
HISTORY_KEYS = ("fingerprint", "sources", "appended", "skipped", "digests")
#: the header key of the history's summary, in the root
HISTORY = "history"
#: the item table's attribute that holds the history
HISTORY_ATTR = "zstore_history"


class HistoryMissingError(StoreFormatError):
    """The item table's ``zarr.json``, which holds the history, is missing (the caller
    tells a store changed since its root was read from a damaged one)."""


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back, floats of whole numbers as ints: a fingerprint
    made from ``chunk_seconds=1`` and one read back as ``1.0`` digest alike."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def digest(fingerprint: Any) -> str:
    """A conversion's fingerprint (its sources' identities and its options) as 32 hex
    digits: equal fingerprints give equal digests, in any process."""
    text = json.dumps(_plain(fingerprint), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def split(extra: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A manifest's extra keys as (the root's, the history's): the root's hold the
    history's summary in place of the history."""
    history = {k: extra[k] for k in HISTORY_KEYS if k in extra}
    root = {k: v for k, v in extra.items() if k not in HISTORY_KEYS and k != HISTORY}
    if history:
        root[HISTORY] = summary(history)
    return root, history


def summary(history: Mapping[str, Any]) -> dict[str, Any]:
    """The root's summary of a history: counts, and the fingerprint's digest."""
    out: dict[str, Any] = {
        "sources": len(history.get("sources", ())),
        "appended": len(history.get("appended", ())),
    }
    if "fingerprint" in history:
        out["fingerprint"] = digest(history["fingerprint"])
    return out


def source_count(header: Mapping[str, Any]) -> int:
    """How many source files a store was made from, appended files included (a root
    header, or ``Manifest.extra``; either place the history may be in)."""
    if "sources" in header:
        return len(header["sources"])
    return int((header.get(HISTORY) or {}).get("sources", 0))


def same_conversion(header: Mapping[str, Any], fingerprint: Any) -> bool:
    """Whether the store of root ``header`` was converted with ``fingerprint``."""
    if "fingerprint" in header:  # a store written before: the whole of it in the root
        return _plain(header["fingerprint"]) == _plain(fingerprint)
    said = (header.get(HISTORY) or {}).get("fingerprint")
    return said is not None and said == digest(fingerprint)


def with_history(
    header: dict[str, Any], origin: Origin, url: str, table: str | None
) -> dict[str, Any]:
    """The root ``header`` with its history in it, read from the item table's
    ``zarr.json`` where the root holds only its summary (else ``header`` as it is)."""
    said = header.get(HISTORY)
    if not isinstance(said, dict) or not table or any(k in header for k in HISTORY_KEYS):
        return header
    where = f"{url}/{table}/zarr.json"
    try:
        history = json.loads(origin.read(f"{table}/zarr.json"))["attributes"][HISTORY_ATTR]
    except FileNotFoundError:
        raise HistoryMissingError(
            f"{where} is missing: the store's item table is damaged; restore it from a "
            "good copy or reconvert the store"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise StoreFormatError(
            f"{where}: the store's history (its sources, appends, what was left out) "
            f"is damaged or missing ({e!r}); restore the table's zarr.json from a good "
            "copy or reconvert the store"
        ) from None
    if not isinstance(history, dict) or summary(history) != said:
        raise StoreFormatError(
            f"{where}: the store's history does not match its root (root {said}, "
            f"history {summary(history) if isinstance(history, dict) else history!r}); "
            "restore the store's root objects from one copy, or reconvert it"
        )
    return {**header, **history}
