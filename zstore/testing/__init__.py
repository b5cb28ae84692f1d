"""Helpers for tests and benchmarks: a file system with modelled latency, bandwidth and
failures (S3- and NFS-like origins), synthetic speech corpora in HDF5, and ranks run as
spawned processes.

May import: h5py, numpy, fsspec.  Nothing in the library imports it.
"""

from zstore.testing._modelled import ModelledFileSystem
from zstore.testing._ranks import spawn_ranks
from zstore.testing.synthetic import ACT_RATE, WAV_RATE, SyntheticSpec, make_synthetic

__all__ = [
    "ACT_RATE",
    "ModelledFileSystem",
    "SyntheticSpec",
    "WAV_RATE",
    "make_synthetic",
    "spawn_ranks",
]
