"""zstore: random-window training data from HDF5, rechunked to Zarr v3, read through a
node-shared RAM/SSD cache.

>>> import zstore
>>> sorted(zstore.__all__)[:3]
['CacheConfig', 'CachedFileSystem', 'CachedStore']
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

import fsspec as _fsspec

from zstore.convert import ConvertReport, TidyReport, append, convert, tidy
from zstore.errors import (
    ConfigError,
    DestinationError,
    IntegrityError,
    MissingDataError,
    OriginError,
    ShortItemError,
    SourceError,
    StoreFormatError,
    StoreReplacedError,
    ZstoreError,
)
from zstore.units import parse_size

if _TYPE_CHECKING:
    from zstore.cache import CacheConfig, cache_stats, clear_cache
    from zstore.cachedfs import CachedFileSystem, cached_filesystem
    from zstore.cli import store_info, warm
    from zstore.read import CachedStore, WindowReader, open_store
    from zstore.train import (
        LoaderError,
        NodeSampler,
        WindowDataset,
        WindowLoader,
        WindowSampler,
        collate_pad,
    )

#: Names imported on first use, by module.  The training layer's import torch (~1.1 s,
#: ~300 MB); the reading layers import zarr and the cache (~0.3 s).  A conversion's
#: worker processes import only the converter (they start beside the scan of the
#: source, on the same cores), and scripts that only convert do without the rest.
_LAZY = {
    "zstore.cache": ("CacheConfig", "cache_stats", "clear_cache"),
    "zstore.cachedfs": ("CachedFileSystem", "cached_filesystem"),
    "zstore.cli": ("store_info", "warm"),
    "zstore.read": ("CachedStore", "WindowReader", "open_store"),
    "zstore.train": (
        "LoaderError",
        "NodeSampler",
        "WindowDataset",
        "WindowLoader",
        "WindowSampler",
        "collate_pad",
    ),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> object:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'zstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

# `fsspec.open("zstore::s3://...")` works once zstore is imported; the package's
# fsspec.specs entry point registers it even before that.
_fsspec.register_implementation("zstore", "zstore.cachedfs.CachedFileSystem", clobber=True)
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
    "StoreReplacedError",
    "tidy",
    "TidyReport",
    "warm",
    "WindowDataset",
    "WindowLoader",
    "WindowReader",
    "WindowSampler",
    "ZstoreError",
    "__version__",
]
