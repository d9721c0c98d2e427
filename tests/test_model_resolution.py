"""Every command that takes a model takes the same things (issue 19 item 2): a weights file, a model folder,
a run folder (-> RUN/model), a pretrained name (here from the cache, offline) - and fails with the same one
line for a missing path, an unfinished run folder, or a bare model name where weights are needed."""

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab.cli import main
from vitlab.data.preprocess import Preprocess
from vitlab.errors import VitlabError
from vitlab.models.registry import create_model
from vitlab.weights import pretrained, resolve_model, save_native, save_timm

CLASSES = "Sandal,Sneaker,Ankle boot"
DATA = ["--data", "bundled", "--classes", CLASSES, "--per-class", "4"]
TRAIN = ["--epochs", "1", "--batch-size", "6", "--precision", "fp32", "--quiet"]
ENTRY = pretrained.Pretrained("vit-mu/8.test-fm", "vit-mu/8", "vit-bucket", "test/fm.safetensors", 28, "none")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("resolution")
    model = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=128, patch_size=7, image_size=28, in_chans=1,
                         num_classes=3, seed=0)
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
    kw = dict(class_names=CLASSES.split(","), preprocess=Preprocess.for_model(28, channels=1))
    save_native(model, root / "folder", **kw)
    save_timm(model, root / "file.safetensors", **kw)
    save_native(model, root / "run" / "model", **kw)
    (root / "run" / "config.yaml").write_text(f"data: bundled\nclasses: {CLASSES}\nper_class: 4\n")
    (root / "unfinished" / "checkpoints").mkdir(parents=True)
    (root / "unfinished" / "config.yaml").write_text("data: bundled\n")
    save_timm(model, root / "cache" / "official" / "test" / "fm.safetensors", **kw)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)).save(root / "img.png")
    return root, model


@pytest.fixture(autouse=True)
def offline_cache(assets, monkeypatch):
    """The pretrained name resolves from the cache, with the network off (VITLAB_OFFLINE=1)."""
    monkeypatch.setenv("VITLAB_CACHE", str(assets[0] / "cache"))
    monkeypatch.setenv("VITLAB_OFFLINE", "1")
    monkeypatch.setitem(pretrained.PRETRAINED, ENTRY.name, ENTRY)


SPECS = {"file": "file.safetensors", "folder": "folder", "run": "run", "pretrained": ENTRY.name}


def _spec(root, kind):
    return SPECS[kind] if kind == "pretrained" else str(root / SPECS[kind])


def _argv(command, spec, root, out):
    return {
        "predict": ["predict", spec, str(root / "img.png"), "--quiet", "--format", "json"],
        "convert": ["convert", spec, str(out / "converted"), "--quiet"],
        "export": ["export", spec, str(out / "m.onnx"), "--no-check"],
        "evaluate": ["evaluate", spec, *DATA, "--out", str(out / "ev"), "--quiet"],
        "inspect": ["inspect", spec, "--images", str(root / "img.png"), "--out", str(out / "insp"), "--quiet",
                    "-n", "1", "--rollout-images", "1", "--components", "4"],
        "finetune": ["finetune", "--weights", spec, *DATA, *TRAIN, "--steps", "2", "--warmup-steps", "1",
                     "--out", str(out / "runs")],
        "compare": ["compare", *DATA, "--models", "m", "--weights", spec, *TRAIN, "--out", str(out / "cmp")],
    }[command]


CHEAP = ["predict", "convert", "evaluate", "inspect", "export"]
ALL = [*CHEAP, "finetune", "compare"]


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("command", CHEAP)
def test_every_command_takes_every_kind(assets, tmp_path, command, kind, capsys):
    if command == "export":
        pytest.importorskip("onnx")
    root, _ = assets
    assert main(_argv(command, _spec(root, kind), root, tmp_path)) == 0, capsys.readouterr().err


@pytest.mark.parametrize("command", ["finetune", "compare"])
def test_training_commands_take_a_pretrained_name(assets, tmp_path, command, capsys):
    root, _ = assets
    assert main(_argv(command, ENTRY.name, root, tmp_path)) == 0, capsys.readouterr().err


@pytest.mark.parametrize("kind", list(SPECS))
def test_vitlab_load_takes_every_kind(assets, kind):
    root, model = assets
    loaded = vitlab.load(_spec(root, kind))
    assert loaded.head.weight.equal(model.head.weight)


def _error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    prefix, _, message = err[0].partition(": error: ")
    assert prefix == f"vitlab {argv[0]}", err
    if argv[0] == "compare":  # every entry is checked before the first model trains, and named
        assert message.startswith("--models entry "), err
    return message


@pytest.mark.parametrize("case,fragment", [
    ("missing", "no such file or folder"),
    ("unfinished", "has no model/ yet"),
])
def test_the_same_one_line_from_every_command(assets, tmp_path, capsys, case, fragment):
    root, _ = assets
    spec = str(root / ("nothere" if case == "missing" else "unfinished"))
    messages = {c: _error(capsys, _argv(c, spec, root, tmp_path)) for c in ALL}
    assert all(fragment in m for m in messages.values()), messages
    if case == "unfinished":
        assert all("vitlab train --resume" in m for m in messages.values()), messages
    # the resolution's own sentence is identical everywhere (compare prefixes it with the model's name)
    core = messages["predict"]
    assert all(core in m for m in messages.values()), messages
    with pytest.raises(VitlabError) as err:
        vitlab.load(spec)
    assert core in str(err.value)


@pytest.mark.parametrize("command", ["predict", "convert", "export", "inspect"])
def test_a_model_name_where_weights_are_needed_offers_a_checkpoint(assets, tmp_path, capsys, command):
    root, _ = assets
    message = _error(capsys, _argv(command, "vit-b/16", root, tmp_path))
    assert "is a model name (random weights), not weights" in message
    assert "vit-b/16.augreg-in21k-ft-in1k-224" in message


def test_resolve_model_rules(assets):
    root, _ = assets
    assert resolve_model(root / "run") == root / "run" / "model"
    assert resolve_model(root / "folder") == root / "folder"
    assert resolve_model("vit-b/16") is None and resolve_model("custom(dim=32,depth=1)") is None
    assert resolve_model(ENTRY.name) == root / "cache" / "official" / "test" / "fm.safetensors"
    with pytest.raises(VitlabError, match="vit-b/16 has these checkpoints: vit-b/16.augreg"):
        resolve_model("vit-b/16.no-such-tag")
    with pytest.raises(VitlabError, match=r"did you mean vit-b/16\?\)"):  # a typo, not a Hub repo
        resolve_model("vit-b/61")
    with pytest.raises(VitlabError, match="if you meant the Hugging Face Hub repo, write hf:myorg/mymodel"):
        resolve_model("myorg/mymodel")
    with pytest.raises(VitlabError, match="VITLAB_OFFLINE=1 and ViT-B_16.npz is not in the cache"):
        resolve_model("vit-b/16.orig-in21k")
