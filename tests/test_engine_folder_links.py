"""A model folder from elsewhere can hold `engines/<hash>` (or `engines`) as a link: its author can compute the hash
from the weights. The build wrote vitlab's graphs and its lock wherever the link pointed; such a model's engines now
go to the user cache."""

import os

import pytest
import torch

from test_audit19_engine import saved, tiny_vit
from vitlab.engine import prepare_engine
from vitlab.engine.choose import fingerprint

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("link", ["hash", "engines"])
def test_a_linked_engines_folder_is_not_written_through(tmp_path, monkeypatch, link):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "user-cache"))
    model = tiny_vit(0)
    folder = saved(model, tmp_path / "model")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if link == "hash":
        (folder / "engines").mkdir()
        os.symlink(elsewhere, folder / "engines" / fingerprint(model))
    else:
        os.symlink(elsewhere, folder / "engines")
    engine = prepare_engine(model, "onnxruntime", source=folder, quiet=True)
    assert list(elsewhere.iterdir()) == []
    assert engine.path.is_relative_to(tmp_path / "user-cache" / "engines" / fingerprint(model))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert float((engine(x) - model(x)).abs().max()) < 1e-4


def test_a_plain_engines_folder_is_still_used(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "user-cache"))
    model = tiny_vit(0)
    folder = saved(model, tmp_path / "model")
    engine = prepare_engine(model, "onnxruntime", source=folder, quiet=True)
    assert engine.path.parent == folder / "engines" / fingerprint(model)
