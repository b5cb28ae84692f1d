"""Which append wrote an object (zstore.format.lineage): the key a node cache files it
under, from the manifest header's record of each append alone."""

from __future__ import annotations

import pytest

from zstore.format.lineage import Append, Lineage, appends_of, cache_namespace, recorded

ITEMS = ["a", "spk1/utt1", "b", "spk1/utt2", "c"]  # a, spk1/utt1 converted; the rest appended


def lineage() -> Lineage:
    appends = [
        Append("one", 2, {"zstore_packed/0/wav": 4}, {"zstore_packed/0": 2}),
        Append(
            "two",
            4,
            {"zstore_packed/0/wav": 6, "zstore_packed/1/wav": 0},
            {"zstore_packed/0": 3, "zstore_packed/1": 0},
        ),
    ]
    return Lineage(appends, ITEMS.index, {"wav": -1, "act": 0})


@pytest.mark.parametrize(
    "key, written_by",
    [
        ("a/wav/c/0/3#D", ""),
        ("spk1/utt1/wav/c/0/0", ""),
        ("spk1/utt1/zarr.json", ""),
        ("b/wav/c/0/0#r10-20", "one"),
        ("b/wav/zarr.json", "one"),
        ("b/zarr.json", "one"),
        ("b/lab/c", "one"),
        ("spk1/utt2/wav/c.0.1", "one"),
        ("c/act/c/2/0", "two"),
        ("nothing/wav/c/0/0", ""),
        ("zarr.json", ""),
        ("zstore_items_0123456789ab/c/0", ""),
        ("zstore_packed/0/wav/c/0/3", ""),
        ("zstore_packed/0/wav/c/0/4#S", "one"),
        ("zstore_packed/0/wav/c/0/5", "one"),
        ("zstore_packed/0/wav/c/0/6", "two"),
        ("zstore_packed/0/items.1.json", ""),
        ("zstore_packed/0/items.2.json", "one"),
        ("zstore_packed/0/items.3.json", "two"),
        ("zstore_packed/1/wav/c/0/0", "two"),
        ("zstore_packed/1/items.0.json", "two"),
        ("zstore_packed/0/wav/zarr.json", "two"),  # grown by every append: the last
        ("zstore_packed/0/zarr.json", ""),
        ("zstore_packed/0/wav/c.0.6", "two"),
        ("zstore_packed/0/wav/cfoo", "two"),  # not a chunk: as its metadata
        ("zstore_packed/1/lab/c", ""),  # a scalar: no shard along time
    ],
)
def test_each_object_is_filed_under_the_append_that_wrote_it(key, written_by):
    assert lineage().of(key) == written_by


def test_a_store_no_append_recorded_keeps_the_store_id_alone():
    none = Lineage([], ITEMS.index, {})
    assert none.of("b/wav/c/0/0") == "" and none("zstore_packed/0/wav/c/0/0") == ""
    assert cache_namespace("s", {}) == "s"


def test_each_append_adds_its_record_after_the_others():
    header = {"appends": recorded({}, "one", 2, [("zstore_packed/0", 2, {"wav": 4, "act": 5})])}
    header["appends"] = recorded(
        header,
        "two",
        4,
        [("zstore_packed/0", 4, {"wav": 9}), ("zstore_packed/0", 3, {"wav": 6})],
    )
    got = appends_of(header)
    assert [a.id for a in got] == ["one", "two"]
    assert got[0] == Append(
        "one", 2, {"zstore_packed/0/wav": 4, "zstore_packed/0/act": 5}, {"zstore_packed/0": 2}
    )
    assert got[1].shards == {"zstore_packed/0/wav": 6} and got[1].batches == {"zstore_packed/0": 3}
    assert cache_namespace("s", header) == "s.two"
