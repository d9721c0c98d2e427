"""Static int8 (engine/static_int8.py): the dynamic int8 graph with calibrated, fixed activation scales.

Reference: ONNX Runtime's own dynamic quantization. Calibrated on one batch and run on that same batch, static int8
must give what dynamic int8 gives on it (both take each activation's range over that batch), through other kernels
(QuantizeLinear + MatMulIntegerToFloat against DynamicQuantizeMatMul)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
import onnx  # noqa: E402

from test_engine import images, tiny  # noqa: E402
from vitlab.engine import choose, prepare_engine  # noqa: E402
from vitlab.engine.ort import OrtEngine, build_fp32, build_int8_dynamic  # noqa: E402
from vitlab.engine.static_int8 import build_int8_static, uint8_scale  # noqa: E402
from vitlab.errors import VitlabError  # noqa: E402


def session_ops(path, tmp_path) -> collections.Counter:
    """Operator counts of the graph ONNX Runtime actually runs (after its own fusions)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.optimized_model_filepath, opts.log_severity_level = str(tmp_path / "session.onnx"), 3
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "session.onnx")).graph.node)


@pytest.fixture
def graphs(tmp_path):
    model = tiny()
    fp32 = build_fp32(model, tmp_path, (32, 32))
    batch = images(16, seed=3)
    static = build_int8_static(fp32, tmp_path / "static.onnx", [batch.numpy()])
    return model, fp32, static, batch


def test_static_equals_dynamic_on_its_calibration_batch(graphs, tmp_path):
    model, fp32, static, batch = graphs
    dynamic = build_int8_dynamic(fp32, tmp_path / "dynamic.onnx")
    ours, reference = OrtEngine(static, 1)(batch), OrtEngine(dynamic, 1)(batch)
    assert (ours - reference).abs().max() < 1e-4 * reference.abs().max()
    with torch.no_grad():
        assert (ours - model(batch)).abs().max() < 0.1 * model(batch).abs().max()  # and it is the model, in int8
    assert not list(tmp_path.glob("static.*.onnx"))  # the staged and augmented graphs are removed


def test_static_logits_do_not_depend_on_the_batch(graphs):
    _, _, static, _ = graphs
    engine, x = OrtEngine(static, 1), images(6, seed=5) * 3  # beyond the calibrated ranges: they saturate
    together = engine(x)
    alone = torch.cat([engine(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(together, alone)


def test_static_graph_runs_fixed_scales_through_fused_int8_products(graphs, tmp_path):
    model, _, static, _ = graphs
    stored = collections.Counter(n.op_type for n in onnx.load(str(static)).graph.node)
    assert stored["DynamicQuantizeLinear"] == 0 and stored["MatMulInteger"] == 0
    ops = session_ops(static, tmp_path)
    depth = model.config.depth
    assert ops["QAttention"] == depth - 2  # the fused attention blocks keep their int8 operator
    assert ops["DynamicQuantizeMatMul"] == 0 and ops["Cast"] == 0
    # qkv of the two unfused blocks, proj, fc1 and fc2 of every block but the last (class token only: its proj,
    # fc1 and fc2 too); the classifier stays fp32
    assert ops["MatMulIntegerToFloat"] == 2 * 3 + 3 * depth
    assert ops["QuantizeLinear"] >= depth


def test_int8_graphs_keep_the_classifier_in_fp32(graphs, tmp_path):
    """ORT's quantizers rename the classifier's Gemm before they exclude nodes by name (`_head_nodes`)."""
    _, fp32, static, _ = graphs
    dynamic = build_int8_dynamic(fp32, tmp_path / "dynamic.onnx")
    for path in (static, dynamic):
        quantized = [n.name for n in onnx.load(str(path)).graph.node if n.op_type.startswith("MatMulInteger")]
        assert quantized and not [name for name in quantized if name.startswith("/head/")]


def test_uint8_scale_is_dynamic_quantize_linears():
    import onnxruntime as ort
    from onnx import TensorProto, helper

    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                              [helper.make_tensor_value_info(n, t, None) for n, t in
                               [("q", TensorProto.UINT8), ("scale", TensorProto.FLOAT), ("zero", TensorProto.UINT8)]])
    # IR version 8 (opset 17's): onnx's newest can be ahead of the onnxruntime installed beside it
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x in (np.array([-1.5, 0.3, 4.0]), np.array([0.2, 3.0]), np.array([-7.0, -0.1]), np.array([-1e-3, 250.0])):
        _, scale, zero = session.run(None, {"x": x.astype(np.float32)})
        ours = uint8_scale(min(0.0, x.min()), max(0.0, x.max()))
        assert ours[0] == pytest.approx(float(scale), rel=1e-6) and ours[1] == int(zero)
    assert uint8_scale(0.0, 0.0) == (1.0, 0)  # an activation that is always 0 still gets a valid scale


def test_static_refuses_calibration_that_is_not_finite(tmp_path):
    fp32 = build_fp32(tiny(), tmp_path, (32, 32))
    bad = images(4).numpy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(VitlabError, match="NaN or infinite"):
        build_int8_static(fp32, tmp_path / "static.onnx", [bad])
    with pytest.raises(VitlabError, match="calibration images"):
        build_int8_static(fp32, tmp_path / "static.onnx", [])


@pytest.mark.parametrize("dynamic_speed,kept", [(10.3, "static"), (11.0, "dynamic")])
def test_int8_auto_keeps_static_unless_dynamic_is_clearly_faster(tmp_path, monkeypatch, dynamic_speed, kept):
    # one disagreement on the held-out quarter (64 of 256 images) reads 98.4 %: not measurably below 99 %
    monkeypatch.setattr(choose, "_agreement", lambda engine, reference, holdout:
                        (1.0 if engine.name.endswith("dynamic") else 63 / 64, len(holdout)))
    monkeypatch.setattr(choose, "interleaved_speeds",
                        lambda engines, *a, **k: {m: {"static": 10.0, "dynamic": dynamic_speed}.get(m, 1.0)
                                                  for m in engines})
    engine = prepare_engine(tiny(), "onnxruntime", int8="auto", calibration=[images(256).numpy()], source=tmp_path,
                            quiet=True, sub_batches=False)
    assert engine.name == f"onnxruntime-int8-{kept}"
    assert "int8 auto: onnxruntime-int8-static 10.0 images/s" in engine.note


def test_agreement_counts_against_int8_only_when_measurably_below_99_percent():
    assert choose._agrees_enough((63 / 64, 64)) and choose._agrees_enough((62 / 64, 64))
    assert not choose._agrees_enough((61 / 64, 64))
    assert choose._agrees_enough((9990 / 10000, 10000)) and not choose._agrees_enough((9850 / 10000, 10000))
    assert not choose._agrees_enough(None)


def test_int8_auto_choice_is_kept_for_the_same_calibration_images(tmp_path, monkeypatch):
    timed = []

    def speeds(engines, *a, **k):
        timed.append(sorted(engines))
        return {m: {"static": 10.0, "dynamic": 20.0}.get(m, 1.0) for m in engines}

    monkeypatch.setattr(choose, "interleaved_speeds", speeds)
    monkeypatch.setattr(choose, "_agreement", lambda engine, reference, holdout: (1.0, len(holdout)))
    calibration = [images(64).numpy()]
    first = prepare_engine(tiny(), "onnxruntime", int8="auto", calibration=calibration, source=tmp_path,
                           quiet=True, sub_batches=False)
    assert first.name == "onnxruntime-int8-dynamic" and timed == [["dynamic", "static"]]
    monkeypatch.setattr(choose, "interleaved_speeds", lambda *a, **k: pytest.fail("timed again"))
    again = prepare_engine(tiny(), "onnxruntime", int8="auto", calibration=calibration, source=tmp_path,
                           quiet=True, sub_batches=False)
    assert again.name == first.name and "chosen before on this machine: onnxruntime-int8-static 10.0" in again.note
    monkeypatch.setattr(choose, "interleaved_speeds", speeds)
    prepare_engine(tiny(), "onnxruntime", int8="auto", calibration=[images(64, seed=9).numpy()], source=tmp_path,
                   quiet=True, sub_batches=False)
    assert len(timed) == 2  # other calibration images: another static graph, timed anew


def test_int8_is_refused_for_a_model_without_transformer_blocks(tmp_path):
    import vitlab

    resnet = vitlab.create_model("resnet-50", num_classes=5, image_size=32).eval()
    with pytest.raises(VitlabError, match="resnet-50 has none"):
        prepare_engine(resnet, "auto", int8="dynamic", source=tmp_path, quiet=True)


def test_static_int8_of_a_gap_vit(tmp_path):
    """Global-average-pooled ViTs (no class token: every block fuses but the first) quantize the same way."""
    model = tiny(classifier="gap")
    fp32 = build_fp32(model, tmp_path, (32, 32))
    static = build_int8_static(fp32, tmp_path / "static.onnx", [images(16, seed=3).numpy()])
    x = images(4)
    with torch.no_grad():
        ref = model(x)
    assert (OrtEngine(static, 1)(x) - ref).abs().max() < 0.1 * ref.abs().max()
