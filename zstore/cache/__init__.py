"""Node-shared cache tiers: one module per tier engine, plus their composition."""
from zstore.cache.tier import Tier
from zstore.cache.tiers import TieredCache, cache_stats, clear_cache, mark_stats

__all__ = ["Tier", "TieredCache", "cache_stats", "clear_cache", "mark_stats"]
