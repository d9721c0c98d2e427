"""Pillow's nearest, box, hamming and lanczos filters, which torch has no counterpart of, resized as Pillow resizes.

timm's evaluation and Hugging Face's processors (PIL backend) call `PIL.Image.resize`. vitlab ran a model whose
preprocessing named nearest or box (Hugging Face `resample` 0 and 4) through torch's `nearest` and `area`, which
pick and average other pixels (tens of grey levels apart), and lanczos and hamming (1 and 5) as bicubic. Checked
here against Pillow itself and against transformers' own processor."""

import numpy as np
import pytest
import torch
from PIL import Image
from tests.test_crop_mode import tiny_vit
from tests.test_crop_offset import hf_folder, pil_processor

from vitlab.data.images import StoredSquare
from vitlab.data.pillow_resize import PILLOW_FILTERS, pillow_resize
from vitlab.data.preprocess import INTERPOLATIONS, Preprocess, resize_batch
from vitlab.weights import load_with_meta, save_hf
from vitlab.weights.hf import hf_processor

CODES = {"nearest": Image.NEAREST, "box": Image.BOX, "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


def noise_photo(h, w, seed=0):
    """Noise: where resize filters differ most (on smooth gradients most agree within a level)."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def as_batch(a):
    return torch.from_numpy(a).permute(2, 0, 1)[None].float()


# shrink both sides by whole and by odd ratios, grow, grow one side while shrinking the other, one pixel
SIZES = [((64, 48), (16, 16)), ((100, 37), (16, 16)), ((7, 5), (3, 11)), ((31, 200), (50, 40)), ((9, 7), (1, 1))]


@pytest.mark.parametrize("name", list(CODES))
@pytest.mark.parametrize("shape, size", SIZES)
def test_a_batch_is_resized_to_pillows_pixels(name, shape, size):
    a = noise_photo(*shape)
    expected = np.asarray(Image.fromarray(a).resize(size[::-1], CODES[name]), dtype=np.float32)
    got = pillow_resize(as_batch(a), size, name)[0].permute(1, 2, 0).numpy()
    assert np.array_equal(got, expected)


def test_values_that_are_not_8_bit_pixels_take_pillows_float_arithmetic():
    a = np.random.default_rng(1).uniform(0, 255, (40, 30)).astype(np.float32)
    expected = np.asarray(Image.fromarray(a, "F").resize((12, 17), Image.LANCZOS))
    got = pillow_resize(torch.from_numpy(a)[None, None], (17, 12), "lanczos")[0, 0].numpy()
    assert np.array_equal(got, expected)


def test_resize_batch_takes_pillow_for_its_filters_and_keeps_torchs_area():
    a = as_batch(noise_photo(64, 45))
    for name in CODES:
        assert name in INTERPOLATIONS
        assert torch.equal(resize_batch(a, (16, 16), name), pillow_resize(a, (16, 16), name))
    # torch's area (vitlab's own name, not a Pillow filter) stays torch's; box is another window at 45 -> 16
    assert (resize_batch(a, (16, 16), "area") - resize_batch(a, (16, 16), "box")).abs().max() > 5


@pytest.mark.parametrize("name", list(CODES))
def test_evaluations_stored_square_is_predicts_photo(name):
    """evaluate and inspect store a file photo through PIL, predict resizes a tensor: the same pixels."""
    photo = Image.fromarray(noise_photo(50, 37, seed=2))
    stored = StoredSquare(interpolation=name).tensor(photo, 20)
    predicted = Preprocess(image_size=(20, 20), resize=20, interpolation=name, mean=0.0, std=1.0)(photo)
    assert torch.equal(stored.float() / 255.0, predicted)


@pytest.mark.parametrize("code", [0, 1, 4, 5])
def test_a_hugging_face_folder_gives_transformers_pixels_for_every_pil_filter(tmp_path, code):
    transformers = pytest.importorskip("transformers")
    processor = pil_processor(transformers, "ViTImageProcessor")(
        size={"height": 16, "width": 16}, resample=code, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    folder = hf_folder(tmp_path, tiny_vit(), processor)
    pre = load_with_meta(folder)[1]["preprocess"]
    photo = Image.fromarray(noise_photo(45, 38, seed=code))
    ref = processor(photo, return_tensors="pt")["pixel_values"][0]
    assert (pre(photo) - ref).abs().max().item() < 1e-5  # the same 8-bit pixels; only float rounding after


@pytest.mark.parametrize("name, code", [("nearest", 0), ("lanczos", 1), ("box", 4), ("hamming", 5)])
def test_a_hugging_face_export_writes_the_pil_filter_back(tmp_path, name, code):
    model = tiny_vit()
    pre = Preprocess(image_size=(16, 16), interpolation=name)
    assert hf_processor(model.config, pre.to_dict())["resample"] == code
    save_hf(model, tmp_path / "hf", preprocess=pre)
    assert load_with_meta(tmp_path / "hf")[1]["preprocess"].interpolation == name


def test_every_pillow_filter_is_a_vitlab_interpolation():
    assert set(PILLOW_FILTERS) <= set(INTERPOLATIONS)


@pytest.mark.parametrize("name", ["box", "hamming", "lanczos"])
def test_a_timm_folder_keeps_its_pil_filter(tmp_path, name):
    """timm names its evaluation filters as PIL's (`str_to_pil_interp`); a record of these three read as bilinear."""
    from tests.test_weights_timm_preprocess import timm_hub_folder

    _, meta = load_with_meta(timm_hub_folder(tmp_path, 32, crop_pct=0.875, interpolation=name), heads=2)
    assert meta["preprocess"].interpolation == name
