"""Groups inside an item's group: items of their own, or arrays of the item.

zstore takes each HDF5 group that holds datasets as one item.  Some corpora keep parts
of a recording in groups inside its group (``/utt0/audio`` beside ``/utt0/feats/mfcc``
and ``/utt0/feats/pitch``); others keep recordings inside a group that holds data of
its own (``/spk1/embedding`` beside ``/spk1/utt1/wav``).  The file cannot tell the two
apart, so the choice is the user's (``subgroups``):

- ``"items"`` (the default): every group that holds datasets is an item of its own;
  when some lie inside others, the scan warns, naming the option.
- ``"arrays"``: the datasets of groups inside an item's group are arrays of that item
  (the outermost group that holds datasets), named by their path below it with ``.``
  for ``/`` (``feats.mfcc``), as a compound dataset's fields are named.
"""

from __future__ import annotations

import warnings
from typing import Any

from zstore.convert._fields import SEPARATOR
from zstore.errors import SourceError, some_names

#: the values of ``subgroups``
CHOICES = ("items", "arrays")

#: arrays of a group, as the scan lists them: (array name, shape, dtype)
Arrays = list[tuple[str, tuple[int, ...], Any]]


def check_subgroups(subgroups: Any, dataset_items: str | None = None) -> None:
    """``subgroups`` must be one of :data:`CHOICES`, and ``"arrays"`` only without
    ``dataset_items`` (every dataset is then an item: there are no groups to merge)."""
    if subgroups not in CHOICES:
        raise SourceError(
            f"subgroups={subgroups!r}: give 'items' (each group that holds datasets is an "
            "item) or 'arrays' (groups inside an item's group hold arrays of that item)"
        )
    if subgroups != "items" and dataset_items is not None:
        raise SourceError(
            f"--subgroups {subgroups} and --dataset-items {dataset_items} were both "
            "given: with --dataset-items every dataset is an item of its own, so "
            "there are no groups to read as arrays; give one of them"
        )


def outermost(groups: set[str], group: str) -> str | None:
    """The outermost of ``groups`` that ``group`` lies inside, or None."""
    parts = group.split("/")
    for i in range(1, len(parts)):
        above = "/".join(parts[:i])
        if above in groups:
            return above
    return None


def nested_items(path: str, groups: set[str], subgroups: str) -> None:
    """Warn when items lie inside other items and each is converted as its own."""
    if subgroups != "items":
        return
    inside = sorted(g for g in groups if outermost(groups, g) is not None)
    if not inside:
        return
    first = inside[0]
    top = str(outermost(groups, first))
    example = first[len(top) + 1 :].replace("/", SEPARATOR) + f"{SEPARATOR}<dataset>"
    warnings.warn(
        f"{path}: {len(inside)} group(s) holding datasets lie inside another such group "
        f"({some_names(inside, at_most=3)}; '{first}' inside '{top}'), and each is "
        "converted as an item of its own. If they hold parts of the recording they lie "
        "in (features, labels), give --subgroups arrays (subgroups='arrays'): their "
        f"datasets become arrays of that item, named like '{example}'",
        stacklevel=2,
    )


def merge_subgroups(
    groups: dict[str, Arrays],
    split: dict[str, dict[str, tuple[str, str]]],
    skipped: list[str],
) -> None:
    """Move the arrays of every group inside another of ``groups`` into the outermost
    one, named ``<path below it with '.' for '/'>.<array>``; ``split`` (per group, an
    array's (dataset, field)) records the dataset each reads, relative to the item's
    group.  A name that another array of the item has already is skipped, with why."""
    every = set(groups)
    for group in sorted(every):
        top = outermost(every, group)
        if top is None:
            continue
        below = group[len(top) + 1 :]
        prefix = below.replace("/", SEPARATOR) + SEPARATOR
        taken = {a for a, _, _ in groups[top]}
        own = split.pop(group, {})
        for array, shape, dtype in groups.pop(group):
            name = prefix + array
            if name in taken:
                skipped.append(
                    f"{group}/{array}: inside item '{top}', whose array '{name}' it would be "
                    "is another dataset"
                )
                continue
            dataset, field = own.get(array, (array, ""))
            groups[top].append((name, shape, dtype))
            split.setdefault(top, {})[name] = (f"{below}/{dataset}", field)
            taken.add(name)
