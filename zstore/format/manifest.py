"""Reading and publishing a store's manifest (root header + item table).

Opening a format-2 store reads the root ``zarr.json`` (a header of constant size) and
maps the item table: from the store itself on a local path or NFS, or from a copy in
the node's RAM tier directory for remote stores, so every process on the node maps the
same pages.  Array metadata is never read per item: :class:`ArrayMetas` builds each
item's ``zarr.json`` document from the manifest (the converter wrote exactly that).
Publishing writes the table under a new name, then the root ``zarr.json`` in one write:
a reader that opened the store before keeps the table it mapped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from crc32c import crc32c

from zstore.errors import StoreFormatError, StoreReplacedError
from zstore.format._table import pack
from zstore.format.history import (
    HISTORY,
    HISTORY_ATTR,
    HISTORY_KEYS,
    HistoryMissingError,
    split,
    with_history,
)
from zstore.format.layout import (
    MANIFEST_ATTR,
    PROGRESS_ATTR,
    ArrayInfo,
    Manifest,
    geometry,
    time_lengths,
)
from zstore.format.lineage import append_ids
from zstore.format.objects import ObjectWriter, array_meta, dumps, encode_array, group_meta, handles
from zstore.format.packs import PackGroup, Placement
from zstore.format.sizing import array_totals
from zstore.origin import Origin
from zstore.urls import local_path


class ArrayMetas:
    """Per item and array, the ``zarr.json`` document: built from the manifest (format
    2), or looked up in the consolidated metadata (format 1).  None when unknown."""

    def __init__(self, manifest: Manifest, consolidated: dict[str, Any] | None = None):
        self.manifest = manifest
        self.consolidated = consolidated or {}

    def at(self, position: int, name: str) -> dict[str, Any] | None:
        m = self.manifest
        if m.shapes is None or name not in m.shapes:
            return self.consolidated.get(f"{m.items[position]}/{name}")
        info = m.arrays[name]
        dtype = np.dtype(info.dtype or "V1")
        shape = tuple(int(x) for x in m.shapes[name][position])
        if not handles(m.codec, dtype, shape) or min(shape) < 0:
            return None  # written through zarr, or absent: read its zarr.json
        chunks, shards = geometry(shape, info.rate, info.time_axis, m.chunk_seconds, dtype.itemsize)
        return array_meta(shape, dtype, chunks, shards, m.codec, dims=info.dims)

    def get(self, path: str) -> dict[str, Any] | None:
        item, _, name = path.rpartition("/")
        if self.manifest.shapes is None:
            return self.consolidated.get(path)
        try:
            return self.at(self.manifest.position(item), name)
        except ValueError:
            return None

    def is_array(self, path: str) -> bool:
        """Whether ``item/name`` is one of the store's arrays (an item that has it)."""
        m = self.manifest
        if m.shapes is None:
            return (self.consolidated.get(path) or {}).get("node_type") == "array"
        item, _, name = path.rpartition("/")
        if any(g.path == item and name in g.shapes for g in m.packs):
            return True  # a pack group's array
        if name not in m.arrays:
            return False
        try:
            position = m.position(item)
        except ValueError:
            return False
        have = m.items_with(name)
        return have is None or bool(np.isin(position, have))

    def group(self, position: int) -> dict[str, Any] | None:
        """An item group's document (format 1 only; format 2 reads it from the store)."""
        return self.consolidated.get(self.manifest.items[position])


def read_root(origin: Origin, url: str) -> dict[str, Any]:
    """The root ``zarr.json`` of a store, checked."""
    try:
        meta = json.loads(origin.read("zarr.json"))
    except FileNotFoundError:
        if not origin.remote and not os.path.exists(local_path(url)):
            raise StoreFormatError(
                f"{url}: no such directory; check the path, or write the store there "
                "first with 'zstore convert'"
            ) from None
        raise StoreFormatError(
            f"{url}: no zarr.json at the root; is this a Zarr v3 store written by 'zstore convert'?"
        ) from None
    except (NotADirectoryError, IsADirectoryError):
        raise StoreFormatError(
            f"{url}: not a directory holding a Zarr v3 store; pass the "
            "store's directory (the one 'zstore convert' wrote)"
        ) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise StoreFormatError(
            f"{url}/zarr.json is not valid JSON ({e}): the store's root "
            "metadata is damaged or truncated; restore it from a good copy "
            "or reconvert the store"
        ) from None
    if not isinstance(meta, dict):
        raise StoreFormatError(
            f"{url}/zarr.json does not hold a JSON object: the store's "
            "root metadata is damaged; restore it or reconvert the store"
        )
    return meta


def _bad_checksum(where: str) -> StoreFormatError:
    return StoreFormatError(
        f"{where}: the item table fails its checksum; restore the "
        "store's root objects from a good copy or reconvert it"
    )


def _checked(buf: Any, where: str) -> memoryview:
    view = memoryview(buf)
    if len(view) < 4 or crc32c(view[:-4]) != int.from_bytes(view[-4:], "little"):
        raise _bad_checksum(where)
    return view[:-4]


#: Table files whose checksum was verified, as (path, inode, size, mtime): a process
#: that pickles a reader passes them on (:func:`verified_tables`), so its DataLoader
#: workers map the same unchanged file without reading all of it again.
VERIFIED: set[tuple[str, int, int, int]] = set()


def verified_tables(
    table: str | None, directory: str | None = None
) -> set[tuple[str, int, int, int]]:
    """The files of item table ``table`` this process verified (see :data:`VERIFIED`),
    only those in ``directory`` (the node directory a reader keeps its copy in) when
    given: a process that opened many caches passes on one entry, not all of them."""
    if not table:
        return set()
    name = table.replace("/", "_")
    return {
        v
        for v in VERIFIED
        if (table in v[0] or name in v[0])
        and (directory is None or os.path.dirname(v[0]) == directory)
    }


def _mapped_checked(path: str, where: str) -> memoryview:
    """The table file mapped, its checksum verified by reading the file in blocks rather
    than through the map: a process then maps only the pages it uses (a name looked up,
    an item read), not the whole table, at any item count."""
    with open(path, "rb") as f:
        seen = _identity(path, f.fileno())
        if seen not in VERIFIED:  # else verified by this process or the one that
            crc, left = 0, seen[2] - 4  # pickled its reader, and unchanged since
            while left > 0:
                block = f.read(min(left, 1 << 20))
                if not block:
                    break
                crc = crc32c(block, crc)
                left -= len(block)
            if seen[2] < 4 or left or crc != int.from_bytes(f.read(4), "little"):
                raise _bad_checksum(where)
            VERIFIED.add(seen)
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))[:-4]


def _identity(path: str, fd: int) -> tuple[str, int, int, int]:
    """What says a file is unchanged: (path, inode, size, modification time)."""
    st = os.fstat(fd)
    return path, st.st_ino, st.st_size, st.st_mtime_ns


def load_table(
    origin: Origin,
    url: str,
    key: str,
    node_dir: str | None,
    store_id: str,
    open_file: Callable[[str, int], int] | None = None,
) -> memoryview:
    """The item table's bytes, checked: mapped from the node's copy (in the node
    directory of the first cache tier, written once by whichever process comes first),
    else read into this process.

    Never mapped from the store itself, local or not: users replace a store's files in
    place (an interrupted ``cp``, ``rsync --inplace``), and a map of a file truncated
    under it reads zeros or kills the process (SIGBUS).  The node copy is zstore's own
    file, written whole and renamed into place; a copy that fails its checksum is
    dropped and made anew from the store.  Without a node directory (no cache tier),
    each process holds the table's bytes (~50 bytes an item for two arrays).
    ``open_file(path, flags)`` opens the copy as the tier's own files are opened (their
    mode and group)."""
    where = f"{url}/{key}"
    copy = None
    if node_dir is not None:
        try:
            os.makedirs(node_dir, exist_ok=True)
            copy = os.path.join(node_dir, f"{store_id}-{key.replace('/', '_')}")
        except OSError:
            pass  # no node copy: this process reads its own
    try:
        if copy is not None:
            try:
                return _mapped_checked(copy, where)
            except FileNotFoundError:
                pass  # none yet: made below
            except StoreFormatError:  # the node's copy is damaged, not the store: anew
                with contextlib.suppress(OSError):
                    os.unlink(copy)
        raw = origin.read(key)
        view = _checked(raw, where)  # a damaged table is never copied for the node
        if copy is not None and _write_copy(copy, raw, where, open_file):
            return _mapped_checked(copy, where)
        return view
    except FileNotFoundError:
        raise TableMissingError(
            f"{where}: the item table is missing; restore it from a good copy or "
            "reconvert the store"
        ) from None


class TableMissingError(StoreFormatError):
    """A store's item table is missing (:func:`read_manifest` says why, where it can)."""


class _Superseded(StoreReplacedError):
    """The item table read is gone because the store was appended to and the table then
    removed by ``zstore tidy``: a process opening the store (not pinned to a view of it)
    reads its root again."""


#: How many times an open reads the root again after :class:`_Superseded` (each time an
#: append and a tidy landed between its root read and its table read).
REOPENS = 3


def _table_gone(
    origin: Origin, url: str, store_id: str, table: str, appends: Sequence[str] = ()
) -> None:
    """Raise :class:`StoreReplacedError` where the item table ``table`` of store
    ``store_id`` (with the appends ``appends``) is missing because the store changed
    since its root was read: replaced or being replaced (``--overwrite``), restored
    from a backup taken before some of those appends, or appended to and the table then
    removed by ``zstore tidy``.  Returns where the root still names that table (the
    store is damaged)."""
    try:
        now = read_root(origin, url).get("attributes", {})
    except StoreFormatError:
        now = {}
    header = now.get(MANIFEST_ATTR)
    header = header if isinstance(header, dict) else {}
    if str(header.get("store_id", "")) != store_id:
        raise StoreReplacedError(
            f"{url}: the store was replaced while it was opened or read (its item table "
            f"{table} is gone, and the root now names "
            f"{'store ' + str(header['store_id']) if header.get('store_id') else 'no finished store'}"
            "; a conversion with --overwrite?): open it again, or restart the job"
        )
    now_appends = append_ids(header)
    if now_appends[: len(appends)] != list(appends):
        raise StoreReplacedError(
            f"{url}: the store was replaced while it was opened or read: it has the "
            f"store id opened, but not the appends its item table {table} came from "
            f"({len(appends)} then, {len(now_appends)} now): restored from a backup, or "
            "another copy put in its place? Restart the job to read the store now there"
        )
    if str(header.get("table", "")) != table:
        raise _Superseded(
            f"{url}: the store was appended to since this job opened it, and the item "
            f"table the job reads ({table}) was removed ('zstore tidy'): restart the job, "
            "and give tidy an --older-than longer than your jobs run"
        )


def _write_copy(
    path: str, raw: bytes, where: str, open_file: Callable[[str, int], int] | None = None
) -> bool:
    """Write the node's copy of a checked table (temp file, then rename); False, with
    one warning, when it cannot be written (a full tmpfs): the caller keeps the bytes."""
    tmp = f"{path}.{os.getpid()}.partial"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = open_file(tmp, flags) if open_file else os.open(tmp, flags, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()  # the last write sets the modification time
            VERIFIED.add(_identity(path, f.fileno()))  # checked by the caller
        os.replace(tmp, path)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        warnings.warn(
            f"zstore: cannot keep the node's copy of {where} in "
            f"{os.path.dirname(path)} ({e.strerror or e}); this process holds "
            "the item table in its own memory",
            stacklevel=4,
        )
        return False


def read_manifest(
    url: str,
    storage_options: dict[str, Any] | None,
    fs: Any = None,
    tables: Callable[[str], str | None] | None = None,
    header: dict[str, Any] | None = None,
    open_file: Callable[[str, int], int] | None = None,
    history: bool = False,
    _reopens: int = 0,
) -> tuple[Manifest, ArrayMetas]:
    """A store's manifest and its array metadata.

    ``tables(store_id)`` names a node directory to keep remote stores' item tables in;
    ``header`` (a format-2 root attribute read before, e.g. by the process that pickled
    a reader) pins that view of the store instead of reading its root again.  With
    ``history``, ``Manifest.extra`` holds the store's history too (its sources, appended
    files, what was left out: :mod:`zstore.format.history`), which only the converter
    and ``zstore info`` read.  Where an append and a ``zstore tidy`` remove the table
    between the root's read and the table's, the root is read again (without
    ``header``; with it, :class:`StoreReplacedError` says the view is gone).
    """
    origin = Origin(url, storage_options, fs=fs)
    meta = {"attributes": {MANIFEST_ATTR: header}} if header else read_root(origin, url)
    data = meta.get("attributes", {}).get(MANIFEST_ATTR)
    if data is None and PROGRESS_ATTR in meta.get("attributes", {}):
        raise StoreFormatError(
            f"{url}: its conversion has not finished (it was stopped, failed, or is still "
            "running); run the same zstore convert command again to finish it"
        )
    store_id = str(data.get("store_id", "")) if isinstance(data, dict) else ""
    appends = append_ids(data) if isinstance(data, dict) else []

    def table(key: str) -> memoryview:
        try:
            return load_table(
                origin, url, f"{key}/c/0", tables(store_id) if tables else None, store_id, open_file
            )
        except TableMissingError:
            # raises where the store changed
            _table_gone(origin, url, store_id, key, appends)
            raise

    try:
        if history and isinstance(data, dict):
            try:
                data = with_history(data, origin, url, data.get("table"))
            except HistoryMissingError:  # raises where the store changed
                _table_gone(origin, url, store_id, str(data.get("table")), appends)
                raise
        manifest = Manifest.from_json(data, url, table=table)
    except _Superseded:
        if header is not None or _reopens >= REOPENS:
            raise  # a pinned view (a pickled reader): its table is gone, it is told
        return read_manifest(
            url, storage_options, fs, tables, None, open_file, history, _reopens + 1
        )
    consolidated = (meta.get("consolidated_metadata") or {}).get("metadata", {})
    return manifest, ArrayMetas(manifest, consolidated)


def table_objects(
    names: Sequence[str],
    shapes: dict[str, np.ndarray],
    present: dict[str, np.ndarray],
    placement: Placement | None = None,
    history: dict[str, Any] | None = None,
) -> tuple[str, dict[str, bytes]]:
    """A new table array's name and objects (``zarr.json`` and its one chunk); the
    store's ``history`` goes into the ``zarr.json``'s attributes."""
    extra = placement.sections() if placement is not None else None
    data = np.frombuffer(pack(names, shapes, present, extra), dtype=np.uint8)
    name = f"zstore_items_{uuid.uuid4().hex[:12]}"
    meta = array_meta(
        data.shape,
        data.dtype,
        data.shape,
        None,
        "none",
        {
            "zstore": "the item table of this store (names and shapes)",
            **({HISTORY_ATTR: history} if history else {}),
        },
    )
    objects = {
        f"{name}/{k}": v for k, v in encode_array(data, data.shape, None, "none", -1).items()
    }
    objects[f"{name}/zarr.json"] = dumps(meta)
    return name, objects


def publish(
    dst: str,
    storage_options: dict[str, Any] | None,
    header: dict[str, Any],
    objects: dict[str, bytes],
    attrs: dict[str, Any] | None = None,
) -> None:
    """Write the table's objects, then the root ``zarr.json`` (one write, no
    consolidated metadata) with ``header`` as its ``"zstore"`` attribute."""
    writer = ObjectWriter(dst, storage_options)
    writer.put(objects)
    writer.put({"zarr.json": group_meta({**(attrs or {}), MANIFEST_ATTR: header})})


def build(
    *,
    store_id: str,
    arrays: dict[str, ArrayInfo],
    names: list[str],
    shapes: dict[str, np.ndarray],
    present: dict[str, np.ndarray],
    codec: str,
    chunk_seconds: float,
    extra: dict[str, Any],
    packs: tuple[PackGroup, ...] = (),
    placement: Placement | None = None,
) -> tuple[Manifest, dict[str, bytes]]:
    """A format-2 manifest of ``names`` with per-array ``(items, ndim)`` shapes (rows of
    -1 where an item lacks the array) and, for arrays some items lack, which have them
    (see :func:`shape_rows`); the pack groups and where items lie when some are packed;
    and the objects of its item table.  The history in ``extra`` (its sources, appended
    files, what was left out) goes into the table's ``zarr.json``, its summary into the
    header (:mod:`zstore.format.history`)."""
    placement = placement if packs else None
    extra, history = split(extra)
    table, objects = table_objects(names, shapes, present, placement, history)
    lengths = time_lengths(arrays, shapes)
    manifest = Manifest.of_table(
        names=names,
        shapes=shapes,
        present=present,
        table=table,
        store_id=store_id,
        arrays=arrays,
        codec=codec,
        chunk_seconds=chunk_seconds,
        all_chunks_written=True,
        packs=tuple(packs),
        placement=placement,
        extra={
            **extra,
            "min_lengths": min_lengths(lengths),
            "sizes": array_totals(arrays, shapes, lengths, chunk_seconds),
        },
    )
    return manifest, objects


def min_lengths(lengths: dict[str, np.ndarray]) -> dict[str, int]:
    """Per time array, its shortest length over the items that have it (0 when none
    does): with it in the header, a dataset whose window fits every item opens without
    reading every item's length."""
    return {
        name: int(column[column >= 0].min()) if (column >= 0).any() else 0
        for name, column in lengths.items()
    }


def shape_rows(
    items: list[dict[str, tuple[int, ...]]],
    arrays: dict[str, Any],
    ndims: dict[str, int] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per array, the ``(items, ndim)`` shapes of ``items`` (name -> shape dicts), and
    for arrays some items lack, which items have them."""
    shapes, present = {}, {}
    for name in arrays:
        ndim = next((len(s[name]) for s in items if name in s), (ndims or {}).get(name, 0))
        rows = np.full((len(items), ndim), -1, dtype=np.int64)
        have = np.zeros(len(items), dtype=bool)
        for i, s in enumerate(items):
            if name in s:
                rows[i] = s[name]
                have[i] = True
        shapes[name] = rows
        if not have.all():
            present[name] = have
    return shapes, present


def current_shapes(
    manifest: Manifest, metas: ArrayMetas
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every item's array shapes and presence, as :func:`shape_rows` gives them.

    A format-1 store's come from its consolidated metadata, and each item's metadata
    must be what this zstore writes (else its geometry could not be derived from the
    manifest, and the store must be reconverted)."""
    n = len(manifest.items)
    if manifest.shapes is not None:
        present = {}
        for name, have in manifest.present.items():
            mask = np.zeros(n, dtype=bool)
            mask[have] = True
            present[name] = mask
        return dict(manifest.shapes), present
    items: list[dict[str, tuple[int, ...]]] = []
    for i, item in enumerate(manifest.items):
        shapes = {}
        for name, info in manifest.arrays.items():
            meta = metas.consolidated.get(f"{item}/{name}")
            if meta is None:
                continue
            shape = tuple(int(x) for x in meta["shape"])
            dtype = np.dtype(meta["data_type"])
            if handles(manifest.codec, dtype, shape):
                chunks, shards = geometry(
                    shape, info.rate, info.time_axis, manifest.chunk_seconds, dtype.itemsize
                )
                dims = meta.get("dimension_names")
                mine = array_meta(
                    shape,
                    dtype,
                    chunks,
                    shards,
                    manifest.codec,
                    meta.get("attributes"),
                    tuple(dims) if dims else None,
                )
                if mine != meta:
                    raise StoreFormatError(
                        f"{metas.manifest.items[i]}/{name}: written by an older zstore with "
                        "another chunking; reconvert the store (zstore convert --overwrite)"
                    )
            shapes[name] = shape
        items.append(shapes)
    return shape_rows(items, manifest.arrays)


def upgrade(url: str, storage_options: dict[str, Any] | None = None) -> Manifest | None:
    """Rewrite a store's manifest as this zstore writes it (metadata only; chunks, store
    id, the record of appends and every cache entry stay valid): a format-1 store's as
    format 2, and a format-2 store's whose root holds its history with the history
    beside the item table (:mod:`zstore.format.history`).  None, and nothing written,
    where it is written so already.  The caller holds the store's write lock."""
    manifest, metas = read_manifest(url, storage_options, history=True)
    arrays = dict(manifest.arrays)
    # the history read from beside the table comes with the root's summary of it
    in_root = HISTORY not in manifest.extra and any(k in manifest.extra for k in HISTORY_KEYS)
    if manifest.shapes is not None and not in_root:
        return None
    shapes, present = current_shapes(manifest, metas)
    for name in arrays if manifest.shapes is None else ():
        first = manifest.first_with(name)
        meta = metas.consolidated.get(f"{first}/{name}") if first is not None else None
        if meta is not None and arrays[name].dtype is None:
            arrays[name] = dataclasses.replace(arrays[name], dtype=str(meta["data_type"]))
        if meta is not None and meta.get("dimension_names") and arrays[name].dims is None:
            arrays[name] = dataclasses.replace(
                arrays[name], dims=tuple(map(str, meta["dimension_names"]))
            )
    new, table = build(
        store_id=manifest.store_id,
        arrays=arrays,
        names=list(manifest.items),
        shapes=shapes,
        present=present,
        codec=manifest.codec,
        chunk_seconds=manifest.chunk_seconds,
        extra=dict(manifest.extra),
        packs=manifest.packs,
        placement=manifest.placement,
    )
    publish(url, storage_options, new.header(), table)
    return new
