"""Many HDF5 sources as one corpus: expand paths, name items, fingerprint the files.

With one source, item names are its group paths; with several, ``<file stem>/<group
path>``, and two sources with the same stem are an error naming both.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zstore.errors import SourceError
from zstore.urls import is_url, local_path

SUFFIXES = (".h5", ".hdf5")


def expand_sources(sources: str | os.PathLike[str] | Sequence[Any]) -> list[str]:
    """Files, directories (every ``*.h5`` / ``*.hdf5`` below them) and glob patterns,
    in a stable order, each file once.

    A directory's hidden files and directories (names starting with ``.``: macOS's
    ``._x.h5`` AppleDouble files, ``.ipynb_checkpoints``, ``.snapshot``) are left out,
    as the shell's and :mod:`glob`'s patterns leave them out; a hidden file named on
    its own is read.  A file reached under a second name (a symbolic or hard link to a
    file already listed) is read once, with a warning naming both."""
    given = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    if not given:
        raise SourceError(
            "no source given: name one or more HDF5 files, directories or glob patterns"
        )
    out: list[str] = []
    for src in (local_path(os.fspath(g)) for g in given):  # file://PATH is PATH
        if is_url(src):
            out.append(src)
        elif os.path.isdir(src):
            found = sorted(
                str(p)
                for p in Path(src).rglob("*")
                if p.suffix.lower() in SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(src).parts)
                and p.is_file()
            )
            if not found:
                raise SourceError(
                    f"{src}: a directory with no *.h5 or *.hdf5 file below it"
                    + _named_otherwise(src)
                )
            out += found
        elif any(c in src for c in "*?["):
            found = sorted(glob.glob(src, recursive=True))
            if not found:
                raise SourceError(f"{src}: the pattern matches no file")
            out += found
        else:
            out.append(src)
    return _once(list(dict.fromkeys(out)))  # each file once, first place kept


def _is_hdf5(path: str) -> bool:
    """Whether ``path`` is an HDF5 file, by HDF5's own look for its signature (at the
    start, or after a user block: MATLAB's v7.3 files have one of 512 bytes)."""
    import h5py

    try:
        return bool(h5py.is_hdf5(path))
    except OSError:
        return False


def _named_otherwise(src: str, most: int = 1000) -> str:
    """What to say of a directory with no ``*.h5``: the HDF5 files in it under other
    suffixes (MATLAB's ``*.mat`` of v7.3, ``*.nc`` of netCDF-4), by their signature
    (the first ``most`` files looked at), and the pattern that names them."""
    found: dict[str, list[str]] = {}
    looked = 0
    for p in Path(src).rglob("*"):  # lazily: a large tree is not listed whole again
        if looked >= most:
            break
        if not p.is_file() or any(part.startswith(".") for part in p.relative_to(src).parts):
            continue
        looked += 1
        if _is_hdf5(str(p)):
            found.setdefault(p.suffix or "(no suffix)", []).append(p.name)
    if not found:
        return ""
    for names in found.values():
        names.sort()
    kinds = ", ".join(
        f"{len(names)} *{suffix}: {', '.join(names[:2])}{', ...' if len(names) > 2 else ''}"
        for suffix, names in sorted(found.items(), key=lambda kv: -len(kv[1]))
    )
    suffix = max(found, key=lambda k: len(found[k]))
    pattern = os.path.join(src, "**", f"*{suffix}" if suffix != "(no suffix)" else "*")
    return (
        f"; it holds HDF5 files named otherwise ({kinds}): name them by a pattern, e.g. '{pattern}'"
    )


def _once(files: list[str]) -> list[str]:
    """``files`` without a local file reached again under another name (a link)."""
    import warnings

    seen: dict[tuple[int, int], str] = {}
    out = []
    for f in files:
        try:
            st = None if is_url(f) else os.stat(f)
        except OSError:  # named on its own and missing: opening it says so
            st = None
        if st is not None and (st.st_dev, st.st_ino) in seen:
            first = seen[(st.st_dev, st.st_ino)]
            warnings.warn(
                f"{f}: the same file as {first} (a link to it, or another path to it); "
                f"its items are read once, from {first}",
                stacklevel=3,
            )
            continue
        if st is not None:
            seen[(st.st_dev, st.st_ino)] = f
        out.append(f)
    return out


def stems(files: list[str]) -> dict[str, str]:
    """Each file's item-name prefix (its stem); the same stem twice is an error."""
    owner: dict[str, str] = {}
    for f in files:
        stem = Path(f.rstrip("/")).stem
        if stem in owner:
            raise SourceError(
                f"two sources have the stem '{stem}': {owner[stem]} and {f}; "
                "item names would collide: rename one of them"
            )
        owner[stem] = f
    return {f: s for s, f in owner.items()}


def source_name(f: str) -> str:
    """How a source is named in a manifest: its URL, or its absolute path."""
    return f if is_url(f) else os.path.abspath(f)


def file_identity(f: str) -> dict[str, Any]:
    """What says a source file is the one an append wrote from: its name, size and
    version (modification time, inode and change time on a local disk; ETag or
    modification time on an object store)."""
    if is_url(f):
        return fingerprint([f], {})["sources"][0]
    st = os.stat(f)
    return {
        "source": source_name(f),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "ctime_ns": st.st_ctime_ns,
    }


def identity_mark(identity: dict[str, Any]) -> str:
    """A short string naming one version of a source file (an item's completion mark)."""
    import hashlib
    import json

    return "v:" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def fingerprint(files: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """What identifies one conversion: every source's path, size and mtime, and options."""
    out = []
    for f in files:
        if is_url(f):
            import fsspec

            fs, path = fsspec.core.url_to_fs(f)
            fs.invalidate_cache(path)  # a listing's cached details may be of an older version
            info = fs.info(path)
            out.append(
                {
                    "source": source_name(f),
                    "size": info.get("size"),
                    "version": str(info.get("ETag") or info.get("mtime") or ""),
                }
            )
        else:
            st = os.stat(f)
            out.append({"source": source_name(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return {"sources": out, "options": options}


def check_versions(recorded: list[dict[str, Any]], again: str) -> None:
    """Raise :class:`SourceError` naming the first source on an object store (or other
    fsspec URL) whose version (size, ETag or modification time) is no longer the one
    ``recorded`` (:func:`fingerprint`'s or :func:`file_identity`'s entries, taken before
    its items were read).  Each worker opens such a file on its own, so a file replaced
    meanwhile would give a store of items from both versions.  Local files are checked
    by :func:`zstore.convert._source.check_unchanged`."""
    for entry in recorded:
        url = str(entry.get("source", ""))
        if not is_url(url):
            continue
        try:
            now: dict[str, Any] | None = file_identity(url)
        except OSError:
            now = None
        if now != entry:
            raise SourceError(
                f"{url}: the object changed while its items were converted (its size or "
                "version); the items read from it may come from both versions, so the "
                f"store is not finished: {again} once nothing writes the object"
            )


def differences(old: Any, new: dict[str, Any]) -> str:
    """How the conversion that wrote a store (its fingerprint ``old``) differs from this
    one (``new``), for the refusal to write over it: "another source or other options"
    said nothing of which, and a source merely touched since read as another."""
    if not isinstance(old, dict):
        return "another source or other options"
    said = []
    before = {s.get("source"): s for s in old.get("sources", []) if isinstance(s, dict)}
    now = {s["source"]: s for s in new["sources"]}
    gone = sorted(str(f) for f in set(before) - set(now))
    added = sorted(set(now) - set(before))
    if gone:
        said.append(f"sources not given now: {', '.join(gone[:3])}")
    if added:
        said.append(f"sources not in it: {', '.join(added[:3])}")
    changed = [f for f in now if f in before and before[f] != now[f]]
    if changed:
        said.append(f"{', '.join(changed[:3])} changed since (size or modification time)")
    options, was = new.get("options", {}), old.get("options", {})
    for key in sorted(set(options) | set(was)):
        if options.get(key) != was.get(key):
            said.append(f"{key} {was.get(key)!r} there, {options.get(key)!r} now")
    return "; ".join(said) or "another source or other options"
