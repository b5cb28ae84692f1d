"""The training API: datasets, window draws, samplers, the batch loader, Lightning.

Holds :class:`WindowDataset` (item ``i`` -> a window drawn from ``(seed, epoch, i)``),
the window draw itself, :class:`WindowSampler` and :class:`NodeSampler`,
:class:`WindowLoader`, ``collate_pad`` and the Lightning data module.

May import: :mod:`zstore.read`, :mod:`zstore.cache` (options, node directories),
:mod:`zstore.format`, the shared leaves, and torch.  Never :mod:`zstore.convert` or
:mod:`zstore.cli`.

The Lightning data module is not imported here (importing Lightning takes seconds):
``from zstore.train.lightning import WindowDataModule`` (or ``zstore.lightning``).
"""

from zstore.train._collate import collate_pad
from zstore.train._dataset_setup import common_lengths
from zstore.train._loader import LoaderError, WindowLoader
from zstore.train.dataset import WindowDataset
from zstore.train.samplers import NodeSampler, WindowSampler, assign_nodes

__all__ = [
    "assign_nodes",
    "collate_pad",
    "common_lengths",
    "LoaderError",
    "NodeSampler",
    "WindowDataset",
    "WindowLoader",
    "WindowSampler",
]
