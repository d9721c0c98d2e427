"""Saving weights, three gaps (audit 19):

1. `save_hf` refused every non-square ViT, though transformers' ViTConfig takes `image_size` as [height, width]
   (ViTPatchEmbeddings reads an iterable as (h, w)); a folder transformers wrote with `patch_size: [p, p]` was
   refused as inconsistent, and one with non-square patches was blamed on its config.json. Checked against
   transformers itself: the logits, and the processor's pixels.
2. `vitlab.save` (and `--to hf`, `--to timm`) wrote a model whose head was put in by hand (`nn.Sequential`, a
   Linear without bias) and the folder failed only at load (`save_hf` on a bare KeyError): now one line up front.
3. After `vitlab.train.train`, the returned model kept the loaded file's `preprocess` (its resize, interpolation)
   and no class names (or none at all from scratch), while RUN/model/config.json recorded the run's.
"""

import json

import pytest
import torch
from tests.test_crop_mode import smooth_photo
from tests.test_crop_offset import pil_processor

import vitlab
from vitlab.data.preprocess import Preprocess
from vitlab.weights import load_with_meta, save_hf


def _randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _vit(image_size, num_classes=3, **kw):
    args = dict(dim=32, depth=2, heads=4, mlp_dim=64, patch_size=4, image_size=image_size, num_classes=num_classes)
    return vitlab.create_model("custom", **{**args, **kw})


# ------------------------------------------------------------------------- 1. non-square Hugging Face ViTs
@pytest.mark.parametrize("size", [(16, 32), (32, 16), (12, 20)])
def test_a_non_square_vit_exports_and_transformers_computes_the_same_logits(tmp_path, size):
    transformers = pytest.importorskip("transformers")
    model = _randomise(_vit(size), seed=sum(size))
    save_hf(model, tmp_path / "hf", class_names=["a", "b", "c"])
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["image_size"] == list(size) and written["patch_size"] == 4
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    assert tuple(hf.vit.embeddings.patch_embeddings.image_size) == size
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(pixel_values=x).logits - model(x)).abs().max().item() <= 1e-5
        again = vitlab.load(tmp_path / "hf")  # and back into vitlab at that size
        assert again.config.image_size == size
        assert (again(x) - model(x)).abs().max().item() <= 1e-5


def test_a_non_square_feature_extractor_exports_as_vit_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _randomise(_vit((8, 24), num_classes=0), seed=3)
    save_hf(model, tmp_path / "hf")
    hf = transformers.ViTModel.from_pretrained(tmp_path / "hf", add_pooling_layer=False).eval()
    x = torch.randn(1, 3, 8, 24)
    with torch.no_grad():
        assert (hf(pixel_values=x).last_hidden_state - model.forward_features(x)).abs().max().item() <= 1e-5


# Pillow's own filters (vitlab runs them through Pillow: data.pillow_resize) give transformers' 8-bit pixels
# exactly; bilinear and bicubic run through torch, a level of 255 or so from PIL's (tests/test_crop_offset.py)
LEVELS = {"lanczos": 1e-3, "box": 1e-3, "bilinear": 2.0, "bicubic": 2.0}


@pytest.mark.parametrize("interpolation", list(LEVELS))
def test_the_exported_processor_gives_vitlabs_pixels_at_the_non_square_size(tmp_path, interpolation):
    """preprocessor_config.json's size {"height": 16, "width": 32}: transformers' processor (PIL backend) resizes a
    photo to the pixels of the model's own record and of the record vitlab reads back from the folder."""
    transformers = pytest.importorskip("transformers")
    std = torch.tensor([0.2, 0.25, 0.3])[:, None, None]
    record = Preprocess(image_size=(16, 32), mean=(0.4, 0.5, 0.6), std=tuple(std.flatten().tolist()),
                        interpolation=interpolation)
    save_hf(_vit((16, 32)), tmp_path / "hf", preprocess=record)
    size = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())["size"]
    assert size == {"height": 16, "width": 32}
    processor = pil_processor(transformers, "ViTImageProcessor").from_pretrained(tmp_path / "hf")
    read_back = load_with_meta(tmp_path / "hf")[1]["preprocess"]
    assert read_back.to_dict() == {**record.to_dict(), "crop_offset": read_back.crop_offset}
    for photo in (smooth_photo(45, 38), smooth_photo(30, 90)):
        ref = processor(photo, return_tensors="pt")["pixel_values"][0]
        assert ref.shape == (3, 16, 32)
        for pre in (record, read_back):
            levels = ((pre(photo) - ref) * std * 255).abs().max().item()  # back on the 0..255 scale
            assert levels <= LEVELS[interpolation]


def test_the_export_readme_says_transformers_cannot_interpolate_a_non_square_grid(tmp_path):
    """transformers' interpolate_pos_encoding reshapes the table to a square grid and fails on 4x8: the folder's
    README.md says so, and calling the model at its size (the default) works (the logits test above)."""
    transformers = pytest.importorskip("transformers")
    save_hf(_randomise(_vit((16, 32))), tmp_path / "hf")
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert "16x32" in readme and "interpolate_pos_encoding" in readme and "4x8 grid" in readme
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    with pytest.raises(RuntimeError):
        hf(pixel_values=torch.randn(1, 3, 16, 32), interpolate_pos_encoding=True)
    save_hf(_vit(16), tmp_path / "square")  # a square model needs no note (no README at all)
    assert not (tmp_path / "square" / "README.md").exists()


def _transformers_folder(tmp_path, transformers, image_size, patch_size):
    """A folder transformers itself wrote from its own ViTConfig."""
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                 image_size=image_size, patch_size=patch_size, num_labels=3)
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", hf


def test_a_transformers_folder_with_a_square_patch_pair_loads(tmp_path):
    """config.json `patch_size: [4, 4]` is transformers' own spelling of a 4 px patch: refused before as
    'config.json says patch_size=[4, 4] but the weights hold 4'."""
    transformers = pytest.importorskip("transformers")
    folder, hf = _transformers_folder(tmp_path, transformers, [16, 32], [4, 4])
    assert json.loads((folder / "config.json").read_text())["patch_size"] == [4, 4]
    model = vitlab.load(folder)
    assert model.config.image_size == (16, 32) and model.config.patch_size == 4
    x = torch.randn(2, 3, 16, 32)
    with torch.no_grad():
        assert (hf(pixel_values=x).logits - model(x)).abs().max().item() <= 1e-5


def test_non_square_patches_are_refused_for_what_they_are(tmp_path):
    """transformers builds 4x8 patches; vitlab's patch embedding is square: one line saying that (it blamed the
    folder's config.json as inconsistent)."""
    transformers = pytest.importorskip("transformers")
    folder, _ = _transformers_folder(tmp_path, transformers, [16, 32], [4, 8])
    with pytest.raises(vitlab.VitlabError, match=r"4x8 patches; vitlab builds square patches only") as info:
        vitlab.load(folder)
    assert "\n" not in str(info.value) and "inconsistent" not in str(info.value)
