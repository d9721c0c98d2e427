"""The official ViT and BiT evaluation shrinks images with TensorFlow's `tf.image.resize` (bilinear, no
anti-aliasing). Checked against TensorFlow's own output (tests/fixtures/tf_resize, made by make_fixture.py with
TensorFlow 2.21): the official checkpoints' records ask for it, predict and evaluate give the model that input."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tests.test_audit14_official import _write

from vitlab.data import load_data
from vitlab.data.preprocess import Preprocess
from vitlab.errors import VitlabError
from vitlab.weights import load_with_meta, read_checkpoint

FIX = Path(__file__).parent / "fixtures" / "tf_resize"
EXPECTED = dict(np.load(FIX / "expected.npz"))
SHRUNK = ["wide", "large", "tall"]  # "small" is enlarged, where anti-aliasing changes nothing


def _official(side: int, antialias: bool = False) -> Preprocess:
    return Preprocess(image_size=(side, side), antialias=antialias)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preprocess_without_antialias_is_tf_image_resize(name):
    want = EXPECTED[name]
    side = want.shape[0]
    got = _official(side)(Image.open(FIX / f"{name}.png")).permute(1, 2, 0).numpy()
    assert np.abs(got - want).max() < 2e-5  # float32 rounding of the same arithmetic


@pytest.mark.parametrize("name", SHRUNK)
def test_antialiased_resize_is_not_the_official_input(name):
    """Guard: the fixture does tell the two apart where an image is shrunk."""
    want = EXPECTED[name]
    got = _official(want.shape[0], antialias=True)(Image.open(FIX / f"{name}.png")).permute(1, 2, 0).numpy()
    assert np.abs(got - want).max() > 0.1


def test_official_and_big_transfer_records_ask_for_tf_resize(tmp_path):
    _, _, meta = read_checkpoint(_write(tmp_path, "token_rep"))
    assert meta["preprocess"]["antialias"] is False
    from vitlab.models.bit import BiTResNet
    from vitlab.models.config import ResNetConfig, ViTConfig
    from vitlab.weights import big_transfer

    config = ViTConfig(arch="resnet", resnet=ResNetConfig(layers=(1, 1), base_width=32, kind="bit", stem="small"),
                       num_classes=3, image_size=16, patch_size=1)
    path = big_transfer.write_big_transfer(BiTResNet(config), tmp_path / "bit")
    assert read_checkpoint(path)[2]["preprocess"]["antialias"] is False
    model, meta = load_with_meta(_write(tmp_path, "token_rep"), image_size=48)
    assert isinstance(meta["preprocess"], Preprocess) and meta["preprocess"].antialias is False


def _stored(root: Path, in_memory: bool, **storage) -> dict[str, np.ndarray]:
    """Each stored training image of `root` as the model's input (H, W, C), by file name."""
    splits = load_data(str(root), progress=False, val_fraction=0.0, test_fraction=0.0, in_memory=in_memory,
                       **storage)
    train = splits.train
    out = {}
    for i in range(len(train)):
        image, label = train[i]
        out.setdefault(label, []).append(_official(48).batch(image.unsqueeze(0))[0].permute(1, 2, 0).numpy())
    return out


def test_stored_photos_are_the_official_input_but_for_8_bits(tmp_path):
    """evaluate stores a file photo as its model's preprocessing would make it: in one resize to the model's side
    (not 113 px, the photos' median, and then 48), without anti-aliasing: TensorFlow's resize rounded to 8 bits."""
    root = tmp_path / "data"
    names = ["wide", "tall"]  # shrunk to 48
    for k, name in enumerate(names):
        (root / f"c{k}_{name}").mkdir(parents=True)
        for copy in range(2):
            Image.open(FIX / f"{name}.png").save(root / f"c{k}_{name}" / f"{copy}.png")
    for in_memory in (True, False):
        stored = _stored(root, in_memory, **_official(48).storage())
        for k, name in enumerate(names):
            for got in stored[k]:
                assert got.shape == (48, 48, 3)
                assert np.abs(got - EXPECTED[name]).max() <= 0.5 / 127.5 + 1e-5
    # guards: anti-aliased storage, or storage at the median side resized again, is another input
    for storage in ({"model_side": 48, "squash": True, "shrink_to_model": True},
                    {"model_side": 48, "squash": True, "antialias": False}):
        stored = _stored(root, False, **storage)
        assert max(np.abs(got - EXPECTED[name]).max() for k, name in enumerate(names) for got in stored[k]) > 0.1


def test_record_round_trip_and_one_line_refusals():
    pre = _official(48)
    assert Preprocess.from_dict(pre.to_dict()) == pre
    old = {k: v for k, v in pre.to_dict().items() if k != "antialias"}  # a record written before the field
    assert Preprocess.from_dict(old).antialias is True
    with pytest.raises(VitlabError, match="antialias must be true or false"):
        Preprocess.from_dict({**pre.to_dict(), "antialias": "false"})
    from vitlab.models.config import ViTConfig
    from vitlab.weights.limits import validate_preprocess

    with pytest.raises(VitlabError, match="antialias must be true or false"):
        validate_preprocess({**pre.to_dict(), "antialias": "no"}, ViTConfig(image_size=48, patch_size=8), "x.npz")


def test_hf_export_says_it_anti_aliases():
    from vitlab.models.config import ViTConfig
    from vitlab.weights.hf import export_notes

    config = ViTConfig(image_size=48, patch_size=8)
    assert any("without anti-aliasing" in n for n in export_notes(config, _official(48).to_dict()))
    assert not any("anti-alias" in n for n in export_notes(config, _official(48, antialias=True).to_dict()))


def test_tensor_input_takes_the_same_path():
    image = torch.from_numpy(np.array(Image.open(FIX / "wide.png"))).permute(2, 0, 1)
    got = _official(48)(image).permute(1, 2, 0).numpy()
    assert np.abs(got - EXPECTED["wide"]).max() < 2e-5
