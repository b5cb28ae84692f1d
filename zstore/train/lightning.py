"""``zstore.lightning.WindowDataModule``: a LightningDataModule over zstore windows.

Importable without Lightning; using it needs ``pip install zstore[lightning]``.

    dm = WindowDataModule("/data/train.zarr", val="/data/dev.zarr", batch_size=16)
    trainer = lightning.Trainer(devices=4, strategy="ddp", use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm)

Pass ``use_distributed_sampler=False``: the module brings its own sampler, a
:class:`zstore.NodeSampler` whose indices carry the epoch. The sampler takes the epoch
from the trainer when each epoch's iteration starts, so the shuffle and the window
draw move every epoch, also with persistent workers, and a run resumed from a
checkpoint draws the windows of the epoch it resumes into (Lightning starts the
DataLoader's iterator before its ``set_epoch`` then).  Each node's tiers keep the node's
share of the data.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from zstore.cache import CacheConfig
from zstore.errors import ConfigError
from zstore.train._loader import WindowLoader
from zstore.train.dataset import WindowDataset
from zstore.train.samplers import NodeSampler

try:
    from lightning.pytorch import LightningDataModule as _Base

    _LIGHTNING = True
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from pytorch_lightning import (  # type: ignore[assignment]
            LightningDataModule as _Base,
        )

        _LIGHTNING = True
    except ImportError:
        _Base = object  # type: ignore[assignment,misc]
        _LIGHTNING = False


class WindowDataModule(_Base):
    """Training (and optional validation) windows of zstore stores.

    Args:
        train: the training store (path or fsspec URL).
        val: a validation store; without one the module has no validation loader.
        window_seconds, seed, windows_per_item, cache: as for :class:`WindowDataset`.
        batch_size: windows per batch.
        loader: ``"zstore"`` (:class:`WindowLoader`, batches read in-process) or
            ``"torch"`` (a DataLoader with ``num_workers`` persistent workers).
        local_world_size: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``).
        **dataset_kwargs: more :class:`WindowDataset` arguments (``fields=``, ...).
    """

    def __init__(
        self,
        train: str,
        val: str | None = None,
        *,
        window_seconds: float = 10.0,
        batch_size: int = 16,
        seed: int = 0,
        windows_per_item: int = 1,
        cache: CacheConfig | None = None,
        loader: str = "zstore",
        num_workers: int = 2,
        local_world_size: int | None = None,
        **dataset_kwargs: Any,
    ):
        if not _LIGHTNING:
            raise ImportError(
                "zstore.lightning.WindowDataModule needs Lightning: "
                "pip install 'zstore[lightning]' (or lightning)"
            )
        if loader not in ("zstore", "torch"):
            raise ConfigError(f"loader must be 'zstore' or 'torch', got {loader!r}")
        super().__init__()
        self.train_url, self.val_url = train, val
        self.kwargs = dict(
            window_seconds=window_seconds,
            seed=seed,
            cache=cache,
            windows_per_item=windows_per_item,
            **dataset_kwargs,
        )
        self.batch_size, self.seed, self.loader = batch_size, seed, loader
        self.num_workers, self.local_world_size = num_workers, local_world_size
        self.train_set: WindowDataset | None = None
        self.val_set: WindowDataset | None = None
        if val is None:  # no validation loader at all, rather than an empty one
            self.val_dataloader = None  # type: ignore[method-assign,assignment]

    def setup(self, stage: str | None = None) -> None:
        self.train_set = WindowDataset(self.train_url, **self.kwargs)
        if self.val_url is not None:
            self.val_set = WindowDataset(self.val_url, **self.kwargs)

    def _loader(self, ds: WindowDataset, sampler: Any, drop_last: bool) -> Any:
        if self.loader == "zstore":
            made: Any = WindowLoader(ds, self.batch_size, sampler=sampler, drop_last=drop_last)
        else:
            made = DataLoader(
                ds,
                batch_size=self.batch_size,
                sampler=sampler,
                num_workers=self.num_workers,
                drop_last=drop_last,
                persistent_workers=self.num_workers > 0,
            )
        if len(made) == 0:
            raise ConfigError(
                f"{ds.url}: an epoch would have no batch: {len(sampler)} windows per rank "
                f"with batch_size {self.batch_size} and drop_last={drop_last}; use a smaller "
                "batch size, fewer ranks or windows_per_item > 1"
            )
        return made

    def train_dataloader(self) -> Any:
        if self.train_set is None:
            self.setup("fit")
        sampler = NodeSampler(
            self.train_set,
            shuffle=True,
            seed=self.seed,
            local_world_size=self.local_world_size,
            drop_last=True,
        )
        sampler.epoch_source = self._trainer_epoch  # right on resume, whatever the order
        assert self.train_set is not None
        return self._loader(self.train_set, sampler, drop_last=True)

    def _trainer_epoch(self) -> int | None:
        """The epoch the trainer is about to train: the count of epochs it has processed,
        as Lightning's own ``set_epoch`` uses (``current_epoch`` still says the epoch
        before while a run resumed from an end-of-epoch checkpoint starts its loader)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return None
        try:
            return int(trainer.fit_loop.epoch_progress.current.processed)
        except AttributeError:  # another Lightning version
            return int(trainer.current_epoch)

    def val_dataloader(self) -> Any:
        if self.val_set is None:
            self.setup("validate")
        assert self.val_set is not None
        sampler = NodeSampler(
            self.val_set, shuffle=False, seed=self.seed, local_world_size=self.local_world_size
        )
        return self._loader(self.val_set, sampler, drop_last=False)


__all__ = ["WindowDataModule"]
