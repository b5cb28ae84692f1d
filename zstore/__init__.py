"""zstore: random-window training data from HDF5, rechunked to Zarr v3, read through a
node-shared RAM/SSD cache.

>>> import zstore
>>> sorted(zstore.__all__)[:3]
['CacheConfig', 'CachedFileSystem', 'CachedStore']
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

import fsspec as _fsspec

from zstore.cache import CacheConfig, cache_stats, clear_cache
from zstore.cachedfs import CachedFileSystem, cached_filesystem
from zstore.cli import store_info, warm
from zstore.convert import ConvertReport, append, convert
from zstore.errors import (
    ConfigError,
    DestinationError,
    IntegrityError,
    MissingDataError,
    OriginError,
    ShortItemError,
    SourceError,
    StoreFormatError,
    ZstoreError,
)
from zstore.read import CachedStore, WindowReader, open_store
from zstore.units import parse_size

if _TYPE_CHECKING:
    from zstore.train import (
        LoaderError,
        NodeSampler,
        WindowDataset,
        WindowLoader,
        WindowSampler,
        collate_pad,
    )

#: The training layer's names import torch (~1.1 s, ~300 MB): on first use, so that a
#: conversion's worker processes, and scripts that only convert, do without it.
_TRAIN = (
    "LoaderError",
    "NodeSampler",
    "WindowDataset",
    "WindowLoader",
    "WindowSampler",
    "collate_pad",
)


def __getattr__(name: str) -> object:
    if name in _TRAIN:
        import zstore.train

        value = getattr(zstore.train, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zstore' has no attribute {name!r}")


__version__ = "0.1.0"

# `fsspec.open("zstore::s3://...")` works once zstore is imported; the package's
# fsspec.specs entry point registers it even before that.
_fsspec.register_implementation("zstore", CachedFileSystem, clobber=True)
__all__ = [
    "append",
    "cache_stats",
    "CacheConfig",
    "cached_filesystem",
    "CachedFileSystem",
    "CachedStore",
    "clear_cache",
    "collate_pad",
    "ConfigError",
    "convert",
    "ConvertReport",
    "DestinationError",
    "IntegrityError",
    "LoaderError",
    "NodeSampler",
    "MissingDataError",
    "open_store",
    "OriginError",
    "parse_size",
    "ShortItemError",
    "SourceError",
    "store_info",
    "StoreFormatError",
    "warm",
    "WindowDataset",
    "WindowLoader",
    "WindowReader",
    "WindowSampler",
    "ZstoreError",
    "__version__",
]
