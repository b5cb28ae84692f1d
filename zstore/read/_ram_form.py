"""What every form of the RAM tier's values shares (:mod:`zstore.read._ram_shards`'s
whole shards, :mod:`zstore.read._chunk_shards`'s shards filled by the reads): the
reader's parts it works with, and the tier keys of its shards."""

from __future__ import annotations

from zstore.cache import TieredCache
from zstore.format import ArrayLayout
from zstore.read._builds import BehindBuilds
from zstore.read._chunks import ChunkSource
from zstore.read._maps import MappedValues

MAX_KEYS = 1 << 16  # shard keys a form remembers (a dict of short strings)


def form_key(
    tiers: TieredCache, layout: ArrayLayout, s: int, suffix: str, decoded: bool = True
) -> str:
    """The tier key of shard ``s`` of ``layout`` in the RAM form whose keys end with
    ``suffix``; a form of decoded values says their dtype (``ArrayLayout.decoded_tag``)."""
    return tiers.key(f"{layout.object_key(s)}{suffix}{layout.decoded_tag if decoded else ''}")


class RamForm:
    """A form of the RAM tier's values: the store's url, the tiers, the reader's chunk
    source, its maps of the tier's values and its queue of work behind the reads."""

    #: what the form's tier keys end with
    suffix = ""
    #: the form holds decoded values: its keys say their dtype (``ArrayLayout.decoded_tag``)
    decoded = False
    #: ``zstore cache warm``: fill the tier in the read itself, waiting for what it
    #: needs, instead of behind the reads
    inline = False

    def __init__(
        self,
        url: str,
        tiers: TieredCache,
        source: ChunkSource,
        values: MappedValues,
        behind: BehindBuilds,
    ):
        self.url, self.tiers, self.source, self.values = url, tiers, source, values
        self.ram = values.tier
        self.behind = behind  # the reader's fills queue (zstore.read._builds)
        self.chunk_bytes = 0  # decoded bytes of chunks read since the heap was last trimmed
        # tier keys by (array path, shard): a batch of short windows looks up ~50 shards
        self._keys: dict[tuple[str, int], str] = {}

    def key(self, layout: ArrayLayout, s: int) -> str:
        """The tier key of shard ``s`` of ``layout`` in this form."""
        key = self._keys.get((layout.path, s))
        if key is None:
            if len(self._keys) >= MAX_KEYS:
                self._keys.clear()
            key = self._keys[(layout.path, s)] = form_key(
                self.tiers, layout, s, self.suffix, self.decoded
            )
        return key
