"""Audit of `--engine auto`'s cache (serving area): a damaged choices.json (edited by hand, written by another tool,
a list, an entry without its speeds) is timed again instead of failing the command with an unexpected error."""

import json

import pytest
import torch

import vitlab

pytest.importorskip("onnxruntime")
from vitlab.engine import prepare_engine  # noqa: E402
from vitlab.engine.choose import artefact_folder  # noqa: E402


@pytest.mark.parametrize("damage", [
    "[1, 2]",  # not an object
    "null",
    '{"KEY": {"picked": "onnxruntime"}}',  # no speeds: the note reads them
    '{"KEY": {"picked": "onnxruntime", "images_per_s": {"onnxruntime": "fast"}}}',
    '{"KEY": {"picked": "onnxruntime", "images_per_s": [1, 2]}}',
])
def test_a_damaged_choice_cache_is_timed_again(tmp_path, damage, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = vitlab.create_model("vit-ti/16", image_size=16, patch_size=8, dim=32, depth=1, heads=2, mlp_dim=64,
                                num_classes=3).eval()
    source = tmp_path / "model"
    source.mkdir()
    prepare_engine(model, "auto", source=source, batch_size=2, quiet=True)  # times and caches the choice
    path = artefact_folder(model, source) / "choices.json"
    [key] = json.loads(path.read_text())
    path.write_text(damage.replace("KEY", key.replace('"', '\\"')))
    engine = prepare_engine(model, "auto", source=source, batch_size=2, quiet=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert (engine(x) - model(x)).abs().max() < 1e-3
    assert "measured" in engine.note  # timed again, and the cache written anew
    assert isinstance(json.loads(path.read_text())[key]["images_per_s"], dict)


def test_compiled_engine_keeps_the_commands_batch_not_the_checks(tmp_path, monkeypatch):
    """`--engine compiled` compiles one static batch, fixed by its first call; that call was the 2-image exactness
    check, so batches of 32 ran as 16 calls of 2 (and the server's warm-up at --max-batch too)."""
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)  # what is compiled is not the point here
    torch.manual_seed(0)
    model = vitlab.create_model("vit-ti/16", image_size=16, patch_size=8, dim=32, depth=1, heads=2, mlp_dim=64,
                                num_classes=3).eval()
    engine = prepare_engine(model, "compiled", source=tmp_path, batch_size=8, quiet=True)
    assert engine.batch == 8
    x = torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        assert (engine(x) - model(x)).abs().max() < 1e-5
