"""`vitlab models`: the table of named models with their parameter counts and compute."""

from __future__ import annotations

import argparse

import torch


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the named models (layers, width, MLP, heads, parameters, GFLOPs)")
    p.add_argument("--image-size", type=int, default=224, help="input size for the compute column (default 224)")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--format", choices=["table", "csv"], default="table")
    p.set_defaults(func=run)


def rows(image_size: int = 224, num_classes: int = 1000) -> list[dict]:
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
            "layers": cfg.depth if vit else sum(cfg.resnet.layers) * 3 + 2,
            "width": cfg.dim if vit else cfg.resnet.width,
            "mlp": cfg.mlp_dim if vit else "-",
            "heads": cfg.heads if vit else "-",
            "patch": cfg.stride if vit else "-",
            "params": count_parameters(model),
            "gmacs": macs / 1e9,
            "gflops": 2 * macs / 1e9,
        })
    return out


def run(args: argparse.Namespace) -> int:
    table = rows(args.image_size, args.num_classes)
    cols = ["name", "layers", "width", "mlp", "heads", "patch", "params", "gmacs", "gflops"]
    if args.format == "csv":
        print(",".join(cols))
        for r in table:
            print(",".join(str(r[c]) if not isinstance(r[c], float) else f"{r[c]:.2f}" for c in cols))
        return 0
    head = ["name", "layers", "width", "MLP", "heads", "stride", "parameters", "GMACs", f"GFLOPs@{args.image_size}"]
    cells = [[r["name"], r["layers"], r["width"], r["mlp"], r["heads"], r["patch"], f"{r['params']:,}",
              f"{r['gmacs']:.2f}", f"{r['gflops']:.2f}"] for r in table]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *cells)]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))))
    for row in cells:
        print("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    print("GFLOPs = 2 x multiply-accumulates; torchvision and timm tables quote GMACs as 'GFLOPS'.")
    return 0
