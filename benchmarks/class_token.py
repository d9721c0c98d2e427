"""The class-token-only last block (models/vit.py, CLASS_TOKEN_ONLY) against the full last block, in every engine
that runs it: eager PyTorch (`--engine torch`), ONNX Runtime fp32 (`--engine onnxruntime`) and dynamic int8
(`--int8 dynamic`), and in training steps (AdamW, fp32). Timed as `--engine auto` times its candidates
(`engine.choose.interleaved_speeds`: interleaved, a pause before each call, median of the rounds), with the
largest logit difference between the two routes.

    python benchmarks/class_token.py                          # inference; torch's default threads
    python benchmarks/class_token.py --train fmnist,ti16      # training steps instead
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import vitlab
import vitlab.models.vit as vit_module
from vitlab.engine import choose
from vitlab.engine.torch_engines import TorchEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import TRAIN_SIZES, perturbed  # noqa: E402  (sizes: image, channels, patch, dim, depth, heads, mlp, batch)


@contextlib.contextmanager
def class_token_only(on: bool) -> Iterator[None]:
    before, vit_module.CLASS_TOKEN_ONLY = vit_module.CLASS_TOKEN_ONLY, on
    try:
        yield
    finally:
        vit_module.CLASS_TOKEN_ONLY = before


def routed(on: bool, fn: Callable) -> Callable:
    def call(*args):
        with class_token_only(on):
            return fn(*args)
    return call


def ort_pair(model, kind: str, tmp: Path, threads: int) -> dict[str, Callable]:
    """Two ORT engines of `kind` (fp32 or int8 dynamic): graphs exported with the full and the short last block."""
    from vitlab.engine.ort import OrtEngine, build_fp32, build_int8_dynamic

    engines = {}
    for on in (False, True):
        folder = tmp / f"{kind}-{on}"
        with class_token_only(on):
            path = build_fp32(model, folder, (224, 224))
        if kind == "int8":
            path = build_int8_dynamic(path, folder / "int8.onnx")
        engines["class token only" if on else "full"] = OrtEngine(path, threads)
    return engines


def inference(name: str, batch: int, rounds: int, engines: list[str], threads: int) -> None:
    model = perturbed(vitlab.create_model(name))  # non-zero head and biases, eval mode
    x = torch.randn(batch, 3, 224, 224)
    torch_engine = TorchEngine(model)
    for engine in engines:
        if engine == "torch":
            pair = {"full": routed(False, torch_engine), "class token only": routed(True, torch_engine)}
        else:
            pair = ort_pair(model, engine, Path(tempfile.mkdtemp()), threads)
        diff = float((pair["full"](x) - pair["class token only"](x)).abs().max())
        speeds = choose.interleaved_speeds(pair, x, rounds)
        full, short = speeds["full"], speeds["class token only"]
        print(f"  {name:10s} batch {batch:3d} {engine:6s}: full {full:8.2f}  class token only {short:8.2f}"
              f"  (x{short / full:.3f})  max |logit difference| {diff:.1e}", flush=True)


def training(size: str, rounds: int) -> None:
    img, ch, p, d, depth, heads, mlp, batch = TRAIN_SIZES[size]
    model = perturbed(vitlab.create_model("custom", num_classes=10, image_size=img, in_chans=ch, patch_size=p, dim=d,
                                          depth=depth, heads=heads, mlp_dim=mlp, seed=0)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x, y = torch.randn(batch, ch, img, img), torch.randint(0, 10, (batch,))

    def step(images: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), y).backward()
        opt.step()

    speeds = choose.interleaved_speeds({"full": routed(False, step), "short": routed(True, step)}, x, rounds)
    print(f"  {size:6s} batch {batch:3d} training: full {speeds['full']:8.1f}  class token only {speeds['short']:8.1f}"
          f"  (x{speeds['short'] / speeds['full']:.3f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--models", default="vit-ti/16,vit-s/16,vit-b/16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--engines", default="torch,fp32,int8", help="torch, fp32 (ONNX Runtime), int8 (dynamic)")
    ap.add_argument("--train", default=None, help="time training steps for these sizes (fmnist,ti16) instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds, images/s")
    if args.train:
        for size in args.train.split(","):
            training(size, args.rounds)
        return
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            inference(name, batch, args.rounds, args.engines.split(","), args.threads)


if __name__ == "__main__":
    main()
