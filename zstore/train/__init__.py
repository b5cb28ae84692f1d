"""The training API: datasets, window draws, samplers, the batch loader, Lightning.

Holds :class:`WindowDataset` (item ``i`` -> a window drawn from ``(seed, epoch, i)``),
the window draw itself, :class:`WindowSampler` and :class:`NodeSampler`,
:class:`WindowLoader`, ``collate_pad`` and the Lightning data module.

May import: :mod:`zstore.read`, :mod:`zstore.cache` (options, node directories),
:mod:`zstore.format`, the shared leaves, and torch.  Never :mod:`zstore.convert` or
:mod:`zstore.cli`.
"""

from zstore.train.collate import collate_pad
from zstore.train.dataset import WindowDataset
from zstore.train.loader import LoaderError, WindowLoader
from zstore.train.samplers import NodeSampler, WindowSampler

__all__ = [
    "LoaderError",
    "NodeSampler",
    "WindowDataset",
    "WindowLoader",
    "WindowSampler",
    "collate_pad",
]
