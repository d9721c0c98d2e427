"""`vitlab models`: the table of named models with their parameter counts and compute; `--pretrained`: the
published checkpoints (`vitlab.weights.pretrained`).

ResNet names say the family: `resnet-N` is the standard torchvision / Hugging Face BatchNorm ResNet,
`bit-rNxW` the pre-activation BiT, `bit-rNxW-postact` the ViT code's post-activation units.

Both tables start without torch: the default table (224 px, 1000 classes) is `TABLE` below, written from the
built models and checked against them by tests/test_models_table.py (regenerate with `rows_built()`); other
`--image-size` / `--num-classes` values build every model on the meta device (about 3 s, torch).
"""

from __future__ import annotations

import argparse
import difflib
import sys

from vitlab import _match_names as matching
from vitlab.commands._argtypes import non_negative_int, positive_int
from vitlab.errors import VitlabError

COLUMNS = ("family", "layers", "width", "mlp", "heads", "stride", "params", "macs")
# name -> (family, layers, width, mlp, heads, stride, parameters, multiply-accumulates) at 224 px, 1000 classes
TABLE: dict[str, tuple] = {
    "vit-ti/8": ("vit", 12, 192, 768, 3, 8, 5719720, 7035764736),
    "vit-ti/14": ("vit", 12, 192, 768, 3, 14, 5694376, 1697710080),
    "vit-ti/16": ("vit", 12, 192, 768, 3, 16, 5717416, 1253683200),
    "vit-ti/32": ("vit", 12, 192, 768, 3, 32, 6131560, 306034176),
    "vit-s/8": ("vit", 12, 384, 1536, 6, 8, 22055272, 22405742592),
    "vit-s/14": ("vit", 12, 384, 1536, 6, 14, 22004584, 6123945984),
    "vit-s/16": ("vit", 12, 384, 1536, 6, 16, 22050664, 4598882304),
    "vit-s/32": ("vit", 12, 384, 1536, 6, 32, 22878952, 1142909952),
    "vit-b/8": ("vit", 12, 768, 3072, 12, 8, 86576872, 78148337664),
    "vit-b/14": ("vit", 12, 768, 3072, 12, 14, 86475496, 23161995264),
    "vit-b/16": ("vit", 12, 768, 3072, 12, 16, 86567656, 17563828224),
    "vit-b/32": ("vit", 12, 768, 3072, 12, 32, 88224232, 4409186304),
    "vit-l/8": ("vit", 24, 1024, 4096, 16, 8, 304338920, 267505917952),
    "vit-l/14": ("vit", 24, 1024, 4096, 16, 14, 304203752, 81013006336),
    "vit-l/16": ("vit", 24, 1024, 4096, 16, 16, 304326632, 61554712576),
    "vit-l/32": ("vit", 24, 1024, 4096, 16, 32, 306535400, 15377539072),
    "vit-h/8": ("vit", 32, 1280, 5120, 16, 8, 632214760, 544554403840),
    "vit-h/14": ("vit", 32, 1280, 5120, 16, 14, 632045800, 167295109120),
    "vit-h/16": ("vit", 32, 1280, 5120, 16, 16, 632199400, 127314872320),
    "vit-h/32": ("vit", 32, 1280, 5120, 16, 32, 634960360, 31856035840),
    "vit-b/16-gap": ("vit", 12, 768, 3072, 12, 16, 86566120, 17471649792),
    "r50+vit-b/16": ("vit-hybrid", 12, 768, 3072, 12, 16, 98659112, 21535358976),
    "r26+vit-b/32": ("vit-hybrid", 12, 768, 3072, 12, 32, 101383976, 6710859776),
    "r26+vit-s/32": ("vit-hybrid", 12, 384, 1536, 6, 32, 36431912, 3463851008),
    "r50+vit-l/32": ("vit-hybrid", 24, 1024, 4096, 16, 32, 328994856, 19413295104),
    "r+vit-ti/16": ("vit-hybrid", 12, 192, 768, 3, 32, 6337704, 433681920),
    "resnet-18": ("resnet-bn", 18, 64, '-', '-', '-', 11689512, 1814073344),
    "resnet-26": ("resnet-bn", 26, 64, '-', '-', '-', 15995176, 2342256640),
    "resnet-34": ("resnet-bn", 34, 64, '-', '-', '-', 21797672, 3663761408),
    "resnet-50": ("resnet-bn", 50, 64, '-', '-', '-', 25557032, 4089184256),
    "resnet-101": ("resnet-bn", 101, 64, '-', '-', '-', 44549160, 7801405440),
    "resnet-152": ("resnet-bn", 152, 64, '-', '-', '-', 60192808, 11513626624),
    "bit-r26x1": ("bit-preact", 26, 64, '-', '-', '-', 15987496, 2342256640),
    "bit-r50x1": ("bit-preact", 50, 64, '-', '-', '-', 25549352, 4089184256),
    "bit-r50x3": ("bit-preact", 50, 192, '-', '-', '-', 217319080, 36082286592),
    "bit-r101x1": ("bit-preact", 101, 64, '-', '-', '-', 44541480, 7801405440),
    "bit-r101x3": ("bit-preact", 101, 192, '-', '-', '-', 387934888, 69492277248),
    "bit-r152x2": ("bit-preact", 152, 128, '-', '-', '-', 236335208, 45814382592),
    "bit-r152x4": ("bit-preact", 152, 256, '-', '-', '-', 936533224, 182777282560),
    "bit-r26x1-postact": ("bit-postact", 26, 64, '-', '-', '-', 15995176, 2342256640),
    "bit-r50x1-postact": ("bit-postact", 50, 64, '-', '-', '-', 25557032, 4089184256),
    "bit-r101x1-postact": ("bit-postact", 101, 64, '-', '-', '-', 44549160, 7801405440),
    "bit-r152x1-postact": ("bit-postact", 152, 64, '-', '-', '-', 60192808, 11513626624),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the named models (layers, width, MLP, heads, parameters, GFLOPs), "
                                      "or with --pretrained the published checkpoints")
    p.add_argument("patterns", nargs="*", metavar="PATTERN",
                   help="only the names matching one of these wildcard patterns, as timm.list_models('vit*'): "
                        "'vit-b*', '*r152*', 'vit-s/16.*' with --pretrained (case-insensitive; quote them in a shell)")
    p.add_argument("--pretrained", action="store_true",
                   help="list the published checkpoints (name, model, resolution, labels, size, licence, source)")
    p.add_argument("--image-size", type=positive_int, default=None,
                   help="input size for the compute column (default 224)")
    p.add_argument("--num-classes", type=non_negative_int, default=None,
                   help="classes of the head, for the parameter column (default 1000; 0: no head, the features)")
    p.add_argument("--format", choices=["table", "csv"], default="table", help="a table for people or CSV for tools")
    p.set_defaults(func=run)


def _no_match(patterns: list[str], names: list[str], what: str, hint: str) -> VitlabError:
    """The one-line error for patterns that match nothing, with the closest names (a typo, mostly)."""
    close = [c for p in patterns for c in difflib.get_close_matches(p.lower(), names, n=3, cutoff=0.6)]
    shown = " or ".join(repr(c) for c in dict.fromkeys(close))
    return VitlabError(f"no {what} matches {' or '.join(map(repr, patterns))}"
                       f"{f' (did you mean {shown}?)' if shown else ''}; {hint}")


def rows(image_size: int = 224, num_classes: int = 1000, skipped: list[str] | None = None,
         names: list[str] | None = None) -> list[dict]:
    """One dict per registry model (or per one of `names`); the committed TABLE at the defaults, else built on the
    meta device."""
    if (image_size, num_classes) != (224, 1000):
        return rows_built(image_size, num_classes, skipped, names)
    return [{"name": name, **dict(zip(COLUMNS, values)), "gmacs": values[-1] / 1e9, "gflops": 2 * values[-1] / 1e9}
            for name, values in TABLE.items() if names is None or name in names]


def rows_built(image_size: int = 224, num_classes: int = 1000, skipped: list[str] | None = None,
               names: list[str] | None = None) -> list[dict]:
    """The same rows computed from the models themselves (shapes only: built on the meta device), for every
    registry model or those of `names`. A model whose stride does not divide `image_size` (the patch-14 ones at
    384) is left out and named in `skipped`."""
    import torch

    from vitlab.models.registry import analytic_macs, count_parameters, create_model, model_names

    out = []
    for name in model_names():
        if names is not None and name not in names:
            continue
        try:
            with torch.device("meta"):  # no memory, no init: only shapes
                model = create_model(name, num_classes=num_classes, image_size=image_size)
        except VitlabError:
            if skipped is None:
                raise
            skipped.append(name)
            continue
        cfg = model.config
        vit = cfg.arch == "vit"
        macs = analytic_macs(cfg)
        out.append({
            "name": name,
            "family": family(cfg),
            # ResNet depth counts weight layers: the stem conv, 2 or 3 per block, the classifier
            "layers": cfg.depth if vit else sum(cfg.resnet.layers) * (2 if cfg.resnet.block == "basic" else 3) + 2,
            "width": cfg.dim if vit else cfg.resnet.width,
            "mlp": cfg.mlp_dim if vit else "-",
            "heads": cfg.heads if vit else "-",
            "stride": cfg.stride if vit else "-",
            "params": count_parameters(model),
            "macs": macs,
            "gmacs": macs / 1e9,
            "gflops": 2 * macs / 1e9,
        })
    return out


def family(cfg) -> str:
    """One word for the model family shown by `vitlab models`."""
    if cfg.arch == "vit":
        return "vit-hybrid" if cfg.is_hybrid else "vit"
    return {"standard": "resnet-bn", "bit": "bit-preact", "bit-post": "bit-postact"}[cfg.resnet.kind]


def _print_table(head: list[str], cells: list[list], left: tuple[int, ...] = (0,)) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *cells)]
    for row in [head, *cells]:
        print("  ".join(str(x).ljust(w) if i in left else str(x).rjust(w)
                        for i, (x, w) in enumerate(zip(row, widths))).rstrip())


def _size(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def run_pretrained(fmt: str, patterns: list[str] | None = None) -> int:
    """`vitlab models --pretrained [PATTERN ...]`: every published checkpoint (matching), one line each."""
    from vitlab.weights.pretrained import PRETRAINED

    chosen = matching(list(PRETRAINED), patterns)
    if not chosen:
        raise _no_match(patterns, list(PRETRAINED), "published checkpoint",
                         "run `vitlab models --pretrained` for the list")
    cols = ["name", "model", "resolution", "labels", "size", "integrity", "licence", "source"]
    cells = [[e.name, e.model, e.image_size, e.labels, _size(e.size), e.integrity, e.licence,
              f"hf:{e.path}" if e.source == "hf" else e.url] for e in map(PRETRAINED.get, chosen)]
    if fmt == "csv":
        print(",".join(cols))
        for row in cells:
            print(",".join(str(x) for x in row))
        return 0
    _print_table(cols, cells, left=(0, 1, 3, 5, 6, 7))
    print("Use: vitlab predict NAME IMAGE, --weights NAME, vitlab.create_model(MODEL, pretrained=TAG or True). "
          "Cache: $VITLAB_CACHE (default ~/.cache/vitlab); VITLAB_OFFLINE=1 = cache only. Inputs: mean = std = 0.5. "
          "Google publishes no hashes: 'unverified' files are checked by length and the .npz CRC-32s.")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.pretrained:
        given = [flag for flag, value in (("--image-size", args.image_size), ("--num-classes", args.num_classes))
                 if value is not None]
        if given:  # else silently ignored: the checkpoints are listed at their own resolution and classes
            raise VitlabError(f"{' and '.join(given)} size the model table; --pretrained lists the checkpoints at "
                              "their own resolution and classes, so leave them out")
        return run_pretrained(args.format, args.patterns)
    args.image_size = args.image_size or 224
    args.num_classes = 1000 if args.num_classes is None else args.num_classes
    chosen = matching(list(TABLE), args.patterns)
    if not chosen:
        raise _no_match(args.patterns, list(TABLE), "model", "run `vitlab models` for the list")
    skipped: list[str] = []
    table = rows(args.image_size, args.num_classes, skipped, chosen if args.patterns else None)
    if skipped:  # on stderr, so that --format csv stays a table
        print(f"vitlab models: at {args.image_size} px left out {', '.join(skipped)}: "
              f"{args.image_size} is not a multiple of their stride", file=sys.stderr)
    cols = ["name", "family", "layers", "width", "mlp", "heads", "stride", "params", "gmacs", "gflops"]
    if args.format == "csv":
        print(",".join(cols))
        for r in table:
            print(",".join(str(r[c]) if not isinstance(r[c], float) else f"{r[c]:.2f}" for c in cols))
        return 0
    head = ["name", "family", "layers", "width", "MLP", "heads", "stride", "parameters", "GMACs",
            f"GFLOPs@{args.image_size}"]
    cells = [[r["name"], r["family"], r["layers"], r["width"], r["mlp"], r["heads"], r["stride"], f"{r['params']:,}",
              f"{r['gmacs']:.2f}", f"{r['gflops']:.2f}"] for r in table]
    _print_table(head, cells)
    print("GFLOPs = 2 x multiply-accumulates; torchvision and timm tables quote GMACs as 'GFLOPS'.")
    print("resnet-N is the standard BatchNorm ResNet (torchvision / Hugging Face v1.5); bit-rNxW the pre-activation "
          "BiT; bit-rNxW-postact the ViT code's post-activation units (the old BiT 'resnet-N' names).")
    return 0
