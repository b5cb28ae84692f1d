"""``collate_pad``: batch whole items (``window_seconds=None``) of different lengths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def collate_pad(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack items of different lengths, zero-padding each tensor field along its last
    axis to the batch's longest, with the true lengths in ``"<field>_length"``.

    Use it as a DataLoader's ``collate_fn`` for whole items (``window_seconds=None``),
    whose arrays differ in length; fixed-size windows batch with the default collate
    or :class:`zstore.WindowLoader`.  Tensors with a time axis other than the last are
    not supported: transpose them in a ``transform``.

    >>> import torch
    >>> b = collate_pad([{"x": torch.ones(2, 3), "item": "a"}, {"x": torch.ones(2, 5), "item": "b"}])
    >>> b["x"].shape, b["x_length"].tolist(), b["item"]
    (torch.Size([2, 2, 5]), [3, 5], ['a', 'b'])
    """
    if not items:
        raise ValueError("collate_pad needs at least one item")
    out: dict[str, Any] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
            longest = max(v.shape[-1] for v in values)
            shape = (len(values), *values[0].shape[:-1], longest)
            batch = values[0].new_zeros(shape)
            for b, v in enumerate(values):
                if v.shape[:-1] != values[0].shape[:-1]:
                    raise ValueError(
                        f"collate_pad: field {key!r} of item {b} has shape "
                        f"{tuple(v.shape)}, the first has {tuple(values[0].shape)}"
                        "; only the last (time) axis may differ"
                    )
                batch[b, ..., : v.shape[-1]] = v
            out[key] = batch
            out[f"{key}_length"] = torch.tensor([v.shape[-1] for v in values])
        elif isinstance(values[0], (int, float, torch.Tensor)):
            out[key] = torch.tensor([float(v) if isinstance(v, float) else v for v in values])
        else:
            out[key] = list(values)
    return out
