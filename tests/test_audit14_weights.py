"""Audit 14 of the weight formats: conversions keep the source's dtype, wrapped EMA checkpoints load, a Hugging Face
folder with two weight sets loads the one transformers loads, the HF export says what it changes in the
preprocessing. Fixtures: tests/fixtures/weights14 (README.md, make_fixtures.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import vitlab
from vitlab.cli import main
from vitlab.weights import load_with_meta, save_native, save_timm

FIX = Path(__file__).parent / "fixtures" / "weights14"
TINY = dict(dim=32, depth=1, heads=2, mlp_dim=64, patch_size=8, image_size=16, num_classes=3)


def tiny(**kw):
    torch.manual_seed(0)
    model = vitlab.create_model("custom", **{**TINY, **kw}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def convert(*args):
    assert main(["convert", *map(str, args)]) == 0


def written(dst: Path) -> dict[str, torch.Tensor]:
    return load_file(dst / "model.safetensors" if dst.is_dir() else dst)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("to", ["native", "timm", "hf"])
def test_convert_keeps_the_source_dtype_and_values(tmp_path, capsys, dtype, to):
    """fp16/bf16 sources were written as float32 (twice the size) and float64 ones rounded to float32 silently."""
    sd = {k: v.to(dtype) for k, v in tiny().state_dict().items()}
    if dtype == torch.float64:  # values float32 cannot hold
        sd = {k: v + 1e-12 * torch.randn_like(v) for k, v in sd.items()}
    save_file(sd, tmp_path / "src.safetensors")
    dst = tmp_path / ("out.safetensors" if to == "timm" else "out")
    convert(tmp_path / "src.safetensors", dst, "--to", to, "--model-args", "heads=2,classifier=token")
    assert capsys.readouterr().out.splitlines()[0].endswith(f"parameters, {str(dtype)[6:]})")
    out = written(dst)
    assert {v.dtype for v in out.values()} == {dtype}
    if to != "hf":
        assert all(torch.equal(out[k], sd[k]) for k in sd)
    back, meta = load_with_meta(dst, keep_dtype=True)
    assert meta["dtype"] == str(dtype)[6:] and all(torch.equal(back.state_dict()[k], sd[k]) for k in sd)
    assert vitlab.load(dst).pos_embed.dtype == torch.float32  # plain loads still compute in float32


def test_convert_float16_surgery_keeps_the_dtype(tmp_path):
    sd = {k: v.half() for k, v in tiny().state_dict().items()}
    save_file(sd, tmp_path / "src.safetensors")
    convert(tmp_path / "src.safetensors", tmp_path / "out", "--num-classes", "5", "--image-size", "24",
            "--model-args", "heads=2,classifier=token")
    out = written(tmp_path / "out")
    assert {v.dtype for v in out.values()} == {torch.float16} and out["head.weight"].shape == (5, 32)
    assert torch.equal(out["blocks.0.mlp.fc1.weight"], sd["blocks.0.mlp.fc1.weight"])


def test_half_timm_export_of_a_fixed_sincos_model_loads_back(tmp_path):
    """The stored sin-cos table was compared with the float32 one at 1e-6: a float16 export was refused as 'trained
    elsewhere'."""
    model = tiny(posemb="sincos2d").half()
    save_timm(model, tmp_path / "x.safetensors")
    back = vitlab.load(tmp_path / "x.safetensors")
    assert back.config.posemb == "sincos2d"
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(back(x), model.float()(x), atol=1e-5)
    save_native(tiny(posemb="sincos2d").double(), tmp_path / "n64")
    convert(tmp_path / "n64", tmp_path / "t64.safetensors", "--to", "timm")
    assert written(tmp_path / "t64.safetensors")["pos_embed"].dtype == torch.float64
    assert vitlab.load(tmp_path / "t64.safetensors").config.posemb == "sincos2d"


@pytest.mark.parametrize("wrapper", ["state_dict_ema", "model_ema", "model+state_dict"])
def test_wrapped_checkpoints_find_their_tensors(tmp_path, wrapper):
    """`{"state_dict_ema": sd}` (timm's train.py) and `{"model_ema": sd}` (DeiT) said "holds no tensors"; so did a
    "model" entry holding settings next to "state_dict"."""
    model = tiny()
    sd = model.state_dict()
    obj = {"model": {"arch": "vit"}, "state_dict": sd} if wrapper == "model+state_dict" else {wrapper: sd, "epoch": 3}
    torch.save(obj, tmp_path / "ckpt.pth")
    back = vitlab.load(tmp_path / "ckpt.pth", heads=2, classifier="token")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in sd.items())


def test_raw_weights_win_over_ema_next_to_them(tmp_path):
    sd = tiny().state_dict()
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()},
                "state_dict_ema": {k: v * 0 for k, v in sd.items()}}, tmp_path / "ckpt.pth")
    back = vitlab.load(tmp_path / "ckpt.pth", heads=2, classifier="token")
    assert torch.equal(back.state_dict()["head.weight"], sd["head.weight"])


def test_hf_folder_with_two_weight_sets_loads_what_transformers_loads():
    """vitlab read the pytorch_model.bin shards (an index won) where transformers reads model.safetensors."""
    want = torch.tensor(json.loads((FIX / "expected.json").read_text())["hf_safetensors_and_bin_shards"])
    model = vitlab.load(FIX / "hf_safetensors_and_bin_shards")
    x = torch.linspace(-1, 1, 3 * 16 * 16).reshape(1, 3, 16, 16)
    with torch.no_grad():
        got = model(x)[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())), (got, want)


def test_hf_export_keeps_a_centre_crop_at_384(tmp_path, capsys):
    """The crop was written as ViTImageProcessor's plain resize, with a note; ConvNext warps at 384 px and above,
    so it goes to CLIPImageProcessor (the shortest edge, then the crop), which vitlab reads back the same."""
    model = tiny(image_size=384, patch_size=32)
    pre = {"image_size": [384, 384], "mean": [0.5] * 3, "std": [0.5] * 3, "resize": 416,
           "interpolation": "bicubic", "channels": 3}
    save_native(model, tmp_path / "n", preprocess=pre)
    convert(tmp_path / "n", tmp_path / "hf", "--to", "hf")
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "(H - h) // 2" in notes[0]  # only the crop's place (tests/test_crop_offset.py)
    written = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert (written["image_processor_type"], written["size"]) == ("CLIPImageProcessor", {"shortest_edge": 416})
    back = vitlab.weights.load_with_meta(tmp_path / "hf")[1]["preprocess"]
    assert (back.resize, back.image_size, back.crop_mode, back.interpolation) == (416, (384, 384), "center", "bicubic")
    assert back.crop_offset == "floor"  # as transformers places it
    save_native(model, tmp_path / "plain")  # the official plain resize: nothing to say
    convert(tmp_path / "plain", tmp_path / "hf2", "--to", "hf")
    assert "note:" not in capsys.readouterr().out and not (tmp_path / "hf2" / "README.md").exists()
