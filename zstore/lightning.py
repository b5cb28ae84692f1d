"""``zstore.lightning``: kept as an import path; the code is in
:mod:`zstore.train.lightning`."""

from zstore.train.lightning import WindowDataModule

__all__ = ["WindowDataModule"]
