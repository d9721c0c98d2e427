"""Inference engines (vitlab.engine): the fusable ONNX graph, ORT fp32 and int8, `auto` and its cache, the
fused CPU GELU of eager inference. References: eager PyTorch for the numbers, ORT's own fusion statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import vitlab
from vitlab.errors import VitlabError

pytest.importorskip("onnxruntime")
from vitlab.engine import choose, prepare_engine  # noqa: E402
from vitlab.engine.onnx_graph import fusable_copy  # noqa: E402
from vitlab.engine.ort import build_fp32, fused_operator_counts  # noqa: E402

KEPT_MODEL = Path(__file__).resolve().parents[1] / "docs" / "figures" / "fmnist_vit_model"


def tiny(gelu: str = "tanh", **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = vitlab.create_model("vit-ti/16", image_size=32, patch_size=8, dim=64, depth=3, heads=4, mlp_dim=128,
                                num_classes=10, gelu=gelu, **kw).eval()
    with torch.no_grad():  # zero-initialised heads and biases would hide differences
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def images(n: int = 4, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_split_qkv_copy_computes_the_same_logits():
    model = tiny()
    with torch.no_grad():
        ref, twin = model(images()), fusable_copy(model)(images())
    assert (ref - twin).abs().max() < 1e-5
    assert any(k.endswith("attn.qkv.weight") for k in model.state_dict())  # the model itself is untouched


@pytest.mark.parametrize("gelu,act_op", [("tanh", "FastGelu"), ("exact", "BiasGelu")])
def test_ort_fp32_graph_is_fused_and_exact(tmp_path, gelu, act_op):
    model = tiny(gelu)
    path = build_fp32(model, tmp_path, (32, 32))
    counts = fused_operator_counts(path)
    depth = model.config.depth
    # ORT fuses every block's attention but the first (its input is not a residual LayerNorm: reference 2.2) and
    # the last (its query is the class token's alone: models/vit.py CLASS_TOKEN_ONLY); the SkipLayerNormalization
    # its fusion needs is put back as Add + LayerNormalization (a faster kernel)
    assert counts.get("Attention", 0) == depth - 2
    assert counts.get("SkipLayerNormalization", 0) == 0 and counts.get("LayerNormalization", 0) == 2 * depth + 1
    assert counts.get(act_op, 0) == depth
    engine = prepare_engine(model, "onnxruntime", source=tmp_path, quiet=True)
    x = images(5)
    with torch.no_grad():
        assert (engine(x) - model(x)).abs().max() < 1e-4


def test_auto_measures_once_and_reuses_the_cached_choice(tmp_path, monkeypatch, capsys):
    model = tiny()
    engine = prepare_engine(model, "auto", batch_size=4, source=tmp_path, command="predict")
    line = capsys.readouterr().err
    assert "vitlab predict: engine:" in line and "auto: measured" in line and "images/s" in line
    folder = choose.artefact_folder(model, tmp_path)
    assert folder.parent == tmp_path / "engines" and (folder / "choices.json").is_file()
    assert engine.name in ("torch", "onnxruntime")

    def no_timing(*a, **k):
        raise AssertionError("timed again although the choice is cached")

    monkeypatch.setattr(choose, "interleaved_speeds", no_timing)
    again = prepare_engine(model, "auto", batch_size=4, source=tmp_path, command="predict")
    assert again.name == engine.name and "chosen before" in capsys.readouterr().err
    # another batch size is another shape: measured anew
    with pytest.raises(AssertionError, match="timed again"):
        prepare_engine(model, "auto", batch_size=2, source=tmp_path, quiet=True)
    monkeypatch.setenv("VITLAB_RETIME", "1")  # the user asks for a new measurement
    with pytest.raises(AssertionError, match="timed again"):
        prepare_engine(model, "auto", batch_size=4, source=tmp_path, quiet=True)


def test_changed_weights_get_their_own_artefacts(tmp_path):
    a, b = tiny(), tiny()
    with torch.no_grad():
        b.head.bias.add_(1.0)
    assert choose.artefact_folder(a, tmp_path) != choose.artefact_folder(b, tmp_path)


def test_graphs_of_an_older_vitlab_are_not_reused(tmp_path, monkeypatch):
    model = tiny()
    now = choose.artefact_folder(model, tmp_path)
    assert choose.artefact_folder(model, tmp_path) == now  # same model, same graphs: reused
    monkeypatch.setattr(choose, "GRAPH_VERSION", choose.GRAPH_VERSION - 1)
    assert choose.artefact_folder(model, tmp_path) != now


def test_an_engine_that_changes_the_logits_is_refused(tmp_path, monkeypatch):
    from vitlab.engine import ort

    class Wrong(ort.OrtEngine):
        def __call__(self, x):
            return super().__call__(x) + 0.1

    monkeypatch.setattr(ort, "OrtEngine", Wrong)
    with pytest.raises(VitlabError, match="does not reproduce the model"):
        prepare_engine(tiny(), "onnxruntime", source=tmp_path, quiet=True)


def test_flag_errors_are_one_line(tmp_path):
    model = tiny()
    with pytest.raises(VitlabError, match="not one of"):
        prepare_engine(model, "tensorrt", quiet=True)
    with pytest.raises(VitlabError, match="runs in ONNX Runtime"):
        prepare_engine(model, "torch", int8="dynamic", quiet=True)
    with pytest.raises(VitlabError, match="at least 16 calibration images"):
        prepare_engine(model, "onnxruntime", int8="static", calibration=[images(8).numpy()], source=tmp_path,
                       quiet=True)


def test_int8_graph_carries_fc1_bias_in_the_int8_product(tmp_path):
    """In int8 each FastGelu takes no bias (split_gelu_bias): the bias Add sits after fc1's MatMulInteger, where
    ORT's DynamicQuantizeMatMul fusion absorbs it; the logits stay those of plain dynamic quantization."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from vitlab.engine.ort import INT8_OPS, OrtEngine, _head_nodes, build_int8_dynamic

    model = tiny()
    fp32 = build_fp32(model, tmp_path, (32, 32))
    gelus = [n for n in onnx.load(str(fp32)).graph.node if n.op_type == "FastGelu"]
    assert len(gelus) == model.config.depth and all(len(n.input) == 2 for n in gelus)  # fp32 keeps BiasGelu
    ours = build_int8_dynamic(fp32, tmp_path / "int8.onnx")
    graph = onnx.load(str(ours)).graph
    producer = {out: n for n in graph.node for out in n.output}
    gelus = [n for n in graph.node if n.op_type == "FastGelu"]
    assert len(gelus) == model.config.depth
    for node in gelus:
        assert len(node.input) == 1 and producer[node.input[0]].op_type == "Add"
    assert not list(tmp_path.glob("*.src.onnx"))  # the intermediate graph is removed
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.optimized_model_filepath, opts.log_severity_level = str(tmp_path / "session.onnx"), 3
    ort.InferenceSession(str(ours), opts, providers=["CPUExecutionProvider"])
    session = onnx.load(str(tmp_path / "session.onnx")).graph
    producer = {out: n for n in session.node for out in n.output}
    fed_by = [producer[n.input[0]] for n in session.node if n.op_type == "FastGelu"]
    assert len(fed_by) == model.config.depth  # ORT's own fusion took the bias into the int8 product
    assert all(n.op_type == "DynamicQuantizeMatMul" and len(n.input) == 5 and n.input[4] for n in fed_by)
    plain = tmp_path / "plain.onnx"
    quantize_dynamic(str(fp32), str(plain), weight_type=QuantType.QInt8, op_types_to_quantize=INT8_OPS,
                     per_channel=True, nodes_to_exclude=_head_nodes(fp32),
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    x = images(3)
    assert (OrtEngine(ours, 1)(x) - OrtEngine(plain, 1)(x)).abs().max() < 1e-5


def test_int8_auto_with_few_images_falls_back_to_dynamic(tmp_path, capsys):
    engine = prepare_engine(tiny(), "auto", int8="auto", calibration=[images(8).numpy()], source=tmp_path)
    assert engine.name == "onnxruntime-int8-dynamic" and not engine.exact
    assert "dynamic quantization" in capsys.readouterr().err


def test_resnet_runs_in_onnxruntime_exactly(tmp_path):
    torch.manual_seed(0)
    model = vitlab.create_model("resnet-50", num_classes=7, image_size=64).eval()
    engine = prepare_engine(model, "onnxruntime", source=tmp_path, quiet=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (engine(x) - model(x)).abs().max() < 1e-3


def test_static_int8_keeps_the_kept_models_accuracy(tmp_path):
    """The documented Fashion-MNIST ViT, calibrated on bundled training images, scored on the bundled test
    set: accuracy within a point of fp32 and top-1 agreement >= 97 % (the full test set: docs/benchmarks.md)."""
    from vitlab.data import load_data
    from vitlab.data.preprocess import Preprocess
    from vitlab.engine.calibration import calibration_from_dataset

    model = vitlab.load(KEPT_MODEL)
    pre = Preprocess.for_model(model.config.image_size, model.config.in_chans)
    splits = load_data("bundled", progress=False, report=False)
    calib = calibration_from_dataset(splits.train, pre, limit=192)
    engine = prepare_engine(model, "onnxruntime", int8="static", calibration=calib, source=tmp_path, quiet=True)
    assert engine.name == "onnxruntime-int8-static"
    test = splits.test
    x = torch.cat([pre.batch(test[i][0].unsqueeze(0)) for i in range(len(test))])
    y = np.array([int(test[i][1]) for i in range(len(test))])
    with torch.no_grad():
        fp32 = model(x).argmax(1).numpy()
    int8 = engine(x).argmax(1).numpy()
    assert (int8 == fp32).mean() >= 0.97
    assert abs((int8 == y).mean() - (fp32 == y).mean()) <= 0.01


def test_a_damaged_cached_graph_is_rebuilt(tmp_path, capsys):
    model = tiny()
    engine = prepare_engine(model, "onnxruntime", source=tmp_path, quiet=True)
    cached = engine.path
    cached.write_bytes(cached.read_bytes()[:200])  # a build killed half-way
    again = prepare_engine(model, "onnxruntime", source=tmp_path)
    assert "not built by vitlab on this machine, or has changed since" in capsys.readouterr().err
    x = images(2)
    with torch.no_grad():
        assert (again(x) - model(x)).abs().max() < 1e-4


def test_auto_falls_back_to_torch_when_the_graph_cannot_be_built(tmp_path, monkeypatch, capsys):
    from vitlab.engine import openvino, ort

    def broken(*a, **k):
        raise RuntimeError("exporter does not support this operator")

    monkeypatch.setattr(ort, "build_fp32", broken)
    monkeypatch.setattr(openvino, "build_fp32_ir", broken)
    engine = prepare_engine(tiny(), "auto", batch_size=2, source=tmp_path)
    err = capsys.readouterr().err
    assert engine.name == "torch" and "onnxruntime left out: RuntimeError: exporter does not support" in err
    assert "openvino left out: " in err
    with pytest.raises(VitlabError, match="cannot run this model .RuntimeError"):
        prepare_engine(tiny(), "onnxruntime", source=tmp_path, quiet=True)


def test_inspect_auto_falls_back_to_torch_when_the_graph_cannot_be_built(tmp_path, monkeypatch, capsys):
    from vitlab.engine import attention

    def broken(*a, **k):
        raise RuntimeError("exporter does not support this operator")

    monkeypatch.setattr(attention, "build_with_attention", broken)
    engine = attention.prepare_attention_engine(tiny(), "auto", batch_size=2, source=tmp_path)
    assert engine.name == "torch" and "onnxruntime left out" in capsys.readouterr().err
    with pytest.raises(VitlabError, match="cannot run this model .RuntimeError"):
        attention.prepare_attention_engine(tiny(), "onnxruntime", batch_size=2, source=tmp_path, quiet=True)


def test_compiled_engine_is_exact_and_leaves_inductor_settings_alone(tmp_path, monkeypatch):
    """One real compile (about 20 s): the logits of eager PyTorch, the kernels cached beside the model, and no
    process-wide change to Inductor's config or environment for other torch.compile users."""
    import os

    import torch._inductor.config as inductor_config

    from vitlab.engine.torch_engines import CompiledEngine

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch.manual_seed(0)
    model = vitlab.create_model("custom", image_size=16, patch_size=4, dim=32, depth=1, heads=2, mlp_dim=64,
                                num_classes=3).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    freezing = inductor_config.freezing
    engine = CompiledEngine(model, tmp_path)
    x = images(3, 16)
    with torch.no_grad():
        assert (engine(x) - model(x)).abs().max() < 1e-4
        assert (engine(x[:2]) - model(x[:2])).abs().max() < 1e-4  # a smaller last batch is padded, not recompiled
    assert inductor_config.freezing == freezing
    # Inductor itself fills in its default cache dir when the variable is unset; vitlab's own is not left behind
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(tmp_path / "inductor")
    assert any((tmp_path / "inductor").iterdir())  # the kernels went beside the model


@pytest.mark.parametrize("name, kw", [
    ("custom", dict(dim=32, depth=12, heads=2, mlp_dim=64, patch_size=4, image_size=28, in_chans=1)),
    ("r50+vit-b/16", dict(image_size=64)), ("resnet-18", dict(image_size=32)), ("bit-r50x1", dict(image_size=32)),
])
def test_every_model_compiles_as_one_graph(name, kw):
    """`--engine compiled` traces the whole model at once. A graph break in each block (a ContextVar read in the
    attention route) compiled the block's forward once per block, past dynamo's limit of 8: blocks 9-12 ran eager,
    with ten lines of warnings."""
    model = vitlab.create_model(name, num_classes=5, **kw).eval()
    x = torch.randn(1, model.config.in_chans, *model.config.image_size)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons[:2]


def test_a_folder_marked_read_only_keeps_no_engines_even_for_root(tmp_path, monkeypatch):
    """As root os.access says every folder is writable: inspect wrote FILE.engines/ into a mode-555 folder of
    shared weights. A folder nobody may write goes to the user cache instead."""
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))
    model = tiny()
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "w.npz").write_bytes(b"")
    shared.chmod(0o555)
    try:
        assert choose.artefact_folder(model, shared / "w.npz").parent == tmp_path / "cache" / "engines"
        assert choose.artefact_folder(model, shared).parent == tmp_path / "cache" / "engines"
    finally:
        shared.chmod(0o755)
    assert choose.artefact_folder(model, shared / "w.npz").parent == shared / "w.npz.engines"


@pytest.mark.parametrize("scale, shift, ok", [(3700.0, 1.6e-3, True), (10.0, 1.6e-3, False), (3700.0, 0.1, False)])
def test_the_exactness_check_is_relative_for_large_logits(scale, shift, ok):
    """A standard ResNet whose logits run near 3,700 was refused by ORT and OpenVINO at 1.6e-3 (fp32 summation
    order at that size), though its export passed the same check with export's relative bound."""
    from vitlab.engine.choose import check_exact

    def reference(x):
        return x.flatten(1)[:, :4] * 0 + scale

    class Candidate:
        name = "shifted"

        def __call__(self, x):
            return reference(x) + shift

    if ok:
        assert check_exact(Candidate(), reference, 1, (4, 4)) == pytest.approx(shift, rel=0.1)
    else:
        with pytest.raises(VitlabError, match="does not reproduce the model"):
            check_exact(Candidate(), reference, 1, (4, 4))


def test_candidates_are_timed_in_balanced_orders_without_back_to_back_repeats():
    names = ["torch", "onnxruntime", "compiled"]
    orders = choose.round_orders(names, 30)
    assert orders == choose.round_orders(names, 30)  # seeded: a rerun times the same orders
    assert all(sorted(o) == sorted(names) for o in orders)
    assert all(a[-1] != b[0] for a, b in zip(orders, orders[1:]))  # nobody runs twice in a row
    for position in range(3):  # every candidate takes every place, not one always in the middle
        assert {o[position] for o in orders} == set(names)
    assert choose.round_orders(["torch"], 3) == [["torch"]] * 3


def test_interleaved_speeds_times_each_engine_once_a_round(monkeypatch):
    monkeypatch.setattr(choose, "PAUSE_S", 0.0)
    calls = []
    engines = {n: (lambda x, n=n: calls.append(n)) for n in ("a", "b", "c")}
    speeds = choose.interleaved_speeds(engines, torch.zeros(4, 1), rounds=6)
    assert set(speeds) == {"a", "b", "c"} and all(v > 0 for v in speeds.values())
    timed = calls[3:]  # after one warm-up call each
    assert [sorted(timed[i:i + 3]) for i in range(0, 18, 3)] == [["a", "b", "c"]] * 6
    assert all(timed[i] != timed[i + 1] for i in range(17))


def test_an_engines_failure_reason_is_one_line_cut_at_a_word():
    exc = RuntimeError("InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx:\n"
                       + "Set TORCHINDUCTOR_CXX to a working compiler " * 5)
    text = choose.reason(exc)
    assert "\n" not in text and text.startswith("RuntimeError: InvalidCxxCompiler: No working C++ compiler")
    assert text.endswith(" ...") and len(text) < 200
    assert not text[:-4].endswith(("TOR", "Set TOR"))  # whole words only
    assert choose.reason(RuntimeError("short")) == "RuntimeError: short"
    assert choose.reason(VitlabError("vitlab's own line")) == "vitlab's own line"
