"""`vitlab models`: the table of named models with their parameter counts and compute.

ResNet names say the family: `resnet-N` is the standard torchvision / Hugging Face BatchNorm ResNet,
`bit-rNxW` the pre-activation BiT, `bit-rNxW-postact` the ViT code's post-activation units.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the named models (layers, width, MLP, heads, parameters, GFLOPs)")
    p.add_argument("--image-size", type=int, default=224, help="input size for the compute column (default 224)")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--format", choices=["table", "csv"], default="table")
    p.set_defaults(func=run)


def rows(image_size: int = 224, num_classes: int = 1000) -> list[dict]:
    import torch

    from vitlab.models.registry import analytic_macs, count_parameters, create_model, model_names

    out = []
    for name in model_names():
        with torch.device("meta"):  # no memory, no init: only shapes
            model = create_model(name, num_classes=num_classes, image_size=image_size)
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
            "patch": cfg.stride if vit else "-",
            "params": count_parameters(model),
            "gmacs": macs / 1e9,
            "gflops": 2 * macs / 1e9,
        })
    return out


def family(cfg) -> str:
    """One word for the model family shown by `vitlab models`."""
    if cfg.arch == "vit":
        return "vit-hybrid" if cfg.is_hybrid else "vit"
    return {"standard": "resnet-bn", "bit": "bit-preact", "bit-post": "bit-postact"}[cfg.resnet.kind]


def run(args: argparse.Namespace) -> int:
    table = rows(args.image_size, args.num_classes)
    cols = ["name", "family", "layers", "width", "mlp", "heads", "patch", "params", "gmacs", "gflops"]
    if args.format == "csv":
        print(",".join(cols))
        for r in table:
            print(",".join(str(r[c]) if not isinstance(r[c], float) else f"{r[c]:.2f}" for c in cols))
        return 0
    head = ["name", "family", "layers", "width", "MLP", "heads", "stride", "parameters", "GMACs",
            f"GFLOPs@{args.image_size}"]
    cells = [[r["name"], r["family"], r["layers"], r["width"], r["mlp"], r["heads"], r["patch"], f"{r['params']:,}",
              f"{r['gmacs']:.2f}", f"{r['gflops']:.2f}"] for r in table]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *cells)]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for row in cells:
        print("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    print("GFLOPs = 2 x multiply-accumulates; torchvision and timm tables quote GMACs as 'GFLOPS'.")
    print("resnet-N is the standard BatchNorm ResNet (torchvision / Hugging Face v1.5); bit-rNxW the pre-activation "
          "BiT; bit-rNxW-postact the ViT code's post-activation units (the old BiT 'resnet-N' names).")
    return 0
