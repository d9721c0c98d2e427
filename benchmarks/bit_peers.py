"""vitlab's pre-activation BiT ResNet against timm's `resnetv2_*_bit`, in both directions.

Needs timm (not importable with vitlab's CPU torch wheel), so run it from a peers environment:

    /work/peers/bin/python benchmarks/bit_peers.py          # vitlab taken from ../src

Checks, each as max |logit difference| on the same random input (values in [-1, 1]):
  1. timm state dict -> vitlab (convert_state_dict: ws_eps 1e-8, as timm) vs timm;
  2. the same for the BiT-M head shape (`resnetv2_50x1_bit.goog_in21k`, 21843 classes);
  3. vitlab -> big_transfer .npz -> timm `load_pretrained` (timm's reader of the released files) vs
     vitlab read back from that .npz (ws_eps 1e-10, as big_transfer), and with ws_eps 1e-8;
  4. vitlab -> `save_timm` -> timm `load_state_dict(strict=True)` vs vitlab.
Random weights with randomised GroupNorm affine and head, so nothing is trivially zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import timm  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from vitlab.models.bit import BiTResNet  # noqa: E402
from vitlab.weights import big_transfer, convert_state_dict, read_checkpoint, save_timm  # noqa: E402


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Random GroupNorm affine and head on top of timm's random init (head.fc starts near zero otherwise)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "norm3.weight")) or name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name == "head.fc.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)


def vitlab_from(sd: dict[str, torch.Tensor]) -> BiTResNet:
    config, vsd, _ = convert_state_dict(sd)
    model = BiTResNet(config)
    model.load_state_dict(vsd, strict=True)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.rand(args.batch, 3, args.size, args.size) * 2 - 1
    results = {"timm": timm.__version__, "torch": torch.__version__, "input": list(x.shape)}

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    with torch.no_grad():
        ref = timm.create_model("resnetv2_50x1_bit", pretrained=False).eval()
        randomise_(ref, 1)
        want = ref(x)
        results["logit_scale"] = float(want.abs().max())
        ours = vitlab_from(ref.state_dict())
        results["timm_sd_to_vitlab_r50x1"] = diff(ours(x), want)

        i21k = timm.create_model("resnetv2_50x1_bit.goog_in21k", pretrained=False).eval()
        randomise_(i21k, 2)
        ours21k = vitlab_from(i21k.state_dict())
        results["timm_sd_to_vitlab_r50x1_in21k"] = diff(ours21k(x), i21k(x))
        results["in21k_num_classes"] = ours21k.config.num_classes

        with tempfile.TemporaryDirectory() as tmp:
            npz = big_transfer.write_big_transfer(ours, Path(tmp) / "BiT-S-R50x1.npz")
            config, sd, _ = read_checkpoint(npz)
            bt = BiTResNet(config)
            bt.load_state_dict(sd, strict=True)
            bt.eval()
            bt_eps8 = BiTResNet(config.replace(resnet=dataclasses.replace(config.resnet, ws_eps=1e-8)))
            bt_eps8.load_state_dict(sd, strict=True)
            bt_eps8.eval()
            tm = timm.create_model("resnetv2_50x1_bit", pretrained=False).eval()
            tm.load_pretrained(str(npz))
            got = tm(x)
            results["vitlab_npz_to_timm_load_pretrained_eps1e-10"] = diff(bt(x), got)
            results["vitlab_npz_to_timm_load_pretrained_eps1e-8"] = diff(bt_eps8(x), got)

            path = save_timm(ours, Path(tmp) / "bit.safetensors")
            tm2 = timm.create_model("resnetv2_50x1_bit", pretrained=False).eval()
            tm2.load_state_dict(load_file(str(path)), strict=True)
            results["vitlab_save_timm_to_timm_strict"] = diff(tm2(x), ours(x))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
