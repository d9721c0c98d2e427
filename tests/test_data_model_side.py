"""File images are stored as squares of at most 256 px, unless the model that reads them takes more: a 384-px
model (a 384 checkpoint, --image-size 384) read photos stored at 256 and enlarged again, blurred by storage."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vitlab.data import Preprocess, load_data
from vitlab.data.files import choose_storage_size
from vitlab.errors import VitlabError
from vitlab.train.config import TrainConfig
from vitlab.train.setup import training_side


def _photos(root, side=(400, 300), per_class=10):
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (side[1], side[0], 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    return root


def test_storage_cap_rises_to_the_model_side_but_never_above_the_images():
    sizes = [(400, 300)] * 5
    assert choose_storage_size(sizes) == 256  # the default cap
    assert choose_storage_size(sizes, model_side=384) == 300  # no larger than the images themselves
    assert choose_storage_size([(800, 600)] * 5, model_side=384) == 384
    assert choose_storage_size(sizes, model_side=128) == 256  # a small model does not lower the cap
    assert choose_storage_size(sizes, requested=64, model_side=384) == 64  # an explicit size wins


def test_load_data_stores_photos_at_the_side_the_model_reads(tmp_path):
    root = _photos(tmp_path / "photos", side=(600, 450))
    assert load_data(str(root), progress=False).train.image_size == (256, 256)
    data = load_data(str(root), progress=False, model_side=384)
    assert data.train.image_size == (384, 384) and data.test.image_size == (384, 384)


def test_model_side_of_a_preprocessing():
    assert Preprocess(image_size=384).model_side == 384  # the official plain resize
    assert Preprocess(image_size=224, resize=248).model_side == 248  # timm: shorter side 248, then the crop
    assert Preprocess(image_size=224, crop_fraction=0.875).model_side == 256
    assert Preprocess(image_size=(224, 448)).model_side == 448


def test_training_reads_its_side_from_the_flags_or_the_checkpoint(tmp_path):
    import vitlab

    assert training_side(TrainConfig(data="bundled", image_size=None)) is None
    assert training_side(TrainConfig(data=str(tmp_path), image_size=384)) == 384
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=16, image_size=320,
                                num_classes=3)
    vitlab.save(model, tmp_path / "ckpt")
    assert training_side(TrainConfig(data=str(tmp_path / "photos"), weights=str(tmp_path / "ckpt"))) == 320
    assert training_side(TrainConfig(data="bundled", weights=str(tmp_path / "ckpt"))) is None  # fixed-size data
    assert training_side(TrainConfig(data=str(tmp_path), weights=str(tmp_path / "missing"))) is None


def test_a_finetuning_run_reads_its_checkpoint_once(tmp_path, monkeypatch):
    """The checkpoint's size decides how the photos are stored, then its weights build the model: the file was
    read in full for each (a ViT-H checkpoint is gigabytes). The photos are still stored at its side."""
    import vitlab
    import vitlab.data
    import vitlab.weights
    from vitlab.train import train
    from vitlab.train.config import resolve_config

    root = _photos(tmp_path / "photos", side=(60, 48), per_class=6)
    vitlab.save(vitlab.create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=8, image_size=40,
                                    num_classes=3), tmp_path / "ckpt")
    reads = []
    real = vitlab.weights.read_checkpoint

    def counted(*args, **kwargs):
        reads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(vitlab.weights, "read_checkpoint", counted)
    sides = []
    real_load = vitlab.data.load_data
    monkeypatch.setattr(vitlab.data, "load_data", lambda *a, **k: sides.append(k["model_side"]) or real_load(*a, **k))
    cfg = resolve_config("finetune", overrides=dict(data=str(root), weights=str(tmp_path / "ckpt"), steps=1,
                                                    batch_size=4, out_dir=str(tmp_path), name="r", quiet=True,
                                                    precision="fp32", device="cpu"))
    train(cfg)
    assert len(reads) == 1, reads
    assert sides == [40]  # the photos stored at the checkpoint's side

    # a file that does not read is not tried again for the size: once there, once by the model load, whose own
    # error the user gets (a weights name not cached offline waits on the network each time)
    reads.clear()
    cfg = resolve_config("finetune", overrides=dict(data=str(root), weights=str(tmp_path / "missing"), steps=1,
                                                    batch_size=4, out_dir=str(tmp_path), name="r2", quiet=True,
                                                    precision="fp32", device="cpu"))
    with pytest.raises(VitlabError):
        train(cfg)
    assert len(reads) == 2, reads


@pytest.mark.parametrize("flag", [[], ["--image-size", "320"]])
def test_evaluate_stores_at_the_models_side(tmp_path, flag, capsys):
    import json

    import vitlab
    from vitlab.cli import main

    root = _photos(tmp_path / "photos", side=(500, 400))
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=16, image_size=320,
                                num_classes=2)
    vitlab.save(model, tmp_path / "m", class_names=["a", "b"])
    assert main(["evaluate", str(tmp_path / "m"), "--data", str(root), "--out", str(tmp_path / "ev"), "--quiet",
                 *flag]) == 0
    info = json.loads((tmp_path / "ev" / "metrics.json").read_text())["info"]
    assert info["data_image_size"] == [320, 320]  # the photos (400 px shorter side) stored at 320, not 256


def _wide_photo(root):
    """Two classes of 90x30 photos whose left and right thirds are bright, the middle dark: a centre square sees
    only the dark part, the whole image squashed sees both."""
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(10):
            arr = np.zeros((30, 90, 3), dtype=np.uint8)
            arr[:, :30] = arr[:, 60:] = 200 + i
            Image.fromarray(arr).save(root / c / f"{i}.png")
    return root


def test_squash_stores_the_whole_image_for_a_plain_resize_model(tmp_path):
    root = _wide_photo(tmp_path / "wide")
    cropped = load_data(str(root), progress=False).train
    squashed = load_data(str(root), progress=False, squash=True).train
    assert cropped.image_size == squashed.image_size == (30, 30)
    assert cropped.images.float().mean() < 5  # the dark middle only
    assert squashed.images.float().mean() > 100  # the bright sides too
    streamed = load_data(str(root), progress=False, squash=True, in_memory=False)
    assert streamed.train.subset([0, 1])[0][0].float().mean() > 100  # kept through copies, when streaming


@pytest.mark.parametrize("squash_crop", [False, True])
def test_evaluate_gives_a_plain_resize_model_the_photo_predict_gives_it(tmp_path, monkeypatch, squash_crop):
    """An official-style model (plain resize) scored the centre square of a wide photo in `vitlab evaluate` and
    the whole photo squashed in `vitlab predict`: the same file, another input, other answers. Also for a
    squash before a crop (HF's DeiT processor): evaluate stores the whole photo squashed to the resize side."""
    import vitlab
    from vitlab.data.images import open_image
    from vitlab.data.preprocess import Preprocess
    from vitlab.weights import load_with_meta

    root = _wide_photo(tmp_path / "wide")
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=15, image_size=30,
                                num_classes=2)
    record = Preprocess(image_size=(30, 30), resize=36, crop_mode="squash") if squash_crop else None
    vitlab.save(model, tmp_path / "m", class_names=["a", "b"], preprocess=record)  # default: a plain resize
    pre = load_with_meta(tmp_path / "m")[1]["preprocess"]
    assert pre.squashes and pre.model_side == (36 if squash_crop else 30)
    test = _evaluated_test_split(tmp_path / "m", root, tmp_path / "ev", monkeypatch)
    evaluated = pre.batch(test.images[:1])[0]
    predicted = pre(open_image(test.paths[0]))
    assert (evaluated - predicted).abs().mean() < 0.05  # the same photo, squashed both ways


@pytest.mark.parametrize("interpolation", ["bicubic", "nearest", "area"])
def test_stored_photos_are_resized_with_the_models_filter(tmp_path, interpolation):
    """File data was stored with PIL's bilinear whatever the model's filter, so a bicubic model (timm's ViTs, DeiT)
    was evaluated on other pixels than `vitlab predict` gives it from the same file."""
    from vitlab.data.images import open_image

    root = _photos(tmp_path / "photos", side=(150, 100), per_class=2)  # noise: the filters differ most on it
    pre = Preprocess(image_size=(40, 40), resize=50, interpolation=interpolation, crop_mode="squash")
    stored = load_data(str(root), progress=False, **pre.storage()).train
    bilinear = load_data(str(root), progress=False, **{**pre.storage(), "interpolation": "bilinear"}).train
    for i in range(len(stored)):
        predicted = pre(open_image(stored.paths[i]))
        assert (pre.batch(stored.images[i:i + 1])[0] - predicted).abs().max() < 1 / 127.5  # 8-bit storage
        assert (pre.batch(bilinear.images[i:i + 1])[0] - predicted).abs().max() > 10 / 127.5


def _evaluated_test_split(model, data, out, monkeypatch):
    """The test split exactly as `vitlab evaluate MODEL --data DATA` stored it (its load_splits, watched)."""
    from vitlab.cli import main
    from vitlab.commands import evaluate as evaluate_command

    seen = {}
    real = evaluate_command.load_splits

    def spy(*args, **kwargs):
        seen["data"] = real(*args, **kwargs)
        return seen["data"]

    monkeypatch.setattr(evaluate_command, "load_splits", spy)
    assert main(["evaluate", str(model), "--data", str(data), "--out", str(out), "--quiet", "--engine", "torch"]) == 0
    return seen["data"].test


@pytest.mark.parametrize("resize", [48, 50, 51])
@pytest.mark.parametrize("crop_offset", ["round", "floor"])
def test_evaluate_stores_the_crop_where_predict_takes_it(tmp_path, monkeypatch, crop_offset, resize):
    """A Hugging Face model's crop starts at (H - h) // 2 (Preprocess.crop_offset "floor"), torchvision's at
    round((H - h) / 2): 115x100 photos -> 55x48, a margin of 7 for the stored square, where the two place it a
    pixel apart. `vitlab evaluate` must store the square where the model's own crop puts it. And the model's crop
    is cut from the stored square later: centred twice (57 -> 50 -> 40, 58 -> 51 -> 40) landed a pixel off
    predict's one crop (57 -> 40) unless the inner margin is a multiple of 4 (round) or even (floor)."""
    import vitlab
    from vitlab.data.images import open_image
    from vitlab.weights import load_with_meta

    root = _photos(tmp_path / "photos", side=(115, 100))  # noise: a one-pixel shift shows everywhere
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=8, image_size=40,
                                num_classes=2)
    vitlab.save(model, tmp_path / "m", class_names=["a", "b"],
                preprocess=Preprocess(image_size=(40, 40), resize=resize, crop_offset=crop_offset))
    pre = load_with_meta(tmp_path / "m")[1]["preprocess"]
    assert pre.crop_offset == crop_offset
    test = _evaluated_test_split(tmp_path / "m", root, tmp_path / "ev", monkeypatch)
    assert test.image_size == (resize, resize)
    for i in range(len(test)):
        evaluated = pre.batch(test.images[i:i + 1])[0]
        assert (evaluated - pre(open_image(test.paths[i]))).abs().max() < 1 / 127.5  # 8-bit storage only


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest", "lanczos", "area"])
def test_the_stored_square_holds_predicts_crop_on_both_storage_paths(interpolation):
    """PIL stores the photos of its own filters, torch's resize the area ones (`StoredSquare.tensor`):
    both place the square so that the model's crop, cut from it later, is the crop predict cuts from the photo."""
    from PIL import Image

    from vitlab.data.images import StoredSquare

    photo = Image.fromarray(np.random.RandomState(3).randint(0, 256, (100, 115, 3), dtype=np.uint8))
    for crop_offset in ("round", "floor"):
        pre = Preprocess(image_size=(40, 40), resize=51, interpolation=interpolation, crop_offset=crop_offset)
        args = pre.storage()
        stored = StoredSquare(args["squash"], args["antialias"], interpolation, crop_offset, args["model_crop"])
        square = stored.tensor(photo, pre.model_side)
        assert tuple(square.shape) == (3, 51, 51)
        assert (pre.batch(square[None])[0] - pre(photo)).abs().max() < 1 / 127.5
