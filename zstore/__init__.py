"""zstore: random-window training data from HDF5, rechunked to Zarr v3, read through a node-shared cache."""
from zstore.config import CacheConfig, parse_size
from zstore.convert import ConvertReport, convert
from zstore.errors import (ConfigError, DestinationError, IntegrityError, OriginError,
                           ShortItemError, SourceError, StoreFormatError, ZstoreError)

__version__ = "0.1.0"
__all__ = ["CacheConfig", "ConfigError", "ConvertReport", "DestinationError", "IntegrityError",
           "OriginError", "ShortItemError", "SourceError", "StoreFormatError", "ZstoreError",
           "convert", "parse_size", "__version__"]
