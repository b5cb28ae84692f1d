"""HDF5 compression filters of the source: those h5py lacks, said as such.

Files written with PyTables or hdf5plugin often compress their datasets with filters
h5py does not build in (Blosc, Zstd, LZ4, Bitshuffle, ...).  Reading one without its
filter failed as "can't open directory ... plugin", which the converter reported as a
truncated or corrupt file ("re-copy it").  The converter now loads ``hdf5plugin`` when
it is installed (~12 ms, once per process), and a read that fails on a filter neither
provides names the filter and what to install.
"""

from __future__ import annotations

from typing import Any

import h5py

from zstore.errors import SourceError

#: whether hdf5plugin's filters are registered in this process (None: not tried yet)
_LOADED: bool | None = None


def load_filters() -> bool:
    """Register hdf5plugin's filters with HDF5 when hdf5plugin is installed (tried once);
    whether they are."""
    global _LOADED
    if _LOADED is None:
        try:
            import hdf5plugin  # noqa: F401  (registers its filters on import)

            _LOADED = True
        except ImportError:
            _LOADED = False
    return _LOADED


def missing_filters(f: Any, path: str) -> list[str]:
    """The filters of dataset ``path`` in the open file ``f`` that HDF5 cannot apply
    here, as "name (id N)"; [] when it has none (or is no dataset)."""
    try:
        plist = f[path].id.get_create_plist()
        out = []
        for i in range(plist.get_nfilters()):
            code, _, _, name = plist.get_filter(i)
            if not h5py.h5z.filter_avail(code):
                label = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
                out.append(f"{label or 'unnamed'} (id {code})")
        return out
    except (KeyError, OSError, RuntimeError, AttributeError, TypeError, ValueError):
        return []


def read_failure(source: str, f: Any, path: str, error: BaseException) -> SourceError:
    """The error for a failed read of dataset ``path``: a filter this process lacks,
    when that is why; else a truncated or corrupt file."""
    lacking = missing_filters(f, path)
    if lacking:
        what = (
            "which neither h5py nor hdf5plugin provides here: install the filter's HDF5 "
            "plugin and set HDF5_PLUGIN_PATH to its directory"
            if load_filters()
            else "which h5py lacks: pip install hdf5plugin (zstore loads it when installed)"
        )
        return SourceError(
            f"{source}: '{path}' is compressed with the HDF5 filter {', '.join(lacking)}, "
            f"{what}; then convert again"
        )
    return SourceError(
        f"{source}: reading '{path}' failed ({error}); the file may be truncated or "
        "corrupt: re-copy it"
    )
