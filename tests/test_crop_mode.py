"""crop_mode "squash": the whole image resized to R x R before the centre crop, as Hugging Face's DeiT processor
(`size` 256 x 256, crop 224) and timm's crop_mode "squash" compute. vitlab read an int `size` next to a crop as
nothing (a plain resize of the whole photo to the crop size) and a {"height", "width"} size as the shorter side, so
a DeiT checkpoint saw other pixels than in transformers. Checked against transformers' own processor."""

import json

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import save_file
from tests.test_weights_timm_preprocess import timm_hub_folder

import vitlab
from vitlab.data.preprocess import Preprocess
from vitlab.errors import VitlabError
from vitlab.weights import load_with_meta, save_hf
from vitlab.weights import timm as timm_format
from vitlab.weights.hf import preprocess_from_hf
from vitlab.weights.limits import validate_preprocess


def smooth_photo(h, w):
    """Smooth gradients, as photos are: resize kernels (PIL's and torch's) differ on noise, not on this."""
    yy, xx = np.mgrid[0:h, 0:w]
    channels = [xx * 255 // xx.max(), yy * 255 // yy.max(), (xx + yy) * 255 // (xx + yy).max()]
    return Image.fromarray(np.stack(channels, -1).astype(np.uint8))


def squash_then_crop(photo, resize, size, resample):
    """The reference: PIL resizes the whole photo to resize x resize, then the central size x size."""
    top = (resize - size) // 2
    return np.asarray(photo.resize((resize, resize), resample))[top:top + size, top:top + size]


def to_pixels(x):
    return ((x * 0.5 + 0.5) * 255).permute(1, 2, 0).numpy()  # vitlab's [-1, 1] input back to 0..255


def tiny_vit(size=16):
    return vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=size,
                               num_classes=3)


def test_squash_crops_a_wide_photo_after_resizing_it_whole():
    pre = Preprocess(image_size=(16, 16), resize=20, crop_mode="squash", interpolation="bilinear")
    photo = smooth_photo(30, 60)
    expected = squash_then_crop(photo, 20, 16, Image.BILINEAR)
    assert np.abs(to_pixels(pre(photo)) - expected).max() < 2.0
    centre = to_pixels(Preprocess(image_size=(16, 16), resize=20, interpolation="bilinear")(photo))
    assert np.abs(centre - expected).max() > 40  # the shorter-side crop is another picture: the test can tell
    assert pre.storage()["squash"] is True and pre.storage()["model_side"] == 20
    assert Preprocess(image_size=(16, 16), resize=20).storage()["squash"] is False


def test_an_unknown_crop_mode_is_refused_in_one_line():
    with pytest.raises(VitlabError, match="crop_mode must be one of center, squash, got 'border'"):
        Preprocess(image_size=(16, 16), resize=20, crop_mode="border")
    with pytest.raises(VitlabError, match="crop_mode must be one of"):
        validate_preprocess({"image_size": [16, 16], "crop_mode": 3}, tiny_vit().config)


def hf_folder(tmp_path, processor):
    folder = tmp_path / "hf"
    save_hf(tiny_vit(), folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder


DEIT = {"image_processor_type": "DeiTImageProcessor", "do_resize": True, "size": 20, "do_center_crop": True,
        "crop_size": 16, "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


@pytest.mark.parametrize("size", [20, {"height": 20, "width": 20}])
def test_a_deit_folder_gives_transformers_pixels(tmp_path, size):
    transformers = pytest.importorskip("transformers")
    folder = hf_folder(tmp_path, {**DEIT, "size": size})
    _, meta = load_with_meta(folder)
    pre = meta["preprocess"]
    assert (pre.resize, pre.crop_mode, pre.image_size) == (20, "squash", (16, 16))
    processor = getattr(transformers, "DeiTImageProcessorPil", transformers.DeiTImageProcessor)
    photo = smooth_photo(28, 44)
    ref = processor.from_pretrained(folder)(photo, return_tensors="pt")["pixel_values"][0]
    assert (pre(photo) - ref).abs().max().item() < 2.0 / 127.5


def test_a_deit_file_silent_on_the_crop_gets_the_class_defaults():
    pre = preprocess_from_hf({"feature_extractor_type": "DeiTFeatureExtractor"}, vitlab.create_model(
        "custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=16, image_size=224).config)
    assert (pre["resize"], pre["crop_mode"], pre["image_size"], pre["interpolation"]) == \
        (256, "squash", [224, 224], "bicubic")


def test_sizes_as_transformers_reads_them():
    config = tiny_vit().config
    clip = preprocess_from_hf({"image_processor_type": "CLIPImageProcessor", "size": 18, "do_center_crop": True,
                               "crop_size": 16}, config)  # CLIP's int size is the shortest edge
    assert (clip["resize"], clip.get("crop_mode", "center"), clip["image_size"]) == (18, "center", [16, 16])
    edge = preprocess_from_hf({"size": {"shortest_edge": 18}, "do_center_crop": True,
                               "crop_size": {"height": 16, "width": 16}}, config)
    assert (edge["resize"], edge.get("crop_mode", "center")) == (18, "center")
    plain = preprocess_from_hf({"image_processor_type": "ViTImageProcessor", "size": 16}, config)
    assert (plain["resize"], plain["image_size"]) == (None, [16, 16])
    as_is = preprocess_from_hf({"do_resize": False}, config)  # the model takes only its own size: a plain resize
    assert (as_is["resize"], as_is["image_size"]) == (None, [16, 16])


@pytest.mark.parametrize("processor, what", [
    ({"do_resize": False, "do_center_crop": True, "crop_size": 16}, "a centre crop without a resize"),
    ({"size": {"height": 20, "width": 24}, "do_center_crop": True, "crop_size": 16}, "a resize to 20x24"),
    ({"size": {"longest_edge": 20}}, "size {'longest_edge': 20}"),
])
def test_what_vitlab_cannot_reproduce_is_refused_naming_the_file(tmp_path, processor, what):
    folder = hf_folder(tmp_path, processor)
    with pytest.raises(VitlabError, match="preprocessor_config.json: " + what) as err:
        load_with_meta(folder)
    assert "vitlab does not reproduce" in str(err.value) and "\n" not in str(err.value)


def test_a_squash_crop_exports_as_deits_processor_and_reads_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    pre = Preprocess(image_size=(16, 16), resize=20, crop_mode="squash", interpolation="bicubic")
    save_hf(tiny_vit(), tmp_path / "out", preprocess=pre)
    written = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert written["image_processor_type"] == "DeiTImageProcessor" and written["do_center_crop"] is True
    assert not (tmp_path / "out" / "README.md").exists()  # nothing changed, nothing to say (margin 4: floor = round)
    _, meta = load_with_meta(tmp_path / "out")
    assert meta["preprocess"].to_dict() == {**pre.to_dict(), "crop_offset": "floor"}  # transformers' placement
    photo = smooth_photo(40, 24)
    ref = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out")(photo, return_tensors="pt")
    assert (pre(photo) - ref["pixel_values"][0]).abs().max().item() < 2.0 / 127.5


def timm_folder(tmp_path, crop_mode):
    return timm_hub_folder(tmp_path, 32, crop_pct=0.8, interpolation="bilinear", crop_mode=crop_mode)


def test_timms_squash_crop_mode_is_followed(tmp_path):
    _, meta = load_with_meta(timm_folder(tmp_path, "squash"), heads=2)
    pre = meta["preprocess"]
    assert (pre.resize, pre.crop_mode) == (40, "squash")  # floor(32 / 0.8)
    photo = smooth_photo(30, 50)
    assert np.abs(to_pixels(pre(photo)) - squash_then_crop(photo, 40, 32, Image.BILINEAR)).max() < 2.0


def test_timms_border_crop_mode_is_refused(tmp_path):
    with pytest.raises(VitlabError, match="crop_mode 'border' at 32x32 is a preprocessing vitlab does not reproduce"):
        load_with_meta(timm_folder(tmp_path, "border"), heads=2)


def test_a_stored_fractional_image_size_is_refused_not_truncated(tmp_path):
    model = tiny_vit()
    path = timm_format.save_timm(model, tmp_path / "m.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    hints = json.loads(header[timm_format.HINTS_KEY])
    hints["image_size"] = [16.5, 16]
    save_file(tensors, str(path), metadata={**header, timm_format.HINTS_KEY: json.dumps(hints)})
    with pytest.raises(VitlabError, match=r"image_size must be an integer .* got 16\.5"):
        load_with_meta(path)


@pytest.mark.parametrize("layout", ["hf", "timm"])
def test_a_weights_file_that_is_a_folder_is_named_as_such(tmp_path, layout):
    folder = hf_folder(tmp_path, DEIT) if layout == "hf" else timm_folder(tmp_path, "center")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    with pytest.raises(VitlabError, match="model.safetensors is not a regular file"):
        load_with_meta(folder, **({"heads": 2} if layout == "timm" else {}))


@pytest.mark.parametrize("channels", [3, 1])
def test_a_vits_centre_crop_exports_as_clip_and_gives_transformers_vitlabs_pixels(tmp_path, channels):
    """vitlab's training records the centre square (the shorter side to the size, then the crop); `--to hf` wrote
    it as ViTImageProcessor's plain resize, which squashes a wide photo the model only ever saw cropped."""
    transformers = pytest.importorskip("transformers")
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=16,
                                in_chans=channels, num_classes=3)
    pre = Preprocess(image_size=(16, 16), resize=18, interpolation="bicubic", channels=channels,
                     mean=(0.5,) * channels, std=(0.5,) * channels)
    save_hf(model, tmp_path / "out", preprocess=pre)
    written = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert written["image_processor_type"] == "CLIPImageProcessor" and len(written["image_mean"]) == channels
    readme = (tmp_path / "out" / "README.md").read_text()  # the crop's placement (tests/test_crop_offset.py)
    assert "(H - h) // 2" in readme and ("grayscale" in readme) == (channels == 1)
    assert load_with_meta(tmp_path / "out")[1]["preprocess"].to_dict() == {**pre.to_dict(), "crop_offset": "floor"}
    # 48x30 -> 28x18: margins 12 and 2, where transformers' floor((H - h) / 2) and vitlab's round agree (a margin
    # of 3, 7, 11, ... puts them a pixel apart: docs/weights.md)
    photo = smooth_photo(30, 48)
    photo = photo.convert("L") if channels == 1 else photo
    processor = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    ref = processor.from_pretrained(tmp_path / "out")(photo, return_tensors="pt")["pixel_values"][0]
    assert (pre(photo) - ref).abs().max().item() < 2.0 / 127.5
