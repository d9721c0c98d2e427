"""The ONNX Runtime engines of a model over protobuf's 2 GB, built for real (the tests shrink the limit to a few
kilobytes instead): a 617M-parameter ViT (width 4096, 3 blocks, MLP 16384, 32 px patches; 2.47 GB of fp32 weights,
about ViT-H/14's 2.5 GB, at a twentieth of its arithmetic). Prints, for the fused fp32 graph, dynamic and static
int8 and `vitlab export --engine onnxruntime`, the files written and how far their logits are from eager PyTorch.
Takes about 5 minutes and 10 GB of disk on the 2-core VM of docs/benchmarks.md.

    python benchmarks/over_2gb.py [--work /tmp/over_2gb] > docs/results/over_2gb.txt
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch


def files(folder: Path) -> str:
    return ", ".join(f"{p.name} {p.stat().st_size / 2**20:.0f} MiB" for p in sorted(folder.iterdir()) if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/over_2gb", help="a scratch folder (removed at the end)")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.environ["VITLAB_CACHE"] = str(work / "cache")  # the records of what was built: not the user's own cache

    import vitlab
    from vitlab.engine import prepare_engine

    start = time.perf_counter()

    def say(*parts) -> None:
        print(f"[{time.perf_counter() - start:5.0f} s]", *parts, flush=True)

    model = vitlab.create_model("custom", dim=4096, depth=3, heads=16, mlp_dim=16384, patch_size=32, image_size=224,
                                num_classes=10, seed=0).eval()
    with torch.no_grad():  # a head that is not zero, so that the logits say something
        generator = torch.Generator().manual_seed(1)
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=generator) * 0.02)
        model.head.bias.copy_(torch.randn(model.head.bias.shape, generator=generator) * 0.1)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    say(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {size / 1e9:.2f} GB fp32")
    source = work / "model"
    vitlab.save(model, source)
    x = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x)
    scale = float(ref.abs().max())

    def compare(name: str, engine) -> None:
        out = engine(x)
        agree = float((out.argmax(1) == ref.argmax(1)).float().mean())
        say(f"{name}: max |logit - eager| {float((out - ref).abs().max()):.2e} (largest logit {scale:.3g}), "
            f"top-1 agreement {agree:.0%} on {len(x)} random images")

    compare("onnxruntime fp32 (fused)", prepare_engine(model, "onnxruntime", source=source, quiet=True))
    folder = next((source / "engines").iterdir())
    compare("int8 dynamic", prepare_engine(model, "onnxruntime", int8="dynamic", source=source, quiet=True,
                                           sub_batches=False))
    calibration = [np.random.RandomState(i).randn(4, 3, 224, 224).astype(np.float32) for i in range(5)]
    compare("int8 static", prepare_engine(model, "onnxruntime", int8="static", calibration=calibration,
                                          source=source, quiet=True, sub_batches=False))
    say(f"engine folder: {files(folder)}")
    out = work / "out" / "m.onnx"
    done = subprocess.run([sys.executable, "-m", "vitlab", "export", str(source), str(out), "--engine", "onnxruntime",
                           "--quiet"], capture_output=True, text=True, env=os.environ)
    say(f"vitlab export --engine onnxruntime: rc {done.returncode}; {done.stdout.strip() or done.stderr.strip()}")
    import onnxruntime as ort

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"images": x.numpy()})[0]
    say(f"exported file: {files(out.parent)}; max |logit - eager| {np.abs(logits - ref.numpy()).max():.2e}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
