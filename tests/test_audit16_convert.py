"""Conversion audit (audit 16): every format vitlab writes, read back (and by transformers where it is installed),
must give the same model and the same preprocessing, or say in one line (or the export's note) what it cannot keep.

A standard ResNet's `--to hf` wrote every preprocessing record as a ConvNextImageProcessor, which turned a plain
resize into a shorter-side resize + crop, a squash into a shorter-side resize, lost a crop fraction, a non-square
size and a crop at 384 px or more, read a resize of 50 before a 34 px crop back as 49 (crop_pct rounding), and
dropped `antialias=False`, all without a word."""

import json

import pytest
import torch
from tests.test_crop_mode import smooth_photo

import vitlab
from vitlab.cli import main
from vitlab.data.preprocess import Preprocess
from vitlab.weights import load_with_meta, save_hf, save_native


def tiny_resnet(size=32):
    torch.manual_seed(0)
    return vitlab.create_model("resnet-18", num_classes=3, image_size=size,
                               resnet={"base_width": 8, "layers": (1, 1)}).eval()


RESNET_RECORDS = {
    "plain": Preprocess(image_size=(32, 32)),
    "squash": Preprocess(image_size=(32, 32), resize=36, crop_mode="squash"),
    "crop fraction": Preprocess(image_size=(32, 32), crop_fraction=0.875),
    "crop 34 of 50": Preprocess(image_size=(34, 34), resize=50),  # int(34 / (34 / 50)) is 49
    "crop": Preprocess(image_size=(32, 32), resize=36, interpolation="bicubic"),
    "non-square crop": Preprocess(image_size=(32, 48), resize=40),  # ConvNext crops squares only: CLIP's
    "crop at 384": Preprocess(image_size=(384, 384), resize=438),  # ConvNext warps at 384: CLIP's
}


@pytest.mark.parametrize("record", RESNET_RECORDS.values(), ids=RESNET_RECORDS.keys())
def test_a_resnet_hf_export_keeps_its_preprocessing(tmp_path, record):
    save_hf(tiny_resnet(record.image_size[0]), tmp_path / "hf", preprocess=record)
    _, meta = load_with_meta(tmp_path / "hf")
    back = meta["preprocess"]
    assert (back.effective_resize, back.crop_mode, back.image_size, back.interpolation) == \
        (record.effective_resize, record.crop_mode, record.image_size, record.interpolation)
    photo = smooth_photo(45, 60)
    assert torch.equal(back(photo), record(photo))
    readme = tmp_path / "hf" / "README.md"
    # nothing lost, nothing to say, but for a crop: transformers places it at floor (tests/test_crop_offset.py)
    notes = readme.read_text().split("\n\n")[1:] if readme.exists() else []
    assert len(notes) == record.crop_offset_matters and all("(H - h) // 2" in n for n in notes)


@pytest.mark.parametrize("record", RESNET_RECORDS.values(), ids=RESNET_RECORDS.keys())
def test_a_resnet_hf_export_gives_transformers_the_same_pixels(tmp_path, record):
    transformers = pytest.importorskip("transformers")
    save_hf(tiny_resnet(record.image_size[0]), tmp_path / "hf", preprocess=record)
    kind = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())["image_processor_type"]
    processor = getattr(transformers, kind.replace("ImageProcessor", "ImageProcessorPil"), None) \
        or getattr(transformers, kind)
    photo = smooth_photo(45, 60)
    ref = processor.from_pretrained(tmp_path / "hf")(photo, return_tensors="pt")["pixel_values"][0]
    assert ref.shape == record(photo).shape
    assert (record(photo) - ref).abs().max().item() < 2.0 / 127.5  # PIL's 8-bit resize: a level or so apart


@pytest.mark.parametrize("size, record, words", [
    (32, Preprocess(image_size=(32, 32), resize=36, antialias=False), "without anti-aliasing"),
])
def test_what_a_resnet_hf_export_cannot_keep_is_said(tmp_path, capsys, size, record, words):
    save_native(tiny_resnet(size), tmp_path / "src", preprocess=record)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert any(line.startswith("note: ") and words in line for line in capsys.readouterr().out.splitlines())
    assert words in (tmp_path / "hf" / "README.md").read_text()
    back = load_with_meta(tmp_path / "hf")[1]["preprocess"]
    assert back.image_size == record.image_size  # the size itself is kept (it was cut to a square before)


def tiny_vit():
    torch.manual_seed(0)
    return vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=16,
                               num_classes=3).eval()


def test_a_forced_hf_export_leaves_no_earlier_notes_behind(tmp_path):
    """README.md held the notes of the model exported there before (a resize it no longer has) after `--force`."""
    save_native(tiny_vit(), tmp_path / "crop", preprocess=Preprocess(image_size=(16, 16), antialias=False))
    save_native(tiny_vit(), tmp_path / "plain", preprocess=Preprocess(image_size=(16, 16)))
    out = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "crop"), str(out), "--to", "hf", "--quiet"]) == 0
    assert "without anti-aliasing" in (out / "README.md").read_text()
    assert main(["convert", str(tmp_path / "plain"), str(out), "--to", "hf", "--quiet", "--force"]) == 0
    assert not (out / "README.md").exists()
    (out / "README.md").write_text("# my model card\n")  # a README of the user's own is not vitlab's to remove
    assert main(["convert", str(tmp_path / "plain"), str(out), "--to", "hf", "--quiet", "--force"]) == 0
    assert (out / "README.md").read_text() == "# my model card\n"


def test_a_squash_by_crop_fraction_goes_to_deit_whole(tmp_path):
    """Preprocess(crop_fraction=0.8, crop_mode="squash") squashes to floor(16 / 0.8) = 20 before the crop, as
    resize=20 does; the HF export wrote it as a plain resize to 16 (with a crop note) instead of DeiT's processor."""
    record = Preprocess(image_size=(16, 16), crop_fraction=0.8, crop_mode="squash")
    save_hf(tiny_vit(), tmp_path / "hf", preprocess=record)
    written = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert (written["image_processor_type"], written["size"]) == ("DeiTImageProcessor", {"height": 20, "width": 20})
    back = load_with_meta(tmp_path / "hf")[1]["preprocess"]
    assert (back.effective_resize, back.crop_mode) == (20, "squash")
    photo = smooth_photo(45, 60)
    assert torch.equal(back(photo), record(photo))
    assert not (tmp_path / "hf" / "README.md").exists()


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_timm_export_without_a_record_reads_back_as_vitlab_save_would(tmp_path, suffix):
    """`save_timm(model, path)` stored no preprocessing, so vitlab read its own export back with timm's defaults
    (bicubic, a 0.9 crop) where `vitlab.save` records the plain resize; both now give the same record."""
    from vitlab.weights import save_timm

    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=16,
                                num_classes=3)
    save_native(model, tmp_path / "native")
    path = save_timm(model, tmp_path / f"m{suffix}")
    assert load_with_meta(path)[1]["preprocess"].to_dict() == \
        load_with_meta(tmp_path / "native")[1]["preprocess"].to_dict()
