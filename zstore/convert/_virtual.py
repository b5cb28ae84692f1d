"""Datasets whose values live in other files: HDF5 virtual datasets (VDS, their values
mapped from datasets of source files) and datasets with external storage (raw bytes in
plain files beside the HDF5 file).

A virtual dataset whose source file (or source dataset) is missing reads as its fill
value, zeros mostly, with no error: converted, the store would hold zeros where the
recording is. So such a dataset is left out, with the missing file named (and the item
converted without it, or left out where it has nothing else). The files a dataset reads
are also recorded with their identities (:attr:`SourceItem.depends`), so a file written
to while its items are converted stops the conversion as the HDF5 file itself does
(:func:`zstore.convert._source.check_unchanged`).

HDF5 finds a source file named relatively under ``HDF5_VDS_PREFIX``, then beside the
virtual dataset's file, then in the working directory; an external file in
``HDF5_EXTFILE_PREFIX`` or the working directory. A source named by a pattern
(``%b``: the file's own name) is not checked.
"""

from __future__ import annotations

import os
from typing import Any

import h5py

from zstore.convert._source import identity_of

#: what a dataset reads from other files: (kind, file name as HDF5 stores it, the
#: source dataset's path for a virtual dataset, else "")
Others = tuple[tuple[str, str, str], ...]


def other_files(ds: Any) -> Others:
    """The files the h5py dataset id ``ds`` reads besides its own: a virtual dataset's
    source files (not its own file, ``"."``), an external storage's files."""
    try:
        dcpl = ds.get_create_plist()
        layout = dcpl.get_layout()
        if layout == h5py.h5d.VIRTUAL:
            out = []
            for i in range(dcpl.get_virtual_count()):
                name = dcpl.get_virtual_filename(i)
                if name != ".":
                    out.append(("virtual", name, dcpl.get_virtual_dsetname(i)))
            return tuple(dict.fromkeys(out))
        if layout == h5py.h5d.CONTIGUOUS and dcpl.get_external_count():
            files = [dcpl.get_external(i)[0] for i in range(dcpl.get_external_count())]
            return tuple(
                dict.fromkeys(("external", f.decode("utf-8", "surrogateescape"), "") for f in files)
            )
    except (OSError, RuntimeError, ValueError, TypeError):
        pass
    return ()


def _where(kind: str, name: str, source: str) -> str | None:
    """The path HDF5 reads ``name`` at, or None where no candidate exists."""
    if os.path.isabs(name):
        return name if os.path.exists(name) else None
    prefix = os.environ.get("HDF5_VDS_PREFIX" if kind == "virtual" else "HDF5_EXTFILE_PREFIX")
    places = [prefix] if prefix else []
    if kind == "virtual":
        places.append(os.path.dirname(os.path.abspath(source)))
    places.append(os.getcwd())
    for place in places:
        path = os.path.join(place, name)
        if os.path.exists(path):
            return os.path.abspath(path)
    return None


class OtherFiles:
    """The other files of one HDF5 file's datasets: where each is, whether a virtual
    dataset's sources are all there, and their identities."""

    def __init__(self, source: str):
        self.source = source
        self._held: dict[tuple[str, str], bool] = {}  # (path, dataset): present
        #: (kind, name) -> the path and identity of the file there, or None (absent)
        self._found: dict[tuple[str, str], tuple[str, tuple[int, int, int]] | None] = {}

    def _file(self, kind: str, name: str) -> tuple[str, tuple[int, int, int]] | None:
        """Where ``name`` is and its (size, mtime_ns, inode), looked up once (many
        datasets may read one file); None where it is not there."""
        if (kind, name) not in self._found:
            path = _where(kind, name, self.source)
            try:
                self._found[(kind, name)] = (path, identity_of(path)) if path else None
            except OSError:
                self._found[(kind, name)] = None
        return self._found[(kind, name)]

    def missing(self, others: Others) -> str | None:
        """Why a dataset reading ``others`` would read fill values for data it lacks
        (a virtual dataset's source file or dataset not there), else None."""
        for kind, name, dataset in others:
            if kind != "virtual" or "%" in name:
                continue
            found = self._file(kind, name)
            if found is None:
                return f"source file {name} is missing"
            if not self._has(found[0], dataset):
                return f"source {name} has no dataset {dataset}"
        return None

    def _has(self, path: str, dataset: str) -> bool:
        key = (path, dataset)
        if key not in self._held:
            try:
                with h5py.File(path, "r") as f:
                    self._held[key] = isinstance(f.get(dataset), h5py.Dataset)
            except (OSError, ValueError):
                self._held[key] = False
        return self._held[key]

    def identities(self, others: Others) -> dict[str, tuple[int, int, int]]:
        """(size, mtime_ns, inode) of each file of ``others`` that is there."""
        out: dict[str, tuple[int, int, int]] = {}
        for kind, name, _ in others:
            found = self._file(kind, name) if "%" not in name else None
            if found is not None:
                out[found[0]] = found[1]
        return out


def _depends(items: list[Any], source: str | None = None) -> dict[str, tuple[int, int, int]]:
    """The other files ``items`` (those of ``source``, where given) read, with their
    identities (:attr:`SourceItem.depends`)."""
    found: dict[str, tuple[int, int, int]] = {}
    for it in items:
        if source is None or it.source == source:
            found.update(it.depends)
    return found


def read_by_datasets(items: list[Any], sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries for a conversion's fingerprint (:func:`zstore.convert._corpus.fingerprint`)
    of the other files ``items`` read (:attr:`SourceItem.depends`), as the sources'
    entries are, marked ``read_by_datasets`` (they are no source of items of their
    own): a rerun after one of them changed is a conversion of other values (a finished
    store is not taken as done, an unfinished one not resumed with both versions in
    it). Nothing where no dataset reads another file: such stores keep their
    fingerprint."""
    named = {entry.get("source") for entry in sources}
    return [
        {"source": path, "size": size, "mtime_ns": mtime, READ_BY: True}
        for path, (size, mtime, _) in sorted(_depends(items).items())
        if path not in named
    ]


#: the key that marks a fingerprint's entry of a file read by datasets (not a source)
READ_BY = "read_by_datasets"


def reads_of(items: list[Any], source: str) -> list[dict[str, Any]]:
    """The other files the items of ``source`` read, with their versions (size,
    modification time, inode), for an appended file's recorded version: its completion
    marks change when one of them changes, and a rerun compares them
    (:func:`changed_reads`)."""
    return [
        {"source": path, "size": size, "mtime_ns": mtime, "inode": inode}
        for path, (size, mtime, inode) in sorted(_depends(items, source).items())
    ]


def changed_reads(recorded: dict[str, Any]) -> str | None:
    """The first file of a recorded version's ``reads`` (:func:`reads_of`) that is no
    longer the one recorded (changed or gone), else None."""
    for entry in recorded.get("reads") or []:
        path = str(entry.get("source", ""))
        try:
            now = identity_of(path)
        except OSError:
            return path
        if now != (entry.get("size"), entry.get("mtime_ns"), entry.get("inode")):
            return path
    return None
