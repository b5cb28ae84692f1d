"""``zstore.synthetic``: kept as an import path; the code is in
:mod:`zstore.testing.synthetic`."""

from zstore.testing.synthetic import (
    ACT_RATE,
    HOP,
    WAV_RATE,
    SyntheticSpec,
    items_for_size,
    make_item,
    make_synthetic,
)

__all__ = [
    "ACT_RATE",
    "HOP",
    "WAV_RATE",
    "SyntheticSpec",
    "items_for_size",
    "make_item",
    "make_synthetic",
]
