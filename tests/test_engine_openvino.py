"""OpenVINO engines (vitlab.engine.openvino): fp32 against eager PyTorch, the int8 graph's FakeQuantize ranges
against what PyTorch itself measures on the calibration images (forward hooks on the linear layers, per-channel
weight maxima), the choice among int8 variants, export, and one-line refusals."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from vitlab.errors import VitlabError

ov = pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")  # the ORT candidates and the portable export's check
from test_engine import images, tiny  # noqa: E402
from vitlab.engine import choose, prepare_engine  # noqa: E402
from vitlab.engine.openvino import (  # noqa: E402
    OvEngine,
    build_fp32_ir,
    build_int8_ir,
    core,
    int8_inputs,
    linear_layers,
    require_openvino,
)


def test_fp32_model_reproduces_eager_pytorch(tmp_path):
    model = tiny()
    engine = OvEngine(build_fp32_ir(model, tmp_path, (32, 32)), threads=1)
    for n in (1, 5):  # one file for any batch size
        x = images(n)
        with torch.no_grad():
            assert (engine(x) - model(x)).abs().max() < 1e-4
    asked = prepare_engine(model, "openvino", source=tmp_path, quiet=True)
    assert asked.name == "openvino" and "openvino (as asked)" in asked.note


def linear_inputs_in_torch(model, batches, monkeypatch) -> dict[str, tuple[float, float]]:
    """(min, max) of the input of every block's linear layer over `batches`, 0 included, measured by PyTorch
    itself: the LayerNorms' outputs (qkv, fc1) and the inputs of proj and fc2 (torch's own nn.Linear calls, not the
    oneDNN route, which bypasses the modules' hooks)."""
    from vitlab.models import fast_linear

    monkeypatch.setattr(fast_linear, "ONEDNN_LINEAR", False)
    seen: dict[str, tuple[float, float]] = {}

    def record(name, x):
        lo, hi = seen.get(name, (0.0, 0.0))
        seen[name] = (min(lo, float(x.min())), max(hi, float(x.max())))

    hooks = []
    for i, block in enumerate(model.blocks):
        for name, norm in (("qkv", block.norm1), ("fc1", block.norm2)):
            hooks.append(norm.register_forward_hook(lambda _, args, out, key=f"{i}.{name}": record(key, out)))
        for name, module in (("proj", block.attn.proj), ("fc2", block.mlp.fc2)):
            hooks.append(module.register_forward_pre_hook(lambda _, args, key=f"{i}.{name}": record(key, args[0])))
    with torch.no_grad():
        for batch in batches:
            model(torch.from_numpy(batch))
    for h in hooks:
        h.remove()
    assert len(seen) == 4 * len(model.blocks)
    return seen


def test_int8_ranges_are_those_pytorch_measures(tmp_path, monkeypatch):
    model = tiny()
    calibration = [images(16, seed=s).numpy() for s in (3, 4)]
    xml = build_int8_ir(build_fp32_ir(model, tmp_path, (32, 32)), tmp_path / "int8.xml", calibration, threads=1)
    quantized = core().read_model(str(xml))
    fq = [op for op in quantized.get_ordered_ops() if op.get_type_name() == "FakeQuantize"]
    depth = model.config.depth
    # qkv, proj, fc1, fc2 of each block: weights and inputs; qkv's input may be the class token's alone in the last
    # block (the graph computes that token only), so count weights for the layers
    weights = [op for op in fq if op.input_value(0).get_node().get_type_name() == "Constant"]
    assert len(weights) == 4 * depth
    # every output channel's max |w|, as PyTorch's weights give them
    expected_weights = np.sort(np.concatenate([w.detach().abs().amax(1).numpy() for n, w in model.blocks.named_parameters()
                                               if n.endswith("weight") and w.ndim == 2]))
    found_weights = np.sort(np.concatenate([op.input_value(2).get_node().get_data().ravel() for op in weights]))
    assert np.allclose(found_weights, expected_weights, rtol=1e-6)
    for op in weights:  # one scale per output channel, symmetric, 255 levels
        low, high = op.input_value(1).get_node().get_data(), op.input_value(2).get_node().get_data()
        assert low.size > 1 and np.array_equal(low, -high) and op.get_attributes()["levels"] == 255
    activations = [op for op in fq if op not in weights]
    measured = linear_inputs_in_torch(model, calibration, monkeypatch)
    found = {}
    for op in activations:
        layer = next(iter(op.output(0).get_target_inputs())).get_node().get_friendly_name()  # /blocks.1/mlp/fc2/MatMul
        block, name = layer.split("/")[1].split(".")[1], layer.split("/")[3]
        found[f"{block}.{name}"] = (float(op.input_value(1).get_node().get_data()),
                                    float(op.input_value(2).get_node().get_data()))
    assert sorted(found) == sorted(measured)
    last = str(depth - 1)
    for key, (lo, hi) in found.items():
        if key.startswith(f"{last}.") and not key.endswith("qkv"):
            # the graph computes the last block for the class token alone; PyTorch, watched by hooks, for every
            # token (models/vit.py): the graph's range lies within
            assert measured[key][0] - 1e-6 <= lo <= 0 <= hi <= measured[key][1] + 1e-6, key
        else:
            assert np.allclose((lo, hi), measured[key], rtol=1e-4, atol=1e-6), key
    assert all(op.get_attributes()["levels"] == 256 for op in activations)
    # the patch embedding and the classifier stay fp32
    assert len(linear_layers(core().read_model(str(tmp_path / "openvino-fp32.xml")))) == 4 * depth
    assert int8_inputs(quantized) == 4 * depth


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_int8_engine_stays_close_to_fp32(tmp_path, precision):
    from vitlab.engine.openvino import bf16_supported

    if precision == "bf16" and not bf16_supported():
        pytest.skip("this CPU computes no bf16 in OpenVINO")
    model = tiny()
    calibration = [images(32, seed=5).numpy()]
    xml = build_int8_ir(build_fp32_ir(model, tmp_path, (32, 32)), tmp_path / "int8.xml", calibration, threads=1)
    engine = OvEngine(xml, threads=1, exact=False, precision=precision)
    x = images(32, seed=6)
    with torch.no_grad():
        ref = model(x)
    out = engine(x)
    assert float((out - ref).abs().max() / ref.abs().max()) < 0.1
    assert float((out.argmax(1) == ref.argmax(1)).float().mean()) >= 0.9


def test_int8_choice_includes_openvino_and_is_named(tmp_path, monkeypatch):
    timed = []

    def speeds(engines, x, *a, **k):
        timed.append((sorted(engines), len(x)))
        return {m: {"openvino-static": 30.0}.get(m, 10.0) for m in engines}

    monkeypatch.setattr(choose, "interleaved_speeds", speeds)
    monkeypatch.setattr(choose, "_agreement", lambda engine, reference, holdout: (1.0, len(holdout)))
    engine = prepare_engine(tiny(), "auto", int8="auto", calibration=[images(64).numpy()], source=tmp_path,
                            quiet=True, sub_batches=False, batch_size=5)
    assert engine.name == "openvino-int8-static" and {"static", "dynamic", "openvino-static"} <= set(timed[0][0])
    assert timed[0][1] == 5  # timed at the command's batch: the winner changes with it
    prepare_engine(tiny(), "auto", int8="auto", calibration=[images(64).numpy()], source=tmp_path, quiet=True,
                   sub_batches=False, batch_size=60)  # more than the 48 calibration images: repeated
    assert len(timed) == 2 and timed[1][1] == 60
    assert "int8 auto: " in engine.note and "openvino-int8-static 30.0 images/s" in engine.note
    only_ort = choose.int8_candidates("onnxruntime", "auto")
    assert only_ort == ["static", "dynamic"]
    assert choose.int8_candidates("openvino", "static")[0] == "openvino-static"


def test_int8_auto_leaves_out_a_runtime_that_cannot_build_the_model(tmp_path, monkeypatch):
    """Seen with oneDNN held to AVX2: OpenVINO found no Softmax kernel, and `--int8 static --engine auto` failed
    as a whole although ONNX Runtime's static graph built. Under auto such a runtime is left out, with why."""
    real = choose._Builder.int8

    def int8(self, mode, *args, **kwargs):
        if mode.startswith("openvino"):
            raise RuntimeError("Supported primitive descriptors list is empty for node: Softmax")
        return real(self, mode, *args, **kwargs)

    monkeypatch.setattr(choose._Builder, "int8", int8)
    monkeypatch.setattr(choose, "_agreement", lambda engine, reference, holdout: (1.0, len(holdout)))
    engine = prepare_engine(tiny(), "auto", int8="static", calibration=[images(64).numpy()], source=tmp_path,
                            quiet=True, sub_batches=False, batch_size=4)
    assert engine.name == "onnxruntime-int8-static"
    assert "openvino-static left out: RuntimeError: Supported primitive descriptors list is empty" in engine.note
    with pytest.raises(VitlabError, match=r"int8 cannot be built for this model \(RuntimeError: Supported primitive"):
        prepare_engine(tiny(), "openvino", int8="static", calibration=[images(64).numpy()], source=tmp_path,
                       quiet=True, sub_batches=False, batch_size=4)


def test_openvino_int8_refusals_are_one_line(tmp_path):
    with pytest.raises(VitlabError, match="OpenVINO's int8 is static"):
        prepare_engine(tiny(), "openvino", int8="dynamic", quiet=True, source=tmp_path)
    with pytest.raises(VitlabError, match="static int8 needs calibration images: add --calibration DATA"):
        prepare_engine(tiny(), "openvino", int8="auto", quiet=True, source=tmp_path)


@pytest.mark.parametrize("missing", ["openvino", "onnx"])
def test_missing_openvino_is_one_line_and_auto_goes_on(tmp_path, monkeypatch, capsys, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    with pytest.raises(VitlabError, match=r"pip install 'vitlab\[openvino\]'"):
        require_openvino()
    with pytest.raises(VitlabError, match=r"vitlab\[openvino\]"):
        prepare_engine(tiny(), "openvino", source=tmp_path, quiet=True)
    engine = prepare_engine(tiny(), "auto", batch_size=2, source=tmp_path)
    err = capsys.readouterr().err
    assert "openvino left out: this engine needs OpenVINO and onnx" in err and "OpenVINO model" not in err
    assert engine.name in ("torch", "onnxruntime")
    assert choose.int8_candidates("auto", "auto") == ["static", "dynamic"]


def test_a_damaged_cached_model_is_built_again(tmp_path, capsys):
    model = tiny()
    prepare_engine(model, "openvino", source=tmp_path, quiet=True)
    xml = choose.artefact_folder(model, tmp_path) / "openvino-fp32.xml"
    xml.write_text(xml.read_text()[:300])  # a build killed half-way, or an edit by hand
    again = prepare_engine(model, "openvino", source=tmp_path)
    assert "not built by vitlab on this machine, or has changed since" in capsys.readouterr().err
    x = images(2)
    with torch.no_grad():
        assert (again(x) - model(x)).abs().max() < 1e-4


def test_export_writes_the_openvino_model_with_metadata(tmp_path):
    from vitlab.export import export_for_engine

    model = tiny()
    with pytest.raises(VitlabError, match="name it OUT.xml"):
        export_for_engine(model, tmp_path / "m.onnx", "openvino", source=tmp_path)
    calibration = [images(32, seed=7).numpy()]
    path, kind = export_for_engine(model, tmp_path / "out" / "m.xml", "openvino", int8="static",
                                   calibration=calibration, source=tmp_path, metadata={"class_names": ["a"]},
                                   quiet=True)
    assert kind.startswith("openvino int8 static") and path.with_suffix(".bin").is_file()
    read = core().read_model(str(path))
    assert json.loads(read.get_rt_info(["vitlab"]).astype(str))["class_names"] == ["a"]
    assert any(op.get_type_name() == "FakeQuantize" for op in read.get_ordered_ops())
    compiled = core().compile_model(read, "CPU")
    x = images(3)
    with torch.no_grad():
        assert compiled(x.numpy())[0].shape == (3, 10)


def test_int8_without_onnxruntime_runs_openvino_alone(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    found = choose.int8_candidates("auto", "auto")
    assert found and all(m.startswith("openvino") for m in found)
    with pytest.raises(VitlabError, match=r"vitlab\[onnx\]"):  # dynamic int8 is ONNX Runtime's alone
        choose.int8_candidates("auto", "dynamic")


def test_static_int8_across_runtimes_is_not_called_int8_auto(tmp_path, monkeypatch):
    """--int8 static --engine auto times static int8 in each runtime; the line said 'int8 auto', a choice between
    static and dynamic the user had not asked for."""
    monkeypatch.setattr(choose, "interleaved_speeds",
                        lambda engines, *a, **k: {m: {"openvino-static": 30.0}.get(m, 10.0) for m in engines})
    monkeypatch.setattr(choose, "_agreement", lambda engine, reference, holdout: (1.0, len(holdout)))
    engine = prepare_engine(tiny(), "auto", int8="static", calibration=[images(64).numpy()], source=tmp_path,
                            quiet=True, sub_batches=False, batch_size=5)
    assert "int8 static, fastest runtime: " in engine.note and "int8 auto" not in engine.note
    again = prepare_engine(tiny(), "auto", int8="static", calibration=[images(64).numpy()], source=tmp_path,
                           quiet=True, sub_batches=False, batch_size=5)
    assert "int8 static, fastest runtime, chosen before" in again.note
