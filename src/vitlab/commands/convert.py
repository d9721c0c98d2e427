"""`vitlab convert SRC DST --to native|hf|timm`: any supported weights into vitlab, Hugging Face or timm form."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="convert weights between formats (official .npz, timm, Hugging Face, torchvision, vitlab)",
        description="Load SRC in any supported format and write DST as a vitlab folder (native), a Hugging Face "
                    "folder (hf, loadable by transformers.ViTForImageClassification.from_pretrained) or a "
                    "timm-named state dict (timm; .safetensors, or .pth by suffix).",
    )
    p.add_argument("src", help="a vitlab or Hugging Face folder, an official .npz, a .safetensors/.pth/.bin, or hf:ORG/NAME")
    p.add_argument("dst", help="output folder (native, hf) or file (timm; a folder gets model.safetensors)")
    p.add_argument("--to", choices=["native", "hf", "timm"], default="native", help="output format (default native)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="replace the head by a zero-initialised one with this many classes (fine-tuning surgery)")
    p.add_argument("--image-size", type=int, default=None, help="resample the position embeddings to this image size")
    p.add_argument("--keep-representation", action="store_true", help="keep the pre-logits layer when replacing the head")
    p.add_argument("--heads", type=int, default=None, help="attention heads, for timm/torchvision files of a non-standard width")
    p.add_argument("--class-names", default=None, help="a text file with one class name per line, to store with the weights")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitlab.errors import VitlabError
    from vitlab.models.registry import count_parameters
    from vitlab.weights import load_with_meta, save_hf, save_native, save_timm

    overrides = {"heads": args.heads} if args.heads else {}
    model, meta = load_with_meta(args.src, num_classes=args.num_classes, image_size=args.image_size,
                                 keep_representation=args.keep_representation, **overrides)
    names = meta.get("class_names")
    if args.class_names:
        path = Path(args.class_names)
        if not path.is_file():
            raise VitlabError(f"no such class-names file: {path}")
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if names is not None and len(names) != model.config.num_classes:
        raise VitlabError(f"{len(names)} class names for a model with {model.config.num_classes} outputs")
    if args.to == "native":
        out = save_native(model, args.dst, class_names=names, preprocess=meta.get("preprocess"))
    elif args.to == "hf":
        out = save_hf(model, args.dst, class_names=names, preprocess=meta.get("preprocess"))
    else:
        out = save_timm(model, args.dst)
    if not args.quiet:
        c = model.config
        shape = f"{c.arch}" if c.arch != "vit" else (
            f"{'hybrid ' if c.resnet is not None else ''}ViT dim {c.dim}, depth {c.depth}, heads {c.heads}, "
            f"patch {c.patch_size}, {c.classifier}")
        print(f"wrote {out} ({args.to}; from {meta['format']}: {shape}, image {c.image_size[0]}x{c.image_size[1]}, "
              f"{c.num_classes} classes, {count_parameters(model):,} parameters)")
    return 0
