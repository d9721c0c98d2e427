"""Native vitlab format: save/load round trip is exact, meta comes back, errors are one clear line."""

import json

import pytest
import torch

import vitlab
from vitlab.errors import VitlabError
from vitlab.models.registry import create_model
from vitlab.weights import load_with_meta, save_native


def _tiny(**kw):
    args = dict(dim=32, depth=2, heads=4, mlp_dim=64, patch_size=4, image_size=16, num_classes=3)
    args.update(kw)
    return create_model("custom", seed=0, **args)


@pytest.mark.parametrize("kw", [{}, {"classifier": "gap"}, {"classifier": "map"}, {"representation_size": 16},
                                {"gelu": "exact", "layer_norm_eps": 1e-12}, {"in_chans": 1}])
def test_native_round_trip_exact(tmp_path, kw):
    model = _tiny(**kw).eval()
    with torch.no_grad():  # non-trivial head so the comparison is meaningful
        model.head.weight.normal_()
    save_native(model, tmp_path / "m", class_names=["a", "b", "c"])
    loaded, meta = load_with_meta(tmp_path / "m")
    x = torch.randn(2, model.config.in_chans, 16, 16)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert loaded.config == model.config
    assert meta["class_names"] == ["a", "b", "c"]
    assert meta["format"] == "native"
    on_disk = json.loads((tmp_path / "m" / "config.json").read_text())
    assert on_disk["format"] == "vitlab" and on_disk["class_names"] == ["a", "b", "c"]
    assert {"image_size", "mean", "std"} <= set(on_disk["preprocess"])


def test_native_hybrid_and_resnet_round_trip(tmp_path):
    for name, size in (("r+vit-ti/16", 64), ("bit-r26x1-postact", 32)):
        kw = dict(depth=1) if name.startswith("r+") else dict(layers=(1, 1))
        model = create_model(name, num_classes=2, image_size=size, seed=1, **kw).eval()
        save_native(model, tmp_path / name.replace("/", "_"))
        loaded = vitlab.load(tmp_path / name.replace("/", "_"))
        x = torch.randn(1, 3, size, size)
        with torch.no_grad():
            assert torch.equal(model(x), loaded(x))


def test_native_surgery_on_load(tmp_path):
    save_native(_tiny(), tmp_path / "m", class_names=["a", "b", "c"])
    model, meta = load_with_meta(tmp_path / "m", num_classes=5, image_size=24)
    assert model.head.weight.shape == (5, 32) and torch.count_nonzero(model.head.weight) == 0
    assert model.pos_embed.shape == (1, 1 + 36, 32)
    assert meta["class_names"] is None


def test_native_errors(tmp_path):
    model = _tiny()
    with pytest.raises(VitlabError, match="class names"):
        save_native(model, tmp_path / "bad", class_names=["only-one"])
    save_native(model, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(VitlabError, match="complete"):
        vitlab.load(tmp_path / "m")
    with pytest.raises(VitlabError, match="no such file"):
        vitlab.load(tmp_path / "nothing-here")


def test_native_from_wrapped_model_and_config_json_path(tmp_path):
    model = _tiny().eval()
    wrapper = torch.nn.Module()
    wrapper.module = model  # what DistributedDataParallel looks like
    save_native(wrapper, tmp_path / "m")
    again = vitlab.load(tmp_path / "m" / "config.json")
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
    four = _tiny(in_chans=4)
    save_native(four, tmp_path / "four")
    m, meta = load_with_meta(tmp_path / "four")  # no Preprocess for 4 channels: the dict is kept
    assert m.config.in_chans == 4 and meta["preprocess"]["channels"] == 4


def test_run_folder_loads_as_its_model(tmp_path):
    """Every command that takes weights takes a training run folder: RUN stands for RUN/model."""
    import torch

    import vitlab
    from vitlab.weights import save_native

    model = vitlab.create_model("resnet-18-small", num_classes=3, image_size=28, in_chans=1, base_width=8,
                                layers=(1, 1), seed=0).eval()
    run = tmp_path / "run"
    save_native(model, run / "model", class_names=["a", "b", "c"])
    (run / "config.yaml").write_text("recipe: small-data\n")
    loaded, meta = vitlab.weights.load_with_meta(run)
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(loaded(x), model(x))
    assert meta["class_names"] == ["a", "b", "c"]


def test_vitlab_save_is_the_counterpart_of_vitlab_load(tmp_path):
    model = create_model("resnet-18", num_classes=4, seed=0).eval()
    assert vitlab.save(model, tmp_path / "r", class_names=list("abcd")) == tmp_path / "r"
    loaded, meta = load_with_meta(tmp_path / "r")
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    assert meta["class_names"] == list("abcd")


def test_vitlab_save_refuses_what_it_cannot_write_in_one_line(tmp_path):
    with pytest.raises(VitlabError, match="Linear is not a vitlab model"):
        vitlab.save(torch.nn.Linear(2, 2), tmp_path / "x")
    (tmp_path / "file.pth").write_bytes(b"")
    with pytest.raises(VitlabError, match="is a file; vitlab's format is a folder"):
        vitlab.save(_tiny(), tmp_path / "file.pth")


def test_a_bare_state_dict_of_a_vitlab_model_points_to_vitlab_save(tmp_path):
    """vitlab's keys are timm's, so torch.save(model.state_dict()) carries timm's pooling question."""
    model = _tiny().eval()
    torch.save(model.state_dict(), tmp_path / "m.pth")
    with pytest.raises(VitlabError, match=r"does not say how it pools.*vitlab\.save\(model, folder\)"):
        vitlab.load(tmp_path / "m.pth")
    with pytest.raises(VitlabError, match=r"pass heads=N.*vitlab\.save\(model, folder\)"):
        vitlab.load(tmp_path / "m.pth", classifier="token")
    loaded = vitlab.load(tmp_path / "m.pth", classifier="token", heads=4)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


@pytest.mark.parametrize("fmt", ["native", "hf", "timm"])
def test_saved_weights_get_the_umask_mode_not_safetensors_0600(tmp_path, fmt):
    """safetensors' save_file writes 0600: a model saved for a team or a container was readable by its owner only."""
    import os

    from vitlab.weights import save_hf, save_timm

    model = _tiny()
    old = os.umask(0o022)
    try:
        if fmt == "native":
            path = save_native(model, tmp_path / "m") / "model.safetensors"
        elif fmt == "hf":
            path = save_hf(model, tmp_path / "h") / "model.safetensors"
        else:
            path = save_timm(model, tmp_path / "t.safetensors")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_refused_save_leaves_no_folder_behind(tmp_path):
    with pytest.raises(VitlabError, match="2 class names given for a model with 3 outputs"):
        vitlab.save(_tiny(), tmp_path / "m", class_names=["a", "b"])
    assert not (tmp_path / "m").exists()
