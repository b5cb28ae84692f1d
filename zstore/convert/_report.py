"""What a conversion or an append did: :class:`ConvertReport`, and its summary."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from zstore.convert._copies import copies_text
from zstore.convert._source import SourceItem
from zstore.format import ArrayInfo
from zstore.units import format_size


@dataclass
class ConvertReport:
    """What :func:`convert` did."""

    items: int
    converted: int
    already_done: int
    source_bytes: int
    store_bytes: int
    seconds: float
    arrays: dict[str, ArrayInfo]
    skipped: list[str] = field(default_factory=list)
    verified: bool = False
    store_id: str = ""
    sources: list[str] = field(default_factory=list)
    #: sources left out of an append: in the store already, unchanged
    already_in_store: list[str] = field(default_factory=list)
    #: per float array written, what its values are and how they were stored
    values: dict[str, str] = field(default_factory=dict)
    #: items stored packed (spans of shared arrays; see ``pack_seconds``)
    packed: int = 0
    #: an append's: the bytes it added to the store (None: a conversion, or not known)
    added_bytes: int | None = None
    #: (item, the earlier item whose values it holds) for each item written now that
    #: copies another (zstore.convert._copies); stored all the same
    copies: list[tuple[str, str]] = field(default_factory=list)
    #: string datasets kept as attributes of their items (a transcript): name -> items
    texts: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Stored bytes per source byte: of the whole store, or of what an append added."""
        stored = self.store_bytes if self.added_bytes is None else self.added_bytes
        return stored / self.source_bytes if self.source_bytes else 0.0

    def __str__(self) -> str:
        lines = [
            f"sources: {len(self.sources)} file(s)"
            + (
                f" ({', '.join(self.sources[:3])}{', ...' if len(self.sources) > 3 else ''})"
                if self.sources
                else ""
            ),
            f"items: {self.items} ({self.converted} converted, {self.already_done} already done)"
            + (f"; {self.packed} packed into shared arrays" if self.packed else ""),
            f"source: {format_size(self.source_bytes)}, store: {format_size(self.store_bytes)}"
            + (
                ""  # nothing read: an append of files the store holds already
                if not self.source_bytes
                else f" ({self.ratio:.2f}x)"
                if self.added_bytes is None
                else f", {format_size(self.added_bytes)} of it added ({self.ratio:.2f}x)"
            )
            + f", {self.seconds:.1f} s",
        ]
        for name, a in self.arrays.items():
            if a.rate:
                how = f"time array at {a.rate:g}/s" + (
                    f" (inferred): {a.note}"
                    if a.inferred and a.note
                    else " (inferred)"
                    if a.inferred
                    else ""
                )
            else:
                how = a.note or "stored whole (no time axis)"
            lines.append(f"  {name}: {how}")
            if name in self.values:
                lines.append(f"    {self.values[name]}")
        if self.texts:
            names = ", ".join(sorted(self.texts))
            most = max(self.texts.values())
            lines.append(
                f"  {names}: strings, kept as attributes of their items ({most} item(s); "
                "ds.item_attrs)"
            )
        lines += [f"  skipped {s}" for s in self.skipped]
        lines += [
            f"already in the store, nothing added from it: {s}" for s in self.already_in_store
        ]
        if self.copies:
            lines.append(copies_text(self.copies))
        if self.verified:
            rounded = [n for n, a in self.arrays.items() if a.precision is not None]
            lines.append(
                "verified: every array equals the source"
                + (f" ({', '.join(rounded)}: within the stated rounding)" if rounded else "")
            )
        return "\n".join(lines)


def text_counts(items: Sequence[SourceItem]) -> dict[str, int]:
    """Per string dataset name kept as an item attribute, how many of ``items`` have it."""
    return dict(Counter(name for it in items for name in it.texts))
