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
import torch.nn as nn
from tests.test_crop_mode import smooth_photo
from tests.test_crop_offset import pil_processor
from tests.test_train_loop import tiny_cfg, tiny_data

import vitlab
from vitlab.data.preprocess import Preprocess
from vitlab.train import resolve_config, train
from vitlab.weights import load_with_meta, save_hf, save_native, save_timm


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


# ----------------------------------------------------------------------------- 2. a head put in by hand
HEADS = {
    "stack": (lambda: nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 5)), r"Sequential\(Linear, ReLU"),
    "dropout + linear": (lambda: nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 5)), r"Sequential\(Dropout, Linear"),
    "no bias": (lambda: nn.Linear(32, 5, bias=False), r"Linear\(32, 5, bias=False\)"),
    "wrong width": (lambda: nn.Linear(64, 5), r"Linear\(64, 5\)"),
}


@pytest.mark.parametrize("kind", list(HEADS))
def test_vitlab_save_refuses_a_head_it_cannot_rebuild_before_writing(tmp_path, kind):
    make, described = HEADS[kind]
    model = _vit(16)
    model.head = make()
    with pytest.raises(vitlab.VitlabError, match=described) as info:
        vitlab.save(model, tmp_path / "out")
    line = str(info.value)
    assert "\n" not in line and "nn.Linear(32, 5)" in line and "reset_classifier(5)" in line
    assert not (tmp_path / "out").exists()  # nothing written: no folder that fails at load


@pytest.mark.parametrize("writer", ["hf", "timm", "timm module"])
def test_the_peer_exports_refuse_it_too(tmp_path, writer):
    """save_hf failed on a bare KeyError 'head.weight'; save_timm wrote a file vitlab then refused (also when called
    from its own module, vitlab.weights.timm, not the package's wrapper)."""
    from vitlab.weights import timm as timm_format

    writers = {"hf": lambda m: save_hf(m, tmp_path / "hf"),
               "timm": lambda m: save_timm(m, tmp_path / "m.safetensors"),
               "timm module": lambda m: timm_format.save_timm(m, tmp_path / "m.safetensors")}
    model = _vit(16)
    model.head = HEADS["stack"][0]()
    with pytest.raises(vitlab.VitlabError, match=r"model.head is Sequential"):
        writers[writer](model)
    assert not any(tmp_path.iterdir())


def test_a_plain_linear_head_or_none_still_saves_and_loads(tmp_path):
    model = _randomise(_vit(16))
    model.head = nn.Linear(32, 7)  # the documented way to change the classes by hand
    vitlab.save(model, tmp_path / "seven")
    assert vitlab.load(tmp_path / "seven").config.num_classes == 7
    model.head = nn.Identity()
    vitlab.save(model, tmp_path / "features")
    assert vitlab.load(tmp_path / "features").config.num_classes == 0


def test_a_standard_resnets_fc_is_checked_as_its_head(tmp_path):
    resnet = vitlab.create_model("resnet-18", num_classes=4)
    resnet.fc = nn.Sequential(nn.Dropout(0.2), nn.Linear(512, 4))  # a standard ResNet's head is `fc`
    with pytest.raises(vitlab.VitlabError, match=r"model.fc is Sequential\(Dropout, Linear\).*nn.Linear\(512, 4\)"):
        save_native(resnet, tmp_path / "resnet")


def test_another_module_replaced_is_refused_in_one_line(tmp_path):
    model = _vit(16)
    model.norm = nn.Identity()
    with pytest.raises(vitlab.VitlabError, match=r"not those its config builds \(missing keys norm.weight"):
        vitlab.save(model, tmp_path / "out")


def test_training_a_given_model_with_such_a_head_is_refused_before_the_first_step(tmp_path):
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2, image_size=8,
                                in_chans=1, num_classes=3)
    model.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 3))
    with pytest.raises(vitlab.VitlabError, match=r"model.head is Sequential.*save_model=False"):
        train(tiny_cfg(tmp_path, epochs=1), model=model, data=tiny_data())
    assert not (tmp_path / "run").exists()
    kept = train(tiny_cfg(tmp_path, epochs=1, save_model=False), model=model, data=tiny_data())
    assert kept.test_metrics is not None and not (kept.run_dir / "model").exists()


def test_dropout_on_a_given_model_with_such_a_head_is_one_line(tmp_path):
    """--dropout / --drop-path rebuild the model from its config: with a head put in by hand and save_model=False
    that was a bare load_state_dict error listing unexpected keys."""
    model = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2, image_size=8,
                                in_chans=1, num_classes=3)
    model.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 3))
    with pytest.raises(vitlab.VitlabError, match=r"--drop-path rebuild the model.*model.head is Sequential.*"
                                                 r"create_model\(\.\.\., drop_path=0.2\)") as info:
        train(tiny_cfg(tmp_path, epochs=1, save_model=False, drop_path=0.2), model=model, data=tiny_data())
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------- 3. the trained model in memory
TIMM_VIEW = ("input_size", "mean", "std", "interpolation", "crop_pct", "crop_mode", "label_names")


def _agrees_with_its_run(result):
    """The returned model's record is RUN/model/config.json's, and so is what timm's transforms read."""
    saved = json.loads((result.run_dir / "model" / "config.json").read_text())
    model = result.model
    assert model.preprocess.to_dict() == saved["preprocess"]
    assert model.class_names == saved["class_names"]
    reloaded = vitlab.load(result.run_dir / "model")
    assert {k: model.pretrained_cfg[k] for k in TIMM_VIEW} == {k: reloaded.pretrained_cfg[k] for k in TIMM_VIEW}


def test_a_fine_tuned_model_describes_the_runs_preprocessing_not_its_files(tmp_path):
    data = tiny_data()
    source = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2, image_size=8,
                                 in_chans=1, num_classes=5)
    vitlab.save(source, tmp_path / "src", class_names=list("vwxyz"),
                preprocess=Preprocess(image_size=(8, 8), mean=0.3, std=0.2, interpolation="bicubic", channels=1))
    cfg = resolve_config("finetune", overrides=dict(
        weights=str(tmp_path / "src"), data="tiny", out_dir=str(tmp_path), name="ft", steps=2, batch_size=16,
        warmup_steps=1, threads=1, quiet=True, inception_crop=False, hflip=False, image_size=12, lr=0.01))
    result = train(cfg, data=data)
    # before: bicubic plain resize (the file's) and no class names, against the run's bilinear centre crop
    assert result.model.preprocess.interpolation == "bilinear" and result.model.preprocess.resize == 12
    assert result.model.class_names == ["a", "b", "c"]
    _agrees_with_its_run(result)


def test_a_model_trained_from_scratch_describes_its_run(tmp_path):
    result = train(tiny_cfg(tmp_path, epochs=1, mean=[0.25], std=[0.4]), data=tiny_data())
    assert result.model.pretrained_cfg["mean"] == (0.25,)  # before: vitlab's default 0.5 (no record at all)
    _agrees_with_its_run(result)


def test_a_given_loaded_model_describes_the_runs_normalisation(tmp_path):
    """A model handed to train() keeps its file's record otherwise: here mean 0.3, where the run normalised with
    the mean it was given."""
    source = vitlab.create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=2, image_size=8,
                                 in_chans=1, num_classes=3)
    vitlab.save(source, tmp_path / "src", preprocess=Preprocess(image_size=(8, 8), mean=0.3, std=0.2, channels=1))
    given = vitlab.load(tmp_path / "src")
    result = train(tiny_cfg(tmp_path, epochs=1, mean=[0.45], std=[0.3]), model=given, data=tiny_data())
    assert result.model is given and tuple(given.preprocess.mean) == (0.45,)
    _agrees_with_its_run(result)
