"""A LightningDataModule over zstore windows.

Lightning is optional: ``pip install zstore[lightning]``.  Without it this module
still works as a plain class with the same ``*_dataloader`` methods.

    dm = ZstoreDataModule("/data/speech.zarr", batch_size=16, num_workers=8)
    trainer = lightning.Trainer(devices=4, strategy="ddp", use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm)

With ``loader="zstore"`` (the default) batches come from a :class:`zstore.WindowLoader`
that shards by rank itself (pass ``use_distributed_sampler=False``); with
``loader="torch"`` Lightning adds its ``DistributedSampler`` to a DataLoader.  Either
way the window draw follows the trainer's epoch through :meth:`set_epoch`: call it from
``LightningModule.on_train_epoch_start``.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

import zstore

try:
    import lightning.pytorch as pl

    _Base: Any = pl.LightningDataModule
except ImportError:  # pragma: no cover - exercised where lightning is installed
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]

        _Base = pl.LightningDataModule
    except ImportError:
        _Base = object


class ZstoreDataModule(_Base):
    """Train/validation windows from one or two zstore stores."""

    def __init__(
        self,
        train: str,
        val: str | None = None,
        *,
        window_seconds: float = 10.0,
        batch_size: int = 16,
        num_workers: int = 4,
        seed: int = 0,
        cache: zstore.CacheConfig | None = None,
        loader: str = "zstore",
        **dataset_kwargs: Any,
    ):
        super().__init__()
        self.train_url, self.val_url = train, val
        self.window_seconds, self.seed, self.cache = window_seconds, seed, cache
        self.batch_size, self.num_workers = batch_size, num_workers
        self.dataset_kwargs = dataset_kwargs
        self.loader = loader  # "zstore": WindowLoader (in-process); "torch": DataLoader
        self._train_loader: zstore.WindowLoader | None = None
        self.train_set: zstore.WindowDataset | None = None
        self.val_set: zstore.WindowDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        make = lambda url: zstore.WindowDataset(  # noqa: E731
            url,
            window_seconds=self.window_seconds,
            seed=self.seed,
            cache=self.cache,
            **self.dataset_kwargs,
        )
        self.train_set = make(self.train_url)
        self.val_set = make(self.val_url) if self.val_url else None

    def set_epoch(self, epoch: int) -> None:
        """Call from ``LightningModule.on_train_epoch_start``: ``dm.set_epoch(self.current_epoch)``."""
        if self.train_set is not None:
            self.train_set.set_epoch(epoch)
        if self._train_loader is not None:  # its sampler's shuffle
            self._train_loader.set_epoch(epoch)

    def train_dataloader(self) -> DataLoader | zstore.WindowLoader:
        assert self.train_set is not None, "call setup() first"
        if self.loader == "zstore":  # the trainer's DistributedSampler is not applied to it:
            import torch.distributed as dist  # shard by rank here

            sampler: Any = None
            if dist.is_available() and dist.is_initialized():
                from torch.utils.data.distributed import DistributedSampler

                sampler = DistributedSampler(
                    self.train_set, shuffle=True, seed=self.seed, drop_last=True
                )
            self._train_loader = zstore.WindowLoader(
                self.train_set,
                self.batch_size,
                sampler=sampler,
                shuffle=sampler is None,
                drop_last=True,
                seed=self.seed,
            )
            return self._train_loader
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
