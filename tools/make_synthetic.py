"""Write synthetic speech-like HDF5 data in the users' layout.

    python tools/make_synthetic.py out.h5 --items 64            # by count
    python tools/make_synthetic.py out.h5 --size 2GB            # by size

Each group holds ``wav`` (mics, samples) float32 from 16-bit PCM at 16 kHz
(band-limited noise under a speech-like envelope) and ``act`` (speakers, frames)
0/1 float32 at 100 frames/s, lengths varying between items.  ``--audio float`` makes
reverberant mixtures kept in float32 instead (true float values, as processed audio).
"""

from __future__ import annotations

import argparse

from zstore.testing.synthetic import SyntheticSpec, items_for_size, make_synthetic
from zstore.units import format_size, parse_size


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("path")
    p.add_argument("--items", type=int, help="number of groups")
    p.add_argument("--size", help="approximate file size instead, e.g. 2GB")
    p.add_argument("--mics", type=int, default=8)
    p.add_argument("--speakers", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=15.0)
    p.add_argument("--max-seconds", type=float, default=45.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--audio",
        choices=["int16", "float"],
        default="int16",
        help="int16: float32 holding 16-bit PCM values (default); float: reverberant "
        "mixtures kept in float32 (true float values, as processed audio)",
    )
    args = p.parse_args()
    spec = SyntheticSpec(
        items=1,
        mics=args.mics,
        speakers=args.speakers,
        min_seconds=args.min_seconds,
        max_seconds=args.max_seconds,
        seed=args.seed,
        audio=args.audio,
    )
    items = args.items or (items_for_size(parse_size(args.size), spec) if args.size else 8)
    spec = SyntheticSpec(
        items=items,
        mics=args.mics,
        speakers=args.speakers,
        min_seconds=args.min_seconds,
        max_seconds=args.max_seconds,
        seed=args.seed,
        audio=args.audio,
    )
    size = make_synthetic(args.path, spec, progress=True)
    print(f"wrote {args.path}: {items} items, {format_size(size)}")


if __name__ == "__main__":
    main()
