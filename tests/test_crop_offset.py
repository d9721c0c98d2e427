"""Preprocess.crop_offset: where a centre crop starts when its margin H - h is odd. torchvision's CenterCrop (timm,
vitlab's own training) starts it at round((H - h) / 2), half to even; Hugging Face transformers at (H - h) // 2 in
both its backends. The two are a pixel apart at margins 3, 7, 11, ..., so vitlab predict on a Hugging Face folder
gave other pixels than transformers' own processor for some photo sizes. Checked against transformers itself: each
photo size below leaves such a margin after the resize, and the round placement is shown to be farther off."""

import json

import pytest
import torch
from tests.test_audit16_convert import tiny_resnet
from tests.test_crop_mode import smooth_photo, tiny_vit

import vitlab
from vitlab.cli import main
from vitlab.data import load_data
from vitlab.data.images import open_image
from vitlab.data.preprocess import Preprocess, center_crop_batch, crop_start
from vitlab.errors import VitlabError
from vitlab.weights import load_with_meta, save_hf
from vitlab.weights.limits import validate_preprocess

TOLERANCE = 2.0 / 127.5  # PIL's 8-bit resize against torch's: a level or so (tests/test_crop_mode.py)
ONE_PIXEL_AWAY = 5.0 / 127.5  # the gradients of smooth_photo move about 10 levels of 255 per pixel here


def pil_processor(transformers, kind):
    """The class transformers 5 uses without torchvision (the PIL/numpy backend), else the class itself (4.x)."""
    return getattr(transformers, kind.replace("ImageProcessor", "ImageProcessorPil"), None) or getattr(transformers, kind)


def hf_folder(tmp_path, model, processor):
    """A Hugging Face folder whose preprocessor_config.json transformers itself wrote."""
    folder = tmp_path / "hf"
    save_hf(model, folder)
    (folder / "preprocessor_config.json").unlink()
    processor.save_pretrained(folder)
    return folder


def against_transformers(folder, processor, photo):
    """(vitlab's distance from transformers' pixels, the round placement's distance) for the folder's record."""
    pre = load_with_meta(folder)[1]["preprocess"]
    assert pre.crop_offset == "floor"
    ref = processor(photo, return_tensors="pt")["pixel_values"][0]
    rounded = Preprocess.from_dict({**pre.to_dict(), "crop_offset": "round"})
    assert pre(photo).shape == ref.shape
    return (pre(photo) - ref).abs().max().item(), (rounded(photo) - ref).abs().max().item()


# (shortest edge, photo h x w): after the resize the margins are (7, 4), (4, 7) and (3, 3)
@pytest.mark.parametrize("edge, shape", [(20, (35, 30)), (20, (30, 35)), (19, (40, 40))])
def test_a_clip_folder_gives_transformers_pixels_at_odd_margins(tmp_path, edge, shape):
    transformers = pytest.importorskip("transformers")
    processor = pil_processor(transformers, "CLIPImageProcessor")(
        size={"shortest_edge": edge}, crop_size={"height": 16, "width": 16}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3, do_convert_rgb=False)
    ours, rounded = against_transformers(hf_folder(tmp_path, tiny_vit(), processor), processor, smooth_photo(*shape))
    assert ours < TOLERANCE
    assert rounded > ONE_PIXEL_AWAY  # the placement vitlab used before: the test can tell


def test_a_deit_folder_gives_transformers_pixels_at_margin_3(tmp_path):
    transformers = pytest.importorskip("transformers")
    processor = pil_processor(transformers, "DeiTImageProcessor")(
        size={"height": 19, "width": 19}, crop_size={"height": 16, "width": 16}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3, resample=2)
    ours, rounded = against_transformers(hf_folder(tmp_path, tiny_vit(), processor), processor, smooth_photo(30, 44))
    assert ours < TOLERANCE and rounded > ONE_PIXEL_AWAY


def test_a_convnext_folder_gives_transformers_pixels_at_odd_margins(tmp_path):
    """Hugging Face ResNets ship ConvNext's processor: the shortest edge to int(16 / crop_pct) = 19, crop 16."""
    transformers = pytest.importorskip("transformers")
    processor = pil_processor(transformers, "ConvNextImageProcessor")(
        size={"shortest_edge": 16}, crop_pct=16 / 19, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2)
    folder = hf_folder(tmp_path, tiny_resnet(16), processor)
    ours, rounded = against_transformers(folder, processor, smooth_photo(30, 43))  # 19 x 27: margins 3 and 11
    assert ours < TOLERANCE and rounded > ONE_PIXEL_AWAY


def test_only_a_crop_is_marked_floor():
    from vitlab.weights.hf import preprocess_from_hf

    config = tiny_vit().config
    plain = preprocess_from_hf({"image_processor_type": "ViTImageProcessor", "size": 16}, config)
    assert plain.get("crop_offset", "round") == "round"  # no crop: nothing to place, the record as before
    crop = preprocess_from_hf({"size": {"shortest_edge": 18}, "do_center_crop": True, "crop_size": 16}, config)
    assert crop["crop_offset"] == "floor"


def test_crop_start_at_every_margin():
    assert [crop_start(m, "round") for m in range(12)] == [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6]
    assert [crop_start(m, "floor") for m in range(12)] == [m // 2 for m in range(12)]
    x = torch.arange(23.0).view(1, 1, 1, 23)  # margin 7: columns 4.. (round) or 3.. (floor)
    assert center_crop_batch(x, (1, 16))[..., 0].item() == 4
    assert center_crop_batch(x, (1, 16), "floor")[..., 0].item() == 3


def test_floor_is_kept_in_config_json_and_a_file_without_it_reads_round(tmp_path):
    model = tiny_vit()
    record = Preprocess(image_size=(16, 16), resize=20, crop_offset="floor")
    vitlab.save(model, tmp_path / "m", preprocess=record)
    stored = json.loads((tmp_path / "m" / "config.json").read_text())
    assert stored["preprocess"]["crop_offset"] == "floor"
    assert load_with_meta(tmp_path / "m")[1]["preprocess"] == record
    del stored["preprocess"]["crop_offset"]  # a config.json written before the field existed
    (tmp_path / "m" / "config.json").write_text(json.dumps(stored))
    back = load_with_meta(tmp_path / "m")[1]["preprocess"]
    assert back.crop_offset == "round" and back == Preprocess(image_size=(16, 16), resize=20)


def test_an_unknown_crop_offset_is_refused_in_one_line(tmp_path):
    with pytest.raises(VitlabError, match="crop_offset must be one of round, floor, got 'ceil'"):
        Preprocess(image_size=(16, 16), resize=20, crop_offset="ceil")
    with pytest.raises(VitlabError, match="crop_offset must be one of"):
        validate_preprocess({"image_size": [16, 16], "crop_offset": 3}, tiny_vit().config)
    vitlab.save(tiny_vit(), tmp_path / "m")
    stored = json.loads((tmp_path / "m" / "config.json").read_text())
    stored["preprocess"]["crop_offset"] = "middle"
    (tmp_path / "m" / "config.json").write_text(json.dumps(stored))
    with pytest.raises(VitlabError, match="crop_offset must be one of .*'middle'") as err:
        load_with_meta(tmp_path / "m")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("interpolation", ["bilinear", "area"])  # PIL's storage path, and torch's
def test_stored_photos_are_the_crop_predict_takes_for_a_floor_model(tmp_path, interpolation):
    """115x100 photos -> 55x48 (stored square 48: margin 7), then the crop 40: the stored square must start where
    the record's crop starts, or evaluate scores photos a pixel off those predict gives the model."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "photos" / c).mkdir(parents=True)
        for i in range(2):  # noise: a one-pixel shift shows everywhere
            Image.fromarray(rng.integers(0, 256, (100, 115, 3), dtype=np.uint8)).save(tmp_path / "photos" / c / f"{i}.png")
    pre = Preprocess(image_size=(40, 40), resize=48, interpolation=interpolation, crop_offset="floor")
    stored = load_data(str(tmp_path / "photos"), progress=False, **pre.storage()).train
    rounded = load_data(str(tmp_path / "photos"), progress=False, **{**pre.storage(), "crop_offset": "round"}).train
    assert stored.image_size == (48, 48)
    for i in range(len(stored)):
        predicted = pre(open_image(stored.paths[i]))
        assert (pre.batch(stored.images[i:i + 1])[0] - predicted).abs().max() < 1 / 127.5  # 8-bit storage
        assert (pre.batch(rounded.images[i:i + 1])[0] - predicted).abs().max() > 10 / 127.5


def test_the_hf_export_of_a_floor_record_is_exact_and_a_round_one_says_so(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    photo = smooth_photo(35, 30)  # 23 x 20: a margin of 7
    for offset in ("floor", "round"):
        pre = Preprocess(image_size=(16, 16), resize=20, crop_offset=offset)
        vitlab.save(tiny_vit(), tmp_path / offset, preprocess=pre)
        assert main(["convert", str(tmp_path / offset), str(tmp_path / f"hf-{offset}"), "--to", "hf"]) == 0
        notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
        readme = tmp_path / f"hf-{offset}" / "README.md"
        processor = pil_processor(transformers, "CLIPImageProcessor").from_pretrained(tmp_path / f"hf-{offset}")
        gap = (pre(photo) - processor(photo, return_tensors="pt")["pixel_values"][0]).abs().max().item()
        if offset == "floor":
            assert not notes and not readme.exists() and gap < TOLERANCE
        else:
            assert len(notes) == 1 and "(H - h) // 2" in notes[0] and "(H - h) // 2" in readme.read_text()
            assert gap > ONE_PIXEL_AWAY  # what the note is about


def test_a_squash_whose_margins_are_even_is_exported_without_a_note(tmp_path):
    save_hf(tiny_vit(), tmp_path / "even", preprocess=Preprocess(image_size=(16, 16), resize=20, crop_mode="squash"))
    assert not (tmp_path / "even" / "README.md").exists()  # margin 4: floor and round agree
    save_hf(tiny_vit(), tmp_path / "odd", preprocess=Preprocess(image_size=(16, 16), resize=19, crop_mode="squash"))
    assert "(H - h) // 2" in (tmp_path / "odd" / "README.md").read_text()


def test_the_timm_export_of_a_floor_record_says_timm_cannot_place_it(tmp_path, capsys):
    for offset in ("floor", "round"):
        vitlab.save(tiny_vit(), tmp_path / offset,
                    preprocess=Preprocess(image_size=(16, 16), resize=20, crop_offset=offset))
        assert main(["convert", str(tmp_path / offset), str(tmp_path / f"{offset}.safetensors"), "--to", "timm"]) == 0
        said = "timm's transforms cannot" in capsys.readouterr().out
        assert said == (offset == "floor")
        assert load_with_meta(tmp_path / f"{offset}.safetensors")[1]["preprocess"].crop_offset == offset  # exact
