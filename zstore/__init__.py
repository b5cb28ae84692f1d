"""zstore: random-window training data from HDF5, rechunked to Zarr v3, read through a
node-shared RAM/SSD cache.

>>> import zstore
>>> sorted(zstore.__all__)[:3]
['CacheConfig', 'ConfigError', 'ConvertReport']
"""
from zstore.cache import cache_stats, clear_cache
from zstore.collate import collate_pad
from zstore.config import CacheConfig, parse_size
from zstore.convert import ConvertReport, convert
from zstore.dataset import WindowDataset
from zstore.errors import (ConfigError, DestinationError, IntegrityError, MissingDataError,
                           OriginError, ShortItemError, SourceError, StoreFormatError, ZstoreError)
from zstore.info import store_info
from zstore.loader import LoaderError, WindowLoader
from zstore.reader import WindowReader
from zstore.store import CachedStore, open_store
from zstore.warm import warm

__version__ = "0.1.0"
__all__ = ["CacheConfig", "CachedStore", "ConfigError", "ConvertReport", "DestinationError",
           "IntegrityError", "LoaderError", "MissingDataError", "OriginError", "ShortItemError", "SourceError",
           "StoreFormatError", "WindowDataset", "WindowLoader", "WindowReader", "ZstoreError", "cache_stats",
           "clear_cache", "collate_pad", "convert", "open_store", "parse_size", "store_info", "warm",
           "__version__"]
