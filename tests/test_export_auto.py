"""`export --engine auto` (`vitlab.export.export_for_engine(..., "auto")`): it timed the fused graph against a
portable one written to OUT.portable.onnx beside the output, which overwrote and then deleted a user's file of that
name, and it kept the portable graph without checking it against PyTorch as `--engine torch` does."""

import json

import numpy as np
import pytest
import torch

from test_audit14_export import _tiny
from vitlab import export as export_module
from vitlab.export import FUSED, PORTABLE, export_for_engine

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


MODEL = _tiny()  # random weights (a global generator): one model for the export and the check


def export_auto(tmp_path, out):
    source = tmp_path / "model"
    source.mkdir(exist_ok=True)
    return export_for_engine(MODEL, out, "auto", source=source, metadata={"class_names": list("abcde")},
                             quiet=True)


def logits_of(path):
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ref = MODEL(x).numpy()
    return sess.run(["logits"], {"images": x.numpy()})[0], ref


def test_a_users_file_beside_the_output_is_left_alone(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    mine = out_dir / "m.portable.onnx"
    mine.write_bytes(b"a file of the user's")
    path, kind = export_auto(tmp_path, out_dir / "m.onnx")
    assert mine.read_bytes() == b"a file of the user's"
    assert sorted(p.name for p in out_dir.iterdir()) == ["m.onnx", "m.portable.onnx"]  # no work folder left
    assert kind.startswith((FUSED, PORTABLE)) and "auto: ONNX Runtime fused" in kind
    out, ref = logits_of(path)
    assert np.abs(out - ref).max() < 1e-4
    meta = json.loads({p.key: p.value for p in onnx.load(str(path)).metadata_props}["vitlab"])
    assert meta["class_names"] == list("abcde")


def test_a_portable_graph_that_differs_from_pytorch_is_not_kept(tmp_path, monkeypatch):
    real = export_module.onnx_difference

    def wrong_for_portable(model, path, *a, **kw):
        diff, scale = real(model, path, *a, **kw)
        return (diff + 1.0, scale) if ".m.onnx." in str(path) else (diff, scale)  # the private folder's graph

    monkeypatch.setattr(export_module, "onnx_difference", wrong_for_portable)
    path, kind = export_auto(tmp_path, tmp_path / "m.onnx")
    assert kind.startswith(f"{FUSED} (auto: the portable graph differed from PyTorch by 1.0")
    assert "not kept" in kind
    domains = {node.domain for node in onnx.load(str(path)).graph.node}
    assert "com.microsoft" in domains  # the fused graph, ORT's own operators
    out, ref = logits_of(path)
    assert np.abs(out - ref).max() < 1e-4


def test_a_portable_graph_that_does_not_run_is_not_kept(tmp_path, monkeypatch):
    def fails(model, path, *a, **kw):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : bad graph")

    monkeypatch.setattr(export_module, "onnx_difference", fails)
    path, kind = export_auto(tmp_path, tmp_path / "m.onnx")
    assert kind == f"{FUSED} (auto: the portable graph did not run in ONNX Runtime (RuntimeError), not kept)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "model"]
