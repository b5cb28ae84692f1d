"""Node-shared cache tiers: the RAM tier (tmpfs) and the SSD tier, each a budgeted,
process-safe directory, and their composition.

Holds the tier engine (diskcache with a value format carrying length and crc32c), the
budget and admission (who gives way in a full tier), the eviction log, fill locks,
stats, upkeep, where a tier may live and who owns it, the RAM format choice, and the
cache options (``CacheConfig``, ``ZSTORE_*`` variables).

May import: the shared leaves only (errors, units, urls).  Never :mod:`zstore.format`,
:mod:`zstore.read`, :mod:`zstore.train` or torch: the cache knows bytes under keys.
"""

from zstore.cache.files import open_file, write_json
from zstore.cache.first_reads import FirstReads
from zstore.cache.options import CacheConfig, ResolvedCache, as_cache_config
from zstore.cache.ownership import make_dir
from zstore.cache.ram_format import FormatChoice, choose, record
from zstore.cache.tier import Tier
from zstore.cache.tiered import TieredCache, cache_stats, clear_cache, mark_stats
from zstore.cache.value import Checked

__all__ = [
    "as_cache_config",
    "cache_stats",
    "CacheConfig",
    "Checked",
    "choose",
    "clear_cache",
    "FirstReads",
    "FormatChoice",
    "make_dir",
    "mark_stats",
    "open_file",
    "record",
    "ResolvedCache",
    "Tier",
    "TieredCache",
    "write_json",
]
