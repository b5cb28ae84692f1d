import os

import pytest

from zstore.cache.options import CacheConfig
from zstore.errors import ConfigError
from zstore.units import format_size, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("64GB", 64 * 10**9),
        ("500MiB", 500 * 2**20),
        ("1.5 G", 1_500_000_000),
        (1000, 1000),
        ("0", 0),
        ("2TiB", 2 * 2**40),
        ("10k", 10_000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", -1, "", True])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad, name="ram_bytes")


def test_format_size():
    assert format_size(1536) == "1.5 KiB"
    assert format_size(10) == "10 B"


def test_environment_sets_every_field(monkeypatch, tmp_path):
    monkeypatch.setenv("ZSTORE_RAM_DIR", str(tmp_path / "r"))
    monkeypatch.setenv("ZSTORE_RAM_BYTES", "2GB")
    monkeypatch.setenv("ZSTORE_SSD_DIR", str(tmp_path / "s"))
    monkeypatch.setenv("ZSTORE_SSD_BYTES", "3GiB")
    monkeypatch.setenv("ZSTORE_RAM_FORMAT", "encoded")
    monkeypatch.setenv("ZSTORE_FETCH", "shard")
    monkeypatch.setenv("ZSTORE_MAX_REQUESTS", "4")
    r = CacheConfig().resolved()
    assert (r.ram_dir, r.ram_bytes) == (str(tmp_path / "r"), 2 * 10**9)
    assert (r.ssd_dir, r.ssd_bytes) == (str(tmp_path / "s"), 3 * 2**30)
    assert (r.ram_format, r.fetch, r.max_requests) == ("encoded", "shard", 4)


def test_arguments_win_over_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ZSTORE_RAM_BYTES", "2GB")
    r = CacheConfig(ram_dir=tmp_path, ram_bytes="1MB").resolved()
    assert r.ram_bytes == 10**6


def test_disable_tiers(monkeypatch, tmp_path):
    r = CacheConfig(ram_bytes=0, ssd_dir=None).resolved()
    assert r.ram_dir is None and r.ssd_dir is None
    monkeypatch.setenv("ZSTORE_SSD_DIR", "none")
    assert CacheConfig(ram_dir=None).resolved().ssd_dir is None


def test_defaults_are_sized_from_the_machine(tmp_path, monkeypatch):
    monkeypatch.delenv("ZSTORE_RAM_DIR")  # conftest points it away from the real tier
    r = CacheConfig().resolved()
    assert r.ssd_dir and r.ssd_dir.endswith("zstore") and r.ssd_bytes > 0
    if r.ram_dir:
        assert r.ram_dir == f"/dev/shm/zstore-{os.getuid()}" and r.ram_bytes > 0  # per user


@pytest.mark.parametrize(
    "field,value", [("ram_format", "zipped"), ("fetch", "all"), ("max_requests", 0)]
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        CacheConfig(**{field: value}).resolved()
