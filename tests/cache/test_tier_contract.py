"""The contract every tier keeps, run on the RAM tier and the SSD tier as TieredCache
builds them: values come back as stored, a missing key is None, a damaged value is
dropped (never served) and logged for every process, the budget holds, and a tier
pickles as its settings."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import zstore
from zstore.cache import TieredCache


class TierContract:
    """Subclasses say which tier of a TieredCache to test."""

    which = ""

    @pytest.fixture
    def tier(self, tmp_path):
        ram = dict(ram_dir=tmp_path / "ram", ram_bytes="4MB") if self.which == "ram" else {}
        ssd = dict(ssd_dir=tmp_path / "ssd", ssd_bytes="4MB") if self.which == "ssd" else {}
        config = zstore.CacheConfig(
            **{"ram_dir": None, "ssd_dir": None, "ram_format": "encoded", **ram, **ssd}
        )
        tiers = TieredCache(config.resolved(), "contract")
        got = getattr(tiers, self.which)
        assert got is not None
        return got

    def test_a_value_comes_back_as_stored(self, tier):
        payload = np.random.default_rng(0).bytes(300_000)
        assert tier.put("k", payload, blocked=True)
        assert bytes(tier.get("k")) == payload
        checked, path, ino = tier.get_mapped("k")
        assert bytes(checked.payload) == payload and ino > 0
        assert checked.verify(0, len(payload))

    def test_a_missing_key_is_none(self, tier):
        assert tier.get("nothing") is None and tier.get_mapped("nothing") is None

    def test_a_damaged_value_is_dropped_and_logged_for_every_process(self, tier):
        assert tier.put("k", b"x" * 200_000)
        checked, path, ino = tier.get_mapped("k")
        head = tier.evictions.head()
        with open(path, "r+b") as f:  # a bit flip in the tier's file
            f.seek(100_000)
            f.write(b"y")
        assert tier.get("k") is None  # checked whole when read: never served
        assert tier.get("k") is None  # and gone
        assert tier.put("k", b"z" * 200_000) and bytes(tier.get("k")) == b"z" * 200_000
        tier.drop("k", tier.get_mapped("k")[2])
        assert tier.evictions.head() > head and tier.get("k") is None

    def test_the_budget_holds(self, tier):
        for i in range(40):  # 40 x 256 KiB into a 4 MB budget
            tier.put(f"k{i}", bytes([i]) * 262_144)
        assert tier.usage()["bytes_on_disk"] <= tier.budget
        assert not tier.put("huge", b"h" * 8_000_000)  # larger than the budget: skipped

    def test_a_tier_pickles_as_its_settings(self, tier):
        assert tier.put("k", b"v" * 1000)
        again = pickle.loads(pickle.dumps(tier))
        assert again.directory == tier.directory and bytes(again.get("k")) == b"v" * 1000


class TestRamTier(TierContract):
    which = "ram"


class TestSsdTier(TierContract):
    which = "ssd"
