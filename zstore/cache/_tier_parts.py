"""What the parts of :class:`zstore.cache.tier.Tier` (:mod:`zstore.cache._tier_reads`,
:mod:`zstore.cache._tier_writes`) use of the tier, which ``Tier`` defines."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import diskcache

    from zstore.cache._evictions import EvictionLog
    from zstore.cache._own import OwnWrites
    from zstore.cache._space import Room
    from zstore.cache._stats import Stats


class TierPart:
    """A part of :class:`zstore.cache.tier.Tier`; declares the tier's state it uses."""

    if TYPE_CHECKING:
        name: str
        directory: str
        stats: Stats
        sketch: Any
        room: Room
        evictions: EvictionLog
        own: OwnWrites | None

        def _open(self) -> diskcache.Cache | None: ...
        def _warn(self, what: str, exc: BaseException | str) -> None: ...
