"""The ``zstore`` command: convert | info | upgrade | tidy | cache stats | cache clear |
cache warm | demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from zstore.cache import CacheConfig
from zstore.errors import ZstoreError
from zstore.units import format_size

#: Stores whose RAM format ``zstore cache stats`` prints (the latest opened first).
SHOWN_FORMATS = 10
#: what ``zstore cache stats`` says each RAM format holds
FORMAT_WORDS = {
    "chunks": "decoded data, filled by the reads",
    "decoded": "decoded data",
    "encoded": "encoded data",
}


def _pairs(
    values: list[str] | None,
    what: str,
    convert: Any = str,
    example: str = "wav=16000",
    expected: str = "a number",
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in values or []:
        name, sep, value = v.partition("=")
        if not sep or not name:
            raise ZstoreError(f"{what} {v!r}: write NAME=VALUE, e.g. {what} {example}")
        try:
            out[name] = convert(value)
        except ValueError:
            raise ZstoreError(f"{what} {v!r}: {value!r} is not {expected}") from None
    return out


def _rate(text: str) -> float | None:
    """A ``--rate`` value: samples per second (``16000``, ``86.1328125``, or a ratio such
    as ``22050/256`` for frames of a hop of 256 samples), or ``none`` (store the array
    whole)."""
    if text.strip().lower() in ("none", "static", "whole"):
        return None
    num, sep, den = text.partition("/")
    if not sep:
        return float(text)
    if float(den) == 0:
        raise ValueError(text)
    return float(num) / float(den)


def _rates(args: argparse.Namespace) -> dict[str, float | None]:
    """``--rate NAME=HZ|none`` and ``--static NAME`` (the same as ``--rate NAME=none``)."""
    out = _pairs(
        args.rate, "--rate", _rate, expected="a rate (write e.g. 16000, 86.13 or 22050/256)"
    )
    for name in args.static or []:
        if out.get(name) is not None:
            raise ZstoreError(
                f"--static {name} and --rate {name}={out[name]:g} contradict "
                "each other; give one of them"
            )
        out[name] = None
    return out


def _option_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _count(minimum: int) -> Any:
    """An argparse type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    return parse


def _time_axis(values: list[str] | None) -> int | dict[str, int]:
    """``--time-axis -1`` (every array) or ``--time-axis wav=0`` (repeat per array)."""
    if not values:
        return -1
    if len(values) == 1 and "=" not in values[0]:
        try:
            return int(values[0])
        except ValueError:
            raise ZstoreError(
                f"--time-axis {values[0]!r}: write a whole number, or "
                "NAME=AXIS (e.g. --time-axis wav=0)"
            ) from None
    return _pairs(values, "--time-axis", int)


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    opts = _pairs(args.storage_option, "--storage-option", _option_value)
    if args.endpoint_url:
        opts.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
    if args.anon:
        opts["anon"] = True
    return opts or None


def _cache_config(args: argparse.Namespace) -> CacheConfig:
    kwargs = {
        k: getattr(args, k)
        for k in ("ram_dir", "ram_bytes", "ssd_dir", "ssd_bytes", "shared_group")
        if getattr(args, k, None) is not None
    }
    return CacheConfig(**kwargs)


def cmd_convert(args: argparse.Namespace) -> int:
    from zstore.convert import convert
    from zstore.format import PACK_SECONDS

    if len(args.paths) < 2:
        raise ZstoreError(
            "zstore convert needs a source and a destination: zstore convert SRC... DST"
        )
    if args.append:
        from zstore.convert import append

        print(
            append(
                args.paths[:-1],
                args.paths[-1],
                workers=args.workers,
                dask=args.dask,
                storage_options=_storage_options(args),
                verify=args.verify,
                progress=not args.no_progress,
                rates=_rates(args) if args.rate or args.static else None,
                time_axis=_time_axis(args.time_axis) if args.time_axis else None,
                codec=args.codec,
                chunk_seconds=args.chunk_seconds,
                precision=_pairs(args.precision, "--precision", example="wav=100dB") or None,
                pack_seconds=args.pack_seconds,
                dataset_items=args.dataset_items,
                dtypes=_pairs(args.dtype, "--dtype", example="wav=float32") or None,
                include=args.include,
                exclude=args.exclude,
                subgroups=args.subgroups,
            )
        )
        return 0
    report = convert(
        args.paths[:-1],
        args.paths[-1],
        rates=_rates(args),
        time_axis=_time_axis(args.time_axis),
        chunk_seconds=1.0 if args.chunk_seconds is None else args.chunk_seconds,
        codec=args.codec or "lz4",
        workers=args.workers,
        dask=args.dask,
        storage_options=_storage_options(args),
        verify=args.verify,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        precision=_pairs(args.precision, "--precision", example="wav=100dB"),
        pack_seconds=PACK_SECONDS if args.pack_seconds is None else args.pack_seconds,
        dataset_items=args.dataset_items,
        dtypes=_pairs(args.dtype, "--dtype", example="wav=float32"),
        include=args.include,
        exclude=args.exclude,
        subgroups=args.subgroups or "items",
    )
    print(report)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from zstore.cli._info import store_info

    info = store_info(args.store, storage_options=_storage_options(args))
    print(json.dumps(info, indent=2) if args.json else info["text"])
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    from zstore.convert.upgrade import upgrade_store

    print(upgrade_store(args.store, _storage_options(args)))
    return 0


def cmd_tidy(args: argparse.Namespace) -> int:
    from zstore.convert import tidy
    from zstore.units import parse_duration

    report = tidy(
        args.store,
        older_than=parse_duration(args.older_than, name="--older-than"),
        dry_run=args.dry_run,
        storage_options=_storage_options(args),
    )
    print(report)
    for name in report.tables + report.partials:
        print(f"  {name}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from zstore.cache import cache_stats, clear_cache, mark_stats

    config = _cache_config(args)
    if args.cache_command == "clear":
        clear_cache(config)
        print("cache cleared")
        return 0
    if args.cache_command == "mark":
        mark_stats(config)
        print("marked: `zstore cache stats` now also counts from here")
        return 0
    if args.cache_command == "warm":
        from zstore.cli.warm import warm

        done = warm(
            args.store,
            fields=args.fields,
            cache=config,
            storage_options=_storage_options(args),
            workers=args.workers,
            progress=not args.no_progress,
            nodes=args.nodes,
            node_rank=args.node_rank,
            seed=args.seed,
        )
        print(f"warmed {done['items']} items, {format_size(done['bytes'])} decoded")
        return 0
    stats = cache_stats(config)
    if args.store:
        from zstore.cli.warm import share_residency

        stats["share"] = share_residency(
            args.store,
            cache=config,
            nodes=args.nodes or 1,
            node_rank=args.node_rank or 0,
            seed=args.seed,
            storage_options=_storage_options(args),
        )
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    periods = [
        (label, part)
        for label, part in (
            ("since cleared", stats),
            ("running now", stats["running"]),
            ("since the mark", stats["since_mark"]),
        )
        if part is not None
    ]
    for tier in ("ram", "ssd"):
        t = stats[tier]
        where = stats["config"][f"{tier}_dir"] or "disabled"
        if t.get("ownership"):
            where += (
                f" ({t['ownership']}"
                + (f"; REFUSED: {t['refused']}" if t.get("refused") else "")
                + ")"
            )
        print(
            f"{tier}: {where}\n  {format_size(t.get('bytes_on_disk', 0))} of "
            f"{format_size(t.get('budget', 0))} (budget of {t.get('budget_of', '?')})"
        )
        for label, part in periods:
            p = part[tier]
            print(
                f"  {label}: hits {p['hits']}  misses {p['misses']}  hit rate "
                f"{p['hit_rate']:.1%}  evictions {p['evictions']}  refused {p['rejected']}"
            )
    for label, part in periods:
        o = part["origin"]
        print(f"origin {label}: {o['requests']} requests, {format_size(o['bytes'])}")
    formats = list(stats.get("formats", {}).items())  # the latest first
    for store_id, choice in formats[:SHOWN_FORMATS]:
        what = FORMAT_WORDS.get(str(choice["format"]), f"{choice['format']} data")
        print(f"store {store_id}: RAM tier holds {what}: {choice['reason']}")
    if len(formats) > SHOWN_FORMATS:
        print(
            f"... and {len(formats) - SHOWN_FORMATS} stores opened earlier "
            "(`zstore cache stats --json` lists them all; `zstore cache clear` forgets them)"
        )
    share = stats.get("share")
    if share:
        print(
            f"node {share['node']} of {share['nodes']}: {share['resident_in_ram']} of "
            f"{share['shards']} shards of its share ({share['items']} items) are in the "
            f"RAM tier ({share['fraction']:.0%})"
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from zstore.cli._demo import run_demo

    run_demo(args.dir, items=args.items, epochs=args.epochs, windows_per_item=args.windows_per_item)
    return 0


def _remote_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option (value parsed as JSON when it can be)",
    )
    p.add_argument("--endpoint-url", help="S3 endpoint (e.g. a MinIO or test server)")
    p.add_argument("--anon", action="store_true", help="anonymous S3 access")


def _cache_dirs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ram-dir", help="RAM tier directory (default $ZSTORE_RAM_DIR, else /dev/shm/zstore-<uid>)"
    )
    p.add_argument(
        "--ssd-dir", help="SSD tier directory (default $ZSTORE_SSD_DIR, else ~/.cache/zstore)"
    )
    p.add_argument(
        "--shared-group",
        help="group that shares the tiers (default "
        "$ZSTORE_SHARED_GROUP, else none: the tiers are private to you)",
    )


def _cache_options(p: argparse.ArgumentParser) -> None:
    _cache_dirs(p)
    p.add_argument(
        "--ram-bytes",
        help="RAM tier budget, e.g. 64GB (default "
        "$ZSTORE_RAM_BYTES, else half the free tmpfs, at most a quarter of RAM)",
    )
    p.add_argument(
        "--ssd-bytes",
        help="SSD tier budget, e.g. 500GB (default "
        "$ZSTORE_SSD_BYTES, else half the disk's free space)",
    )


def build_parser() -> argparse.ArgumentParser:
    from zstore import __version__
    from zstore.format import PACK_SECONDS

    parser = argparse.ArgumentParser(
        prog="zstore",
        description="Random-window training data: convert HDF5 to a "
        "time-chunked Zarr v3 store, inspect it, and manage the node's cache tiers.",
    )
    parser.add_argument("--version", action="version", version=f"zstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="rechunk HDF5 groups into a zstore (Zarr v3) store")
    p.add_argument(
        "paths",
        nargs="+",
        metavar="SRC... DST",
        help="HDF5 files, directories (every *.h5/*.hdf5 below), glob patterns or "
        "fsspec URLs; then the destination path or URL (s3://bucket/x.zarr)",
    )
    p.add_argument(
        "--rate",
        action="append",
        metavar="NAME=HZ",
        help="samples per second of an array, e.g. --rate wav=16000 (repeat), "
        "--rate mel=22050/256 for frames of a 256-sample hop; "
        "NAME=none stores it whole. Other arrays get a rate only from a "
        "whole-number length ratio to a given one in items of different "
        "lengths",
    )
    p.add_argument(
        "--static",
        action="append",
        metavar="NAME",
        help="store this array whole, with no time axis (repeat); the same as --rate NAME=none",
    )
    p.add_argument(
        "--time-axis",
        action="append",
        metavar="AXIS|NAME=AXIS",
        help="time axis of every array (default -1: last), or of one array, "
        "e.g. --time-axis wav=0 for audio stored (samples, mics); repeat",
    )
    p.add_argument("--chunk-seconds", type=float, default=None, help="chunk duration (1.0)")
    p.add_argument(
        "--codec",
        default=None,
        choices=["lz4", "zstd", "none"],
        help="compression (default lz4: Blosc lz4 + bitshuffle; crc32c always)",
    )
    p.add_argument(
        "--precision",
        action="append",
        metavar="NAME=DB|BITS",
        help="keep a float array to a stated precision, e.g. --precision wav=100dB (the "
        "fewest mantissa bits that guarantee 100 dB SNR) or wav=16bits (repeat); values "
        "are rounded to nearest before the codec, so processed (true float) audio "
        "compresses and the store stays plain Zarr. Default: lossless",
    )
    p.add_argument(
        "--pack-seconds",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"pack items whose every array is a time array of at most this many seconds "
        f"into shared arrays (default {PACK_SECONDS:g}; 0: every item keeps its own group): "
        "a few objects per hundred short items instead of five per item",
    )
    p.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="convert only the items (group paths) matching this shell-style pattern, "
        "e.g. 'spk*/utt*' (repeat)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out the items (group paths) matching this pattern, e.g. 'meta' (repeat)",
    )
    p.add_argument(
        "--dtype",
        action="append",
        default=[],
        metavar="NAME=DTYPE",
        help="store a float array as another float dtype, e.g. --dtype wav=float32 for "
        "float64 audio, or for groups of float32 and float64 alike (repeat)",
    )
    p.add_argument(
        "--dataset-items",
        default=None,
        metavar="NAME",
        help="for a file of one dataset per recording (/utt0, /audio/utt1, ...) rather "
        "than one group: every numeric dataset is an item, named by its path, holding "
        "one array NAME (e.g. wav)",
    )
    p.add_argument(
        "--subgroups",
        choices=["items", "arrays"],
        default=None,
        help="a group holding datasets inside another such group (/utt0/audio beside "
        "/utt0/feats/mfcc): 'items' (default) makes it an item of its own; 'arrays' "
        "makes its datasets arrays of the outer item, named feats.mfcc",
    )
    p.add_argument("--workers", type=int, default=None, help="parallel processes (CPU count)")
    p.add_argument(
        "--dask",
        metavar="ADDRESS",
        default=None,
        help="run each item as a task on the Dask cluster at this scheduler "
        "address (workers need the sources and DST at the same paths/URLs; "
        "start them with --nthreads 1)",
    )
    p.add_argument("--verify", action="store_true", help="re-read and compare every array")
    p.add_argument("--overwrite", action="store_true", help="replace what DST holds")
    p.add_argument(
        "--append",
        action="store_true",
        help="add the sources' items to the finished store DST, with its codec, "
        "chunking, rates and precision (--rate, --time-axis, --codec, --chunk-seconds, "
        "--precision may only repeat the store's own); a rerun adds nothing twice",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _remote_options(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("info", help="summarize a store's manifest")
    p.add_argument("store", help="store path or fsspec URL")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    _remote_options(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "upgrade",
        help="rewrite an older store's manifest in the current format (metadata only: "
        "format 1 to 2; a root holding the store's history gets it moved beside the "
        "item table)",
    )
    p.add_argument("store", help="store path or fsspec URL")
    _remote_options(p)
    p.set_defaults(func=cmd_upgrade)

    p = sub.add_parser(
        "tidy",
        help="remove the item tables appends replaced (older than --older-than) and "
        "the temporary files of killed writes from a finished store",
    )
    p.add_argument("store", help="store path or fsspec URL")
    p.add_argument(
        "--older-than",
        default="7d",
        metavar="AGE",
        help="remove item tables replaced longer ago than this (7d): a job that "
        "opened the store before an append reads its old table in every DataLoader "
        "worker it starts, so give the longest a job may run",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    _remote_options(p)
    p.set_defaults(func=cmd_tidy)

    p = sub.add_parser("cache", help="inspect, clear or warm the node's cache tiers")
    csub = p.add_subparsers(dest="cache_command", required=True)
    s = csub.add_parser("stats", help="hits, misses, evictions, bytes per tier (all processes)")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.add_argument(
        "--store",
        help="also say how much of this store's share (with --nodes, "
        "--node-rank: one node's, as NodeSampler assigns) the RAM tier holds",
    )
    s.add_argument("--nodes", type=_count(1), help="nodes the store is shared over")
    s.add_argument("--node-rank", type=_count(0), help="this node's rank, with --nodes")
    s.add_argument("--seed", type=int, default=0, help="NodeSampler's seed (0)")
    _cache_options(s)
    _remote_options(s)
    s = csub.add_parser("clear", help="empty the tiers")
    _cache_dirs(s)
    s = csub.add_parser("mark", help="start counting from now (stats then shows both)")
    _cache_dirs(s)
    s = csub.add_parser("warm", help="fill the tiers from the origin before training")
    s.add_argument("store", help="store path or fsspec URL")
    s.add_argument("--fields", nargs="+", help="arrays to warm (default: all time arrays)")
    s.add_argument("--workers", type=_count(1), default=4, help="parallel readers (4)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument(
        "--nodes",
        type=_count(1),
        help="warm one node's share only: the number of nodes (as NodeSampler assigns items)",
    )
    s.add_argument("--node-rank", type=_count(0), help="this node's rank, with --nodes")
    s.add_argument("--seed", type=int, default=0, help="NodeSampler's seed (0)")
    _cache_options(s)
    _remote_options(s)
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("demo", help="generate, convert and read a small data set")
    p.add_argument("--dir", default="zstore-demo", help="working directory (./zstore-demo)")
    p.add_argument("--items", type=_count(1), default=16, help="recordings to generate (16)")
    p.add_argument("--epochs", type=_count(1), default=3, help="epochs to read (3)")
    p.add_argument(
        "--windows-per-item",
        type=_count(1),
        default=8,
        help="random 10 s windows per item and epoch (8)",
    )
    p.set_defaults(func=cmd_demo)
    return parser


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """zstore's own warnings as one line each, as its errors are (the source line of
    the library that raised them says nothing to someone at a shell); others as Python
    shows them."""
    out = sys.stderr if file is None else file
    if issubclass(category, UserWarning):
        print(f"zstore: warning: {message}", file=out)
    else:
        out.write(warnings.formatwarning(message, category, filename, lineno, line))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except ZstoreError as e:
        print(f"zstore: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `zstore info --json | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
