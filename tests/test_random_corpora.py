"""A few seeds of tools/random_corpora.py: random HDF5 corpora (layouts, dtypes, byte
orders, HDF5 filters, never-written regions, short and long recordings) converted with
random chunking and packing, read with random cache settings through every read path
(one process, a modelled remote origin, several processes at once through one node
cache), converted in parts with appends, converted or appended with a kill -9 at a
random moment and run again (on a local S3 endpoint too, where the killed run's lock
must be named at once), read after a reader was killed mid-write into the
tiers, and files with odd HDF5 features (arrays in some groups, links, dimension
scales, compound tables, virtual and external datasets, NaN attributes) converted,
appended to and read back from a local S3 endpoint, and a store overwritten again
and again under a running job (which must never get the new store's values, and be
told the store was replaced), and copies of a store appended to apart, read through one
node cache: every value equals h5py's.  Runs of
hundreds of seeds are the tool's job; these keep its paths working and catch what a
change breaks on data shaped unlike the synthetic corpus."""

from __future__ import annotations

import subprocess

import pytest
from conftest import PYTHON, REPO, subprocess_env


@pytest.mark.parametrize(
    "args",
    [
        ["reads", "--seeds", "0:12"],
        ["reads", "--seeds", "100:110", "--remote"],
        ["appends", "--seeds", "0:6"],
        ["ranks", "--seeds", "0:2", "--remote"],
        ["kills", "--seeds", "61:65"],
        ["kills", "--seeds", "2:5", "--s3"],
        ["reader-kills", "--seeds", "0:4"],
        ["odd", "--seeds", "0:6", "--s3"],
        ["overwrites", "--seeds", "0:3"],
        ["copies", "--seeds", "0:4", "--s3"],
    ],
    ids=[
        "reads",
        "remote",
        "appends",
        "ranks",
        "kills",
        "kills_s3",
        "reader_kills",
        "odd",
        "overwrites",
        "copies",
    ],
)
def test_random_corpora_read_back_as_h5py_reads_them(args, tmp_path):
    out = subprocess.run(
        [PYTHON, str(REPO / "tools" / "random_corpora.py"), *args, "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(),
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    first, stop = (int(x) for x in args[2].split(":"))
    assert f"{stop - first} of {stop - first} seeds passed" in out.stdout
