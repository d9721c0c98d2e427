"""The ONNX Runtime engines of a model over protobuf's 2 GB, built for real (the tests shrink the limit to a few
kilobytes instead): by default a 617M-parameter ViT (width 4096, 3 blocks, MLP 16384, 32 px patches; 2.47 GB of fp32
weights, about ViT-H/14's 2.5 GB at a twentieth of its arithmetic), or `--model vit-h/14` itself.

Each graph is built by its own `vitlab export` command (`--engine onnxruntime`, `--int8 dynamic`, `--int8 static
--calibration` on 20 random images), so that each reports its peak memory (the command and the processes under it, summed:
the model's weights loaded, then the build); the exported files are then compared with eager PyTorch's logits on 4
random images. Random weights and images: the int8 rows show that the graphs build and run, not their accuracy
(docs/benchmarks.md, "int8 accuracy on real data"). Disk: about 4x the weights in the scratch folder.

    python benchmarks/over_2gb.py [--work /tmp/over_2gb] > docs/results/over_2gb.txt
    python benchmarks/over_2gb.py --model vit-h/14 > docs/results/over_2gb_vit_h14.txt   # about 10 minutes
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
from build_memory import calibration_images, tree_rss  # random PNGs; memory of a process tree


def files(folder: Path) -> str:
    return ", ".join(f"{p.name} {p.stat().st_size / 2**20:.0f} MiB" for p in sorted(folder.iterdir()) if p.is_file())


def build_model(name: str | None):
    import vitlab

    if name:
        model = vitlab.create_model(name, num_classes=10, seed=0).eval()
    else:
        model = vitlab.create_model("custom", dim=4096, depth=3, heads=16, mlp_dim=16384, patch_size=32,
                                    image_size=224, num_classes=10, seed=0).eval()
    with torch.no_grad():  # a head that is not zero, so that the logits say something
        generator = torch.Generator().manual_seed(1)
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=generator) * 0.02)
        model.head.bias.copy_(torch.randn(model.head.bias.shape, generator=generator) * 0.1)
    return model


def export(source: Path, out: Path, *flags: str) -> tuple[int, float, float, str]:
    """(return code, seconds, peak memory of the command in GiB, its last line) of `vitlab export SOURCE OUT FLAGS`."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "vitlab", "export", str(source), str(out), *flags, "--quiet"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while child.poll() is None:  # the command and the processes under it (the graph fusion's), summed
        peak = max(peak, tree_rss(child.pid))
        time.sleep(0.01)
    text = child.stdout.read()
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return child.returncode, time.perf_counter() - start, peak / 2**30, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/over_2gb", help="a scratch folder (removed at the end)")
    ap.add_argument("--model", default=None, help="a registry name instead of the wide ViT (e.g. vit-h/14: 32 blocks, "
                                                  "about 20x the arithmetic)")
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.environ["VITLAB_CACHE"] = str(work / "cache")  # the records of what was built: not the user's own cache
    import onnxruntime as ort

    import vitlab

    model = build_model(args.model)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"model: {model.config.name}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{size / 1e9:.2f} GB of fp32 weights", flush=True)
    source = work / "model"
    vitlab.save(model, source)
    x = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x).numpy()
    del model
    calibration = calibration_images(work / "calibration", 20)
    for label, name, flags in (("onnxruntime fp32 (fused)", "fp32", ("--engine", "onnxruntime")),
                               ("int8 dynamic", "int8-dynamic", ("--int8", "dynamic")),
                               ("int8 static", "int8-static", ("--int8", "static", "--calibration", str(calibration)))):
        out = work / "out" / name / "m.onnx"
        code, seconds, peak, last = export(source, out, *flags)
        if code:
            print(f"{label}: vitlab export failed (rc {code}, {seconds:.0f} s, peak {peak:.1f} GiB): {last}", flush=True)
            continue
        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        logits = session.run(None, {"images": x.numpy()})[0]
        del session
        agree = float((logits.argmax(1) == ref.argmax(1)).mean())
        print(f"{label}: vitlab export {' '.join(flags[:2])} rc 0 in {seconds:.0f} s, peak memory {peak:.1f} GiB "
              f"({peak / (size / 2**30):.1f}x the weights); files {files(out.parent)}; max |logit - eager| "
              f"{np.abs(logits - ref).max():.2e} (largest logit {np.abs(ref).max():.2f}), top-1 agreement {agree:.0%} "
              f"on {len(x)} random images", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
