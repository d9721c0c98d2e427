"""`vitlab convert SRC DST --to native|hf|timm`: any supported weights into vitlab, Hugging Face or timm form.

Conversions are lossless or refuse: what the target format cannot carry is stored beside it (vitlab's
config in the timm file's safetensors header or `NAME.vitlab.json` sidecar) or the command stops with one
line saying what to pass. DST never overwrites SRC, nor (without --force) anything already at DST, and
nothing is ever written through a link.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from vitlab.commands._argtypes import positive_int
from vitlab.commands._load_args import WEIGHTS_HELP, add_load_arguments, load_overrides, parse_image_size

# Suffixes of files; a folder format (native, hf) refuses them as DST, so `x.safetensors --to native`
# does not silently become a folder named like a file.
_FILE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt", ".npz", ".onnx", ".json")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="convert weights between formats (official .npz, timm, Hugging Face, torchvision, vitlab)",
        description="Load SRC in any supported format and write DST as a vitlab folder (native), a Hugging Face "
                    "folder (hf, loadable by transformers.ViTForImageClassification.from_pretrained) or a "
                    "timm-named state dict (timm; .safetensors with vitlab's config in the header, or "
                    ".pth/.pt/.bin with a NAME.vitlab.json sidecar). DST must not be SRC or inside it.",
    )
    p.add_argument("src", help="what to convert; " + WEIGHTS_HELP)
    p.add_argument("dst", help="output folder (native, hf) or file (timm: .safetensors, .pth, .pt, .bin; "
                               "a folder gets model.safetensors)")
    p.add_argument("--to", choices=["native", "hf", "timm"], default="native", help="output format (default native)")
    p.add_argument("--num-classes", type=positive_int, default=None,
                   help="replace the head by a zero-initialised one with this many classes (fine-tuning surgery)")
    p.add_argument("--image-size", type=parse_image_size, default=None,
                   help="S or HxW: resample the position embeddings to this size; a non-square timm/torchvision "
                        "file is read at it when its grid fits the file")
    p.add_argument("--keep-representation", action="store_true", help="keep the pre-logits layer when replacing the head")
    add_load_arguments(p)
    p.add_argument("--class-names", default=None, help="a text file with one class name per line, to store with the weights")
    p.add_argument("--force", action="store_true",
                   help="replace what is already at DST (a file, or the files convert writes in a non-empty folder; "
                        "a link is replaced itself, never written through)")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors (no notes on what was written)")
    p.set_defaults(func=run)


def output_path(dst: str, to: str) -> Path:
    """The file (timm) or folder (native, hf) convert writes; unknown suffixes are refused in one line."""
    from vitlab.errors import VitlabError
    from vitlab.weights.timm import timm_output_path

    if to == "timm":
        return timm_output_path(dst)
    path = Path(dst)
    if path.suffix.lower() in _FILE_SUFFIXES and not path.is_dir():
        raise VitlabError(f"--to {to} writes a folder, not a {path.suffix} file: name a folder without a suffix "
                          f"(or write a {', '.join(('.safetensors', '.pth', '.pt', '.bin'))} file with --to timm)")
    return path


def source_path(src: str) -> Path | None:
    """What convert reads from disk for SRC (a folder for files inside a vitlab/HF/timm folder), None when
    SRC is not a local path (hf:ORG/NAME, an official name to download)."""
    from vitlab.weights import detect_format, run_model_folder

    path = Path(src)
    if not path.exists():
        return None
    path = Path(run_model_folder(path)).resolve()
    if path.is_file() and detect_format(path) in ("native", "hf", "timm_folder"):
        return path.parent
    return path


def refuse_overwriting_source(src: str, out: Path) -> None:
    """DST must be neither SRC nor inside it, nor contain it (compared as resolved paths, links followed)."""
    from vitlab.errors import VitlabError

    read = source_path(src)
    if read is None:
        return
    written = out.resolve()
    if written == read or read in written.parents or written in read.parents:
        raise VitlabError(f"DST {out} would overwrite the source {src} (the same path, inside it, or around it); "
                          "choose a DST outside the source")


# What each format writes into its folder; --force replaces these (and nothing else) in an existing folder.
_FOLDER_FILES = {"native": ("config.json", "model.safetensors"),
                 "hf": ("config.json", "model.safetensors", "preprocessor_config.json", "README.md")}
# Shard indexes of an earlier HF export: the new model.safetensors is read first (as transformers does), but a
# stale index beside it would still describe other weights, so --force removes it.
_STALE_HF = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def written_paths(out: Path, to: str) -> list[Path]:
    """Every path convert writes for DST `out` (a folder's files; a timm torch file's sidecar too)."""
    if to in _FOLDER_FILES:
        return [out / name for name in _FOLDER_FILES[to]]
    from vitlab.weights.timm import sidecar_path

    return [out] if out.suffix == ".safetensors" else [out, sidecar_path(out)]


def refuse_existing_destination(dst: Path, out: Path, to: str, force: bool) -> None:
    """DST (`dst` as named; `out` what is written: the same, or `dst/model.safetensors` for a timm folder) may
    not hold anything yet - a file, a link, a non-empty folder - unless --force; checked before loading. Links
    count even when dangling (os.path.lexists): without --force nothing is ever written through one."""
    from vitlab.errors import VitlabError

    if dst.is_symlink():
        if not force:
            raise VitlabError(f"DST {dst} is a link (to {os.readlink(dst)}); convert never writes through a link: "
                              "pick another DST or pass --force to replace the link itself (its target is left alone)")
        return
    if to in _FOLDER_FILES:
        if dst.exists() and not dst.is_dir():  # even --force never turns a file into a folder
            raise VitlabError(f"DST {dst} is a file; --to {to} writes a folder: pick another DST")
        if dst.is_dir() and any(dst.iterdir()) and not force:
            raise VitlabError(f"DST {dst} is a folder that is not empty ({sorted(dst.iterdir())[0].name}, ...); pick "
                              "another folder or pass --force to replace the model files in it")
        return
    taken = [p for p in written_paths(out, to) if os.path.lexists(p)]
    if taken and not force:
        raise VitlabError(f"DST {taken[0]} already exists; pick another DST or pass --force to replace it")


def clear_destination(dst: Path, out: Path, to: str) -> None:
    """With --force, just before writing: remove a link at DST and at every path about to be written (the link
    itself; its target is left alone), and an earlier HF export's shard index that would shadow the new file."""
    if dst.is_symlink():
        dst.unlink()
    paths = written_paths(out, to) + ([out / n for n in _STALE_HF] if to == "hf" else [])
    for path in paths:
        if path.is_symlink() or (path.name in _STALE_HF and path.is_file()):
            path.unlink()


def run(args: argparse.Namespace) -> int:
    from vitlab.errors import VitlabError
    from vitlab.models.registry import count_parameters
    from vitlab.weights import load_with_meta, save_hf, save_native, save_timm

    out_path = output_path(args.dst, args.to)  # before loading: a bad DST costs nothing
    refuse_overwriting_source(args.src, out_path)
    refuse_existing_destination(Path(args.dst), out_path, args.to, args.force)
    overrides, image_size = load_overrides(args)
    # keep_dtype: the weights are written in the source's dtype (float16 stays float16, float64 is not rounded)
    model, meta = load_with_meta(args.src, num_classes=args.num_classes, image_size=image_size,
                                 keep_representation=args.keep_representation, keep_dtype=True, **overrides)
    names = meta.get("class_names")
    if args.class_names:
        path = Path(args.class_names)
        if not path.is_file():
            raise VitlabError(f"no such class-names file: {path}")
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if names is not None and len(names) != model.config.num_classes:
        raise VitlabError(f"{len(names)} class names for a model with {model.config.num_classes} outputs")
    twice = sorted({n for n in names if names.count(n) > 1}) if names is not None else []
    if twice and args.class_names:  # a names file repeating a line is a slip (and HF's label2id would keep one)
        raise VitlabError(f"class names must differ: {', '.join(map(repr, twice[:3]))} given more than once")
    if twice and not args.quiet:
        # names the weights came with: ImageNet-1k's own list (google/vit-base-patch16-224's id2label) names two
        # classes 'crane' and two 'maillot'; each output keeps its name, so nothing is lost but a lookup by name
        print(f"note: the class names {', '.join(map(repr, twice[:3]))} are each given to more than one output, "
              "as in the source; they are kept as they are" + ("; Hugging Face's label2id keeps one output per "
                                                              "name" if args.to == "hf" else ""))
    if args.force:
        clear_destination(Path(args.dst), out_path, args.to)
    if args.to == "native":
        out = save_native(model, args.dst, class_names=names, preprocess=meta.get("preprocess"))
    elif args.to == "hf":
        out = save_hf(model, args.dst, class_names=names, preprocess=meta.get("preprocess"))
    else:
        out = save_timm(model, out_path, class_names=names, preprocess=meta.get("preprocess"))
    if not args.quiet:
        c = model.config
        shape = f"{c.arch}" if c.arch != "vit" else (
            f"{'hybrid ' if c.resnet is not None else ''}ViT dim {c.dim}, depth {c.depth}, heads {c.heads}, "
            f"patch {c.patch_size}, {c.classifier}")
        print(f"wrote {out} ({args.to}; from {meta['format']}: {shape}, image {c.image_size[0]}x{c.image_size[1]}, "
              f"{c.num_classes} classes, {count_parameters(model):,} parameters, {meta['dtype']})")
        if args.to == "timm":
            print(timm_note(model.config, out, meta.get("preprocess")))
        if args.to == "hf":  # ResNets too: their processor cannot hold everything either (antialias)
            from vitlab.weights.hf import export_notes, export_preprocess

            for note in export_notes(c, export_preprocess(c, meta.get("preprocess"))):
                print(f"note: {note} (also in {Path(out) / 'README.md'})")
    return 0


def timm_note(config: Any, out: Path, preprocess: Any = None) -> str:
    """Where the config timm's keys cannot carry went, and what timm itself must be told (or cannot be)."""
    from vitlab.weights.timm import TIMM_LAYER_NORM_EPS, crop_offset_note, sidecar_path, timm_model_args

    where = "the safetensors header ('vitlab_config')" if out.suffix == ".safetensors" else str(sidecar_path(out))
    note = (f"vitlab's config (heads, GELU, pooling, image size), class names and preprocessing are in {where}; "
            "keep it with the weights")
    if (crop := crop_offset_note(preprocess)) is not None:
        note += "; " + crop
    if config.arch != "vit":
        return note
    needs = []
    if config.gelu == "tanh":
        needs.append("act_layer='gelu_tanh'")
    if config.layer_norm_eps != TIMM_LAYER_NORM_EPS:
        needs.append(f"norm_layer=partial(nn.LayerNorm, eps={config.layer_norm_eps})")
    if config.classifier == "gap":
        needs.append("class_token=False, global_pool='avg', fc_norm=False")
    if needs:
        note += "; timm reproduces the logits with " + ", ".join(needs)
    if timm_model_args(config) is not None:
        note += "; timm's VisionTransformer keywords are stored as 'timm_args'"
    return note
