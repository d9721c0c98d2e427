"""`vitlab data`: inspect a data source (classes, counts, sizes, unreadable files, sample grid), download one,
or write one as tar shards."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from vitlab.commands._argtypes import positive_int, seed_value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="inspect or download a data set")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION")

    q = dsub.add_parser("inspect", help="classes, counts per class and split, image sizes, unreadable files, "
                                        "and a PNG grid of samples per class")
    q.add_argument("source", help="fashion-mnist, mnist[:DIR], cifar10:PATH, cifar100:PATH, digits, bundled, "
                                  "a folder of class subfolders, a CSV of path,label, tar shards "
                                  "('DIR/train-{000000..000009}.tar' or a folder of .tar), or hf:PATH")
    q.add_argument("--classes", help='keep these classes, in this order: "Sandal,Sneaker,Ankle boot"')
    q.add_argument("--per-class", type=int, help="keep N training images per class (seeded)")
    q.add_argument("--val-fraction", type=float, default=0.1, help="val share carved from train where the source has none")
    q.add_argument("--test-fraction", type=float, default=0.1, help="test share carved where the source has none")
    q.add_argument("--seed", type=seed_value, default=0, help="seed of the carved splits")
    q.add_argument("--samples", type=positive_int, default=8, help="images per class in the grid (default 8)")
    q.add_argument("--out", help="folder for samples.png, summary.json and skipped_files.txt "
                                 "(default data-inspect/NAME)")
    q.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    q.add_argument("--quiet", action="store_true", help="print only the totals and the file names written")
    q.set_defaults(func=run_inspect)

    d = dsub.add_parser("download", help="download a standard data set and check its MD5 (needs a network)")
    d.add_argument("name", choices=["fashion-mnist", "mnist", "cifar10", "cifar100"], help="the data set to download")
    d.add_argument("--dir", "--out", dest="dir",
                   help="target folder (default $VITLAB_DATA/NAME or ~/.cache/vitlab/datasets/NAME)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=run_download)
    w = dsub.add_parser("shard", help="write any data source as WebDataset tar shards (PNG + .cls) and classes.txt")
    w.add_argument("source", help="any --data source: fashion-mnist, cifar10:PATH, a folder, a CSV, hf:PATH, shards")
    w.add_argument("out", help="folder for SPLIT-000000.tar, ... and classes.txt")
    w.add_argument("--shard-size", type=int, default=10000, help="images per shard (default 10000)")
    w.add_argument("--storage-size", type=positive_int, help="store file images at this square size (default: median "
                                                    "shorter side, at most 256)")
    w.add_argument("--force", action="store_true", help="replace shards already in OUT")
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    w.set_defaults(func=run_shard)
    p.set_defaults(func=lambda args: p.print_help() or 0)


def run_inspect(args: argparse.Namespace) -> int:
    from vitlab.data import load_data, write_skipped
    from vitlab.data.inspect import describe, format_table, sample_grid

    _out_outside_source(args.out, args.source)  # before loading: the default --out is named after the data
    # every split is decoded once (not only val and test): a file whose header reads but whose pixels do not
    # is dropped and listed here exactly as training drops it, so the counts are training's counts
    splits = load_data(args.source, classes=args.classes, per_class=args.per_class, val_fraction=args.val_fraction,
                       test_fraction=args.test_fraction, seed=args.seed, in_memory=False, progress=not args.quiet,
                       report=False, eval_splits=("train", "val", "test"))
    out = Path(args.out) if args.out else Path("data-inspect") / _folder_name(splits.name, args.source)
    out.mkdir(parents=True, exist_ok=True)
    grid = sample_grid(splits, out / "samples.png", per_class=args.samples, seed=args.seed)
    info = describe(splits)
    (out / "summary.json").write_text(json.dumps(info, indent=2))
    line = write_skipped(splits, out)
    if args.json:
        print(json.dumps(info, indent=2))
    elif args.quiet:
        totals = ", ".join(f"{k} {sum(v)}" for k, v in info["counts"].items())
        print(f"{info['name']}: {len(info['classes'])} classes, {totals}")
        print(line)
    else:
        print(format_table(info))
    print(f"wrote {grid} and {out / 'summary.json'}")
    return 0


def _out_outside_source(out: str | None, source: str) -> None:
    """Refuse an --out (or the default data-inspect/ of the current folder) inside the source's folder: the
    samples.png written into a class folder was read as one of its images by the next load, and data-inspect/
    inside a folder of class folders as one more class."""
    from vitlab.data.hf_datasets import is_hf_source
    from vitlab.data.load import is_builtin_source, nesting, source_folders
    from vitlab.data.shards import looks_like_shards
    from vitlab.errors import VitlabError

    if is_builtin_source(source) or is_hf_source(source) or looks_like_shards(source):
        return  # sources that read no loose image files: a PNG written among them is never read
    found = nesting(Path(out or "data-inspect"), source_folders(source))
    if found is not None and found[0] != "holds":
        what = f"--out {out}" if out else "the default --out (data-inspect/ in the current folder)"
        raise VitlabError(f"{what} {found[0]} the source folder {found[1]}: samples.png there would be read as "
                          "one of its images; give an --out outside the source")


def _folder_name(name: str, source: str) -> str:
    """The data-inspect/ subfolder for a source: its name, made safe. A folder given as `.` or `..` is named by
    the folder it is (`..` put the files in the current folder, `.` in data-inspect/ itself)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    if not safe.strip("."):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(source).resolve().name).strip(".") or "root"
    return safe


def run_shard(args: argparse.Namespace) -> int:
    from vitlab.data import read_source, skipped_summary
    from vitlab.data.load import source_folders
    from vitlab.data.shards import check_apart, check_target, write_shards

    check_apart(Path(args.out), source_folders(args.source))  # first: --force must not be the advice for these
    check_target(Path(args.out), args.shard_size, args.force)  # before reading a possibly large source
    splits = read_source(args.source, args.storage_size, progress=not args.quiet)  # the source's own splits
    counts = write_shards(splits, args.out, args.shard_size, force=args.force, progress=not args.quiet)
    parts = ", ".join(f"{k} {n} images in {s} shard{'s' if s != 1 else ''}" for k, (n, s) in counts.items())
    print(f"{splits.name}: wrote {parts} to {args.out} (classes in {Path(args.out) / 'classes.txt'}); "
          f"use --data {args.out}")
    if splits.skipped:
        print(skipped_summary(splits.skipped))
    return 0


def run_download(args: argparse.Namespace) -> int:
    from vitlab.data.download import download

    dest = download(args.name, args.dir, progress=not args.quiet)
    print(f"{args.name}: files in {dest}; use --data {args.name}:{dest}")
    return 0
