"""Never wrong data, part two: the store's files and the tiers' files changed under a
running job, damaged tier values found by one process, files rewritten with their size and
time kept, and arguments that used to be taken the wrong way."""

from __future__ import annotations

import pytest

import zstore


def test_a_negative_index_is_refused_not_wrapped(small_store):
    ds = zstore.WindowDataset(small_store, window_seconds=1.0, cache=False)
    with pytest.raises(IndexError, match="-1 out of range"):
        ds[-1]
    assert ds[len(ds) - 1]["length"] > 0


def test_an_items_callable_that_raises_is_named(small_store):
    def choose(name, attrs):
        return attrs["missing"] > 0

    with pytest.raises(zstore.ConfigError, match="items= callable raised KeyError") as e:
        zstore.WindowDataset(small_store, window_seconds=1.0, cache=False, items=choose)
    assert "utt000000" in str(e.value)
