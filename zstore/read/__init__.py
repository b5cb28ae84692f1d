"""The read path: a window of an item, from the tiers or the origin, into numpy.

Holds the window reader, the chunk source (byte ranges, coalescing, the origin), the
RAM tier's shard forms (decoded and encoded) and the builds behind the reads, whole
shards in the SSD tier, the maps a process keeps of tier values, the zarr ``Store`` with
the tiers in it, and streamed copies into batch buffers.

May import: :mod:`zstore.format`, :mod:`zstore.cache` and the shared leaves.  Never
:mod:`zstore.train`, :mod:`zstore.convert` or torch.
"""

from zstore.read._ram_form import form_key
from zstore.read._slot_shards import complete_in
from zstore.read._window_copy import window_shape
from zstore.read._zarr_store import CachedStore, open_store
from zstore.read.reader import WindowReader
from zstore.read.streamcopy import copy_streamed, streaming

__all__ = [
    "complete_in",
    "CachedStore",
    "copy_streamed",
    "form_key",
    "open_store",
    "streaming",
    "window_shape",
    "WindowReader",
]
