"""ORT's transformer fusions of a ViT graph in a process of its own that reads the weights lazily
(engine/vit_fusion.py): the same graph to the byte as the fusion with the whole graph in memory, failures in one
line; the export's model copy shares the weights; an exported file gains its metadata without being read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import vitlab

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from vitlab.engine import ort as ort_engine  # noqa: E402
from vitlab.engine import vit_fusion  # noqa: E402
from vitlab.engine.onnx_graph import export_fusable, fusable_copy  # noqa: E402


def tiny() -> torch.nn.Module:
    model = vitlab.create_model("custom", dim=32, depth=2, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                                num_classes=5, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


@pytest.fixture
def raw_graph(tmp_path):
    model = tiny()
    return model, export_fusable(model, tmp_path / "work" / "raw.onnx", (16, 16))


def in_memory(model, raw, out):
    vit_fusion.fuse(raw, out, model.config.heads, model.config.dim, False)
    return out.read_bytes()


def test_the_separate_process_writes_the_same_graph(raw_graph, tmp_path):
    model, raw = raw_graph
    expected = in_memory(model, raw, tmp_path / "expected.onnx")
    assert ort_engine.fused_operator_counts(tmp_path / "expected.onnx").get("FastGelu")  # the optimizer ran
    vit_fusion.fuse_in_separate_process(raw, tmp_path / "separate.onnx", model.config.heads, model.config.dim, False)
    assert (tmp_path / "separate.onnx").read_bytes() == expected


def test_weights_written_beside_the_graph_and_read_lazily_give_the_same_graph(raw_graph, tmp_path, monkeypatch):
    # the path of a graph with its weights inside (below 2 GB): written again with them beside it, then fused with
    # only what the fusions read loaded; in this process, so its working directory is restored afterwards
    model, raw = raw_graph
    expected = in_memory(model, raw, tmp_path / "expected.onnx")
    monkeypatch.setattr(vit_fusion, "_GRAPH_ALONE_MAX_BYTES", 0)
    monkeypatch.chdir(tmp_path)
    vit_fusion.fuse_reading_lazily(raw, tmp_path / "lazy.onnx", model.config.heads, model.config.dim, False)
    assert {p.name for p in raw.parent.iterdir()} == {"raw.onnx", "raw.lazy.onnx", "raw.lazy.onnx.data"}
    assert (raw.parent / "raw.lazy.onnx").stat().st_size < raw.stat().st_size / 2  # the weights are beside it
    assert (tmp_path / "lazy.onnx").read_bytes() == expected


def test_a_failed_fusion_process_says_why_in_one_line(tmp_path):
    with pytest.raises(RuntimeError, match=r"^ONNX Runtime's graph optimizer failed: .*(FileNotFound|No such file)"):
        vit_fusion.fuse_in_separate_process(tmp_path / "missing.onnx", tmp_path / "out.onnx", 4, 32, False)


def test_an_engine_built_through_the_separate_process_runs_as_eager(tmp_path, monkeypatch):
    from vitlab.engine import prepare_engine

    monkeypatch.setattr(ort_engine, "SEPARATE_FUSION_MIN_BYTES", 0)
    calls = []
    real = vit_fusion.fuse_in_separate_process
    monkeypatch.setattr(vit_fusion, "fuse_in_separate_process", lambda *a: calls.append(a) or real(*a))
    model = tiny()
    engine = prepare_engine(model, "onnxruntime", source=tmp_path / "model", quiet=True)
    assert len(calls) == 1
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(x)
    assert (engine(x) - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert not list((tmp_path / "model").rglob(".build-*"))  # the scratch files went with the build folder


def test_the_export_copy_shares_the_weights_and_leaves_the_model_alone():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    twin = fusable_copy(model)
    assert twin.patch_embed.proj.weight is model.patch_embed.proj.weight
    assert twin.blocks[0].attn.proj.weight is model.blocks[0].attn.proj.weight
    assert twin.blocks[1].mlp.fc1.weight is model.blocks[1].mlp.fc1.weight
    assert type(model.blocks[0].attn).__name__ == "Attention" and type(twin.blocks[0].attn).__name__ != "Attention"
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-5
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_an_exported_graph_gains_its_metadata_as_loading_and_saving_gave_it(tmp_path):
    from vitlab.export import _copy_built, _set_metadata

    built = export_fusable(tiny(), tmp_path / "built.onnx", (16, 16))
    meta = {"class_names": list("abcde")}
    _copy_built(built, tmp_path / "out.onnx", meta, "onnxruntime fp32 (fused)")
    proto = onnx.load(str(built))
    _set_metadata(proto, {**meta, "engine": "onnxruntime fp32 (fused)"})
    onnx.save(proto, str(tmp_path / "saved.onnx"))
    assert (tmp_path / "out.onnx").read_bytes() == (tmp_path / "saved.onnx").read_bytes()
    session = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"])
    assert json.loads(session.get_modelmeta().custom_metadata_map["vitlab"])["class_names"] == list("abcde")
    # an earlier export's weights file beside the output is not this graph's: removed
    (tmp_path / "again.onnx.data").write_bytes(b"old")
    shutil.copyfile(built, tmp_path / "built2.onnx")
    _copy_built(tmp_path / "built2.onnx", tmp_path / "again.onnx", None, "x")
    assert not (tmp_path / "again.onnx.data").exists()
    assert np.array_equal(np.frombuffer((tmp_path / "again.onnx").read_bytes(), np.uint8),
                          np.frombuffer(built.read_bytes(), np.uint8))

