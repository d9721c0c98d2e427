"""Standard ResNets against the peers: torchvision resnet18/50/152 and timm resnet50 -> vitlab, and
vitlab -> save_timm -> strict load into timm and torchvision. Prints max |delta logit| (eval mode).

Needs a Python where torchvision and timm import (not vitlab's CPU-only torch 2.13 environment):

    /work/peers/bin/python benchmarks/resnet_peers.py

vitlab is taken from this checkout's `src/` when it is not installed. Random weights, with every
BatchNorm weight, bias, running_mean and running_var randomised so that the buffers are exercised.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

try:
    import vitlab  # noqa: F401
except ImportError:  # a peers-only environment: use this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def randomise_bn(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=g) * 0.5 + 0.25)  # < 1: keeps deep nets finite
                m.bias.copy_(torch.randn(n, generator=g) * 0.2)
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
    return model.eval()


def max_delta(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def main() -> int:
    import timm
    import torchvision

    import vitlab
    from vitlab.weights import save_timm

    torch.manual_seed(0)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    peers = [
        ("torchvision resnet18", lambda: torchvision.models.resnet18()),
        ("torchvision resnet50", lambda: torchvision.models.resnet50()),
        ("torchvision resnet152", lambda: torchvision.models.resnet152()),
        ("timm resnet50", lambda: timm.create_model("resnet50", pretrained=False)),
    ]
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, timm {timm.__version__}; "
          f"input {tuple(x.shape)}, eval mode, fp32, CPU")
    print(f"{'peer':<24} {'keys':>5} {'peer -> vitlab':>15} {'vitlab -> timm':>15} {'-> torchvision':>15}  logit scale")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, build) in enumerate(peers):
            torch.manual_seed(i)
            peer = randomise_bn(build(), seed=100 + i)
            path = Path(tmp) / f"{i}.pth"
            torch.save(peer.state_dict(), path)
            ours = vitlab.load(path)
            with torch.no_grad():
                ref = peer(x)
                d_in = max_delta(ours(x), ref)
            # back out: vitlab's timm file, strictly into timm and torchvision models of the same depth
            out = Path(tmp) / f"{i}.safetensors"
            save_timm(ours, out)
            from safetensors.torch import load_file

            sd = load_file(str(out))
            arch = name.split()[-1]
            tm = timm.create_model(arch, pretrained=False)
            tm.load_state_dict(sd, strict=True)
            tv = getattr(torchvision.models, arch)()
            tv.load_state_dict(sd, strict=True)
            with torch.no_grad():
                d_timm = max_delta(tm.eval()(x), ref)
                d_tv = max_delta(tv.eval()(x), ref)
            worst = max(worst, d_in, d_timm, d_tv)
            print(f"{name:<24} {len(sd):>5} {d_in:>15.3g} {d_timm:>15.3g} {d_tv:>15.3g}  {float(ref.abs().max()):.3g}")
    print(f"worst max |delta logit|: {worst:.3g}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
