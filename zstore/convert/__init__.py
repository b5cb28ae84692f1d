"""Conversion: HDF5 sources into a zstore store, and appends to one.

Holds the HDF5 source (scan, links, rate claims, dimension names) and the corpus of many
files (names, fingerprints), the pipeline (batched, resumable, verified), appends, the
task runner (local processes or Dask), the store's write lock, and ``tidy`` (what
appends and killed writers leave in a finished store).

May import: :mod:`zstore.format` and the shared leaves (the origin, URLs, units,
errors).  Never the cache, the read path, training or torch.
"""

from zstore.convert._items import CODECS
from zstore.convert._report import ConvertReport
from zstore.convert.append import append
from zstore.convert.pipeline import convert
from zstore.convert.tidy import TidyReport, tidy

__all__ = ["CODECS", "ConvertReport", "TidyReport", "append", "convert", "tidy"]
