"""timm's evaluation sizes for its weights (`transforms_imagenet_eval`, crop mode "center"): the shorter side to
floor(size / crop_pct), then the centre crop, also at crop_pct 1.0. vitlab recorded crop_pct 1.0 (timm's ViTs at 384
px, its BiT at 448) as a plain resize, which squashes a non-square photo where timm crops it (up to 2.0 apart after
normalisation)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab.weights import load_with_meta
from vitlab.weights import timm as timm_format


@pytest.mark.parametrize("size, resize", [(224, 248), (384, 384)])
def test_timm_state_dict_records_timms_resize_and_crop(tmp_path, size, resize):
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=16, image_size=size,
                                num_classes=3)
    path = timm_format.save_timm(model, tmp_path / "m.pth")
    timm_format.sidecar_path(path).unlink()  # a foreign file: timm's own defaults apply
    _, meta = load_with_meta(path, heads=2, classifier="token")
    pre = meta["preprocess"]
    assert (pre.resize, pre.crop_fraction, pre.interpolation) == (resize, 1.0, "bicubic")
    # a 3:2 photo is cropped (its shorter side brought to `resize`), not squashed
    yy, xx = np.mgrid[0:size, 0:size * 3 // 2]  # smooth, as photos are: kernels differ on noise, not on this
    channels = [xx * 255 // xx.max(), yy * 255 // yy.max(), (xx + yy) * 255 // (xx + yy).max()]
    photo = Image.fromarray(np.stack(channels, -1).astype(np.uint8))
    long = int(resize * 3 / 2)
    left, top = int(round((long - size) / 2.0)), int(round((resize - size) / 2.0))
    expected = np.array(photo.resize((long, resize), Image.BICUBIC))[top:top + size, left:left + size]
    got = (pre(photo) * 0.5 + 0.5) * 255  # back to 0..255
    assert float((got - torch.from_numpy(expected).permute(2, 0, 1).float()).abs().max()) < 3.0  # PIL rounding


def timm_hub_folder(tmp_path, size, **pretrained_cfg):
    """A timm Hub folder (`hf:timm/...` layout) of a tiny token-pooled ViT at `size` with this pretrained_cfg."""
    from safetensors.torch import save_file

    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=16, image_size=size,
                                num_classes=3)
    folder = tmp_path / "hub"
    folder.mkdir()
    save_file(timm_format.to_timm_state_dict(model), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architecture": f"vit_base_patch16_{size}", "num_classes": 3, "global_pool": "token",
        "pretrained_cfg": {"input_size": [3, size, size], "mean": [0.5] * 3, "std": [0.5] * 3, **pretrained_cfg}}))
    return folder


def test_a_timm_folder_at_384_with_crop_pct_1_crops(tmp_path):
    folder = timm_hub_folder(tmp_path, 384, crop_pct=1.0, interpolation="bicubic")
    _, meta = load_with_meta(folder, heads=2)
    assert (meta["preprocess"].resize, meta["preprocess"].image_size) == (384, (384, 384))
    _, meta = load_with_meta(folder, heads=2, image_size=448)  # the margin scales with the size
    assert (meta["preprocess"].resize, meta["preprocess"].image_size) == (448, (448, 448))
