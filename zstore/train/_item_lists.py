"""The item lists ``WindowDataset(items=...)`` takes: names, a file of them in the
forms users already keep (text, JSON, a pickled list or tuple), or a callable over each
item's HDF5 attributes; checked against the store."""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from zstore.errors import ConfigError, some_names
from zstore.format import source_count
from zstore.read import WindowReader

ITEM_LIST_FORMS = (
    "a text file with one item name per line ('#' comments), a JSON list of names, a "
    "NumPy .npy array of names, or a pickled list, tuple, set or array of names"
)


def read_item_list(path: str) -> tuple[list[str], bool]:
    """The item names in the file ``path``: a pickled list, tuple, set (in sorted order:
    a set's own order changes from one process to the next) or NumPy array of names (as
    HDF5 dataset code keeps its subsets; unpickling runs the file's code, so it is loaded
    only because the user named it), a ``.npy`` array (``np.save``; loaded without
    pickles), a JSON list, or text with one name per line; and whether it was text
    (whose lines may carry more columns after the name)."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(
            f"items={path!r}: cannot read the item list ({e.strerror}); pass "
            f"{ITEM_LIST_FORMS}, or a list of names"
        ) from None
    text = False
    try:
        if raw[:1] == b"\x80":  # a pickle (protocol 2 and later)
            names = pickle.loads(raw)
        elif raw[:6] == b"\x93NUMPY":  # np.save
            names = np.load(io.BytesIO(raw), allow_pickle=False)
        elif raw.lstrip()[:1] in (b"[", b"{"):  # a JSON object is said to be one below
            names = json.loads(raw)
        else:
            text = True
            lines = (line.strip() for line in raw.decode("utf-8").splitlines())
            names = [n for n in lines if n and not n.startswith("#")]
    except Exception as e:  # an unreadable pickle, JSON or text: say which forms work
        raise ConfigError(
            f"items={path!r}: cannot read it as an item list ({type(e).__name__}); pass "
            f"{ITEM_LIST_FORMS}"
        ) from None
    if isinstance(names, np.ndarray) and names.ndim == 1:
        names = names.tolist()
    if isinstance(names, (set, frozenset)) and all(isinstance(n, str) for n in names):
        names = sorted(names)
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, (str, bytes)) for n in names):
        what = "a JSON object" if raw.lstrip()[:1] == b"{" else f"a {type(names).__name__}"
        raise ConfigError(
            f"items={path!r}: holds {what}, not a list of item names; pass {ITEM_LIST_FORMS}"
        )
    return [n.decode() if isinstance(n, bytes) else n for n in names], text


def select_items(reader: WindowReader, items: Any, url: str) -> list[str]:
    """The item names an ``items=`` argument stands for, checked against the store."""
    known = reader.manifest.items
    if callable(items):
        chosen = []
        for i, n in enumerate(known):
            try:
                keep = items(n, reader.item_attrs(i))
            except Exception as e:
                raise ConfigError(
                    f"{url}: the items= callable raised {type(e).__name__} "
                    f"({e}) on item {n!r}; fix it so that it returns True or "
                    "False for every item"
                ) from e
            if keep:
                chosen.append(n)
        return chosen
    text = False  # a text file's lines may carry columns after the name
    if isinstance(items, (str, os.PathLike)):
        names, text = read_item_list(os.fspath(items))
    else:
        names = [str(n) for n in items]
    several = source_count(reader.manifest.extra) > 1
    names = resolve_names(names, known, url, by_stem=several, columns=text)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"{url}: {len(unknown)} item(s) of the item list are not in the "
            f"store: {some_names(unknown)} (items are named like {known[0]!r}; "
            "see zstore info)"
        )
    if len(set(names)) != len(names):
        raise ConfigError(
            f"{url}: the item list names some items twice; use "
            "windows_per_item for more windows per item"
        )
    return names


def resolve_names(
    names: list[str],
    known: Sequence[str],
    url: str,
    by_stem: bool = True,
    columns: bool = True,
) -> list[str]:
    """``names`` as the store names its items.  A name the store has is itself; else a
    Kaldi-style line (``utt2spk``, ``wav.scp``: the name, whitespace, other columns)
    stands for its first column; and a group's path in its file (``rec1``) stands for
    the one item ``<file stem>/rec1`` of a store made from several files (``by_stem``:
    its items are named so).  ``columns``: the names are a text file's lines (the only
    form Kaldi-style lines come in; a name passed in a list is taken whole).  A name that
    fits several items is an error naming them; one that fits none is kept, for the
    caller's error."""
    have = set(known)
    if all(n in have for n in names):
        return names
    by_group: dict[str, list[str]] = {}
    for k in known if by_stem else ():  # <file stem>/<group path>: the group's path
        stem, sep, group = k.partition("/")
        if sep:
            by_group.setdefault(group, []).append(k)
    out = []
    for n in names:
        first = n.split(maxsplit=1)[0] if columns and n.strip() else n
        for name in (n, first):
            if name in have:
                out.append(name)
                break
            fits = by_group.get(name, [])
            if len(fits) > 1:
                raise ConfigError(
                    f"{url}: the item list's {name!r} is a group of several files: "
                    f"{some_names(fits)}; name the one meant as the store does"
                )
            if fits:
                out.append(fits[0])
                break
        else:
            out.append(n)
    return out
