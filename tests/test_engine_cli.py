"""`--engine` / `--int8` / `--calibration` on predict, evaluate, inspect and export: the same answers as eager
PyTorch (exact engines), one-line refusals, the choice announced once and cached beside the model."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.errors import VitlabError

ort = pytest.importorskip("onnxruntime")
KEPT_MODEL = Path(__file__).resolve().parents[1] / "docs" / "figures" / "fmnist_vit_model"


@pytest.fixture()
def model_dir(tmp_path):
    """A copy of the documented Fashion-MNIST ViT (engines write their artefacts beside the model)."""
    dst = tmp_path / "model"
    # without engines a local run may have left beside the kept model (ignored by git): the tests look at the
    # folders their own calls build
    shutil.copytree(KEPT_MODEL, dst, ignore=shutil.ignore_patterns("engines"))
    return dst


@pytest.fixture()
def images(tmp_path):
    from vitlab.data import load_data

    test = load_data("bundled", progress=False, report=False).test
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(40):
        Image.fromarray(test[i][0][0].numpy()).save(folder / f"{i:03d}.png")
    return folder


def _predict_json(capsys, *argv) -> list[dict]:
    assert main(["predict", *argv, "--format", "json", "--top-k", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def _predict_err(capsys, *argv) -> tuple[list[dict], str]:
    assert main(["predict", *argv, "--format", "json", "--top-k", "1"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_predict_engines_agree_with_torch(model_dir, images, capsys):
    on_cpu = ("--device", "cpu")  # on a GPU machine `auto` runs torch on the GPU and times nothing
    ref = _predict_json(capsys, str(model_dir), str(images), "--engine", "torch", *on_cpu)
    for engine in ("onnxruntime", "auto"):
        out = _predict_json(capsys, str(model_dir), str(images), "--engine", engine, *on_cpu)
        assert [r["top"][0]["label"] for r in out] == [r["top"][0]["label"] for r in ref]
        assert np.allclose([r["top"][0]["probability"] for r in out], [r["top"][0]["probability"] for r in ref],
                           atol=1e-4)
    assert (next((model_dir / "engines").iterdir()) / "choices.json").is_file()


def test_engine_torch_runs_the_eager_engine_that_auto_times(model_dir, images, capsys, monkeypatch):
    """`--engine torch` on the CPU ran `model(x)`: no packed weights, no one-thread rule for the smallest calls
    (a fifth of the engine's speed after a pause at batch 1 on the Fashion-MNIST ViT). It runs TorchEngine now, says
    so, builds and writes nothing, and answers as the model does."""
    import vitlab
    from vitlab.engine import torch_engines
    from vitlab.predict import predict_files

    calls = []
    real = torch_engines.TorchEngine.__call__
    monkeypatch.setattr(torch_engines.TorchEngine, "__call__",
                        lambda self, x, **kw: calls.append(len(x)) or real(self, x, **kw))
    out, err = _predict_err(capsys, str(model_dir), str(images), "--engine", "torch", "--device", "cpu",
                            "--batch-size", "16")
    assert calls == [16, 16, 8] and "vitlab predict: engine: torch (eager, as asked)" in err
    assert not (model_dir / "engines").exists()
    model, meta = vitlab.weights.load_with_meta(model_dir)
    files = sorted(images.iterdir())
    expected = predict_files(model, meta, files, top_k=1, batch_size=16)[0]  # the model itself
    assert [r["top"][0]["label"] for r in out] == [p.labels[0] for p in expected]
    assert np.allclose([r["top"][0]["probability"] for r in out], [p.probs[0] for p in expected], rtol=0, atol=1e-6)

    assert main(["evaluate", str(model_dir), "--data", "bundled", "--device", "cpu", "--engine", "torch",
                 "--out", str(model_dir.parent / "eval")]) == 0
    assert "vitlab evaluate: engine: torch (eager, as asked)" in capsys.readouterr().err


@pytest.mark.parametrize("engine,named", [("onnxruntime", "engine: onnxruntime-int8-static"),
                                          ("auto", "-int8-static"), ("openvino", "engine: openvino-int8-static")])
def test_predict_int8_runs_and_names_itself(model_dir, images, capsys, engine, named):
    if engine == "openvino":
        pytest.importorskip("openvino")
    assert main(["predict", str(model_dir), str(images), "--int8", "static", "--engine", engine, "--top-k", "1",
                 "--calibration", str(images)]) == 0
    err = capsys.readouterr().err
    assert named in err and "held-out images" in err


def test_predict_static_int8_calibrates_on_the_runs_training_images(tmp_path, model_dir, images, capsys):
    """Static int8 without --calibration: a run's own training images, so an image's answer does not depend on the
    other images of the call (it calibrated on those); a model that is not a run needs --calibration."""
    from vitlab.train import resolve_config, train
    from vitlab.train.checkpoint import CheckpointManager

    cfg = resolve_config("demo", overrides={"steps": 2, "batch_size": 16, "out_dir": str(tmp_path), "name": "run",
                                            "quiet": True})
    run = train(cfg).run_dir
    capsys.readouterr()
    first = sorted(images.iterdir())[0]
    answers = []
    for others in (sorted(images.iterdir())[1:20], sorted(images.iterdir())[20:]):
        call = tmp_path / f"call{len(answers)}"
        call.mkdir()
        for f in [first, *others]:
            shutil.copy(f, call / f.name)
        out, err = _predict_err(capsys, str(run), str(call), "--int8", "static", "--engine", "onnxruntime")
        answers.append(out[0]["top"][0])
        assert "onnxruntime-int8-static" in err
    assert answers[0] == answers[1]
    assert main(["predict", str(run / "model"), str(first), "--int8", "static", "--engine", "onnxruntime",
                 "--quiet"]) == 0  # RUN/model is the run too
    step = CheckpointManager(run / "checkpoints").latest()
    assert main(["predict", str(step), str(first), "--int8", "static", "--engine", "onnxruntime",
                 "--quiet"]) == 0  # and so is one of its checkpoints (evaluate.loading.run_of)
    capsys.readouterr()
    assert main(["predict", str(model_dir), str(first), "--int8", "static", "--engine", "onnxruntime"]) == 2
    assert "static int8 needs calibration images: add --calibration DATA" in capsys.readouterr().err


def test_evaluate_engine_gives_torchs_accuracy(model_dir, tmp_path, capsys):
    accuracies = {}
    for engine in ("torch", "onnxruntime"):
        out = tmp_path / f"eval-{engine}"
        assert main(["evaluate", str(model_dir), "--data", "bundled", "--engine", engine, "--out", str(out),
                     "--quiet"]) == 0
        accuracies[engine] = json.loads((out / "metrics.json").read_text())
    capsys.readouterr()
    rows = {k: v["rows"][0] for k, v in accuracies.items()}
    assert rows["torch"]["method"] == "head" and 0.85 < rows["torch"]["accuracy"] < 1
    assert rows["onnxruntime"]["accuracy"] == rows["torch"]["accuracy"]
    assert rows["onnxruntime"]["macro_f1"] == rows["torch"]["macro_f1"]


def test_export_onnxruntime_and_int8(model_dir, tmp_path, capsys):
    out = tmp_path / "fused.onnx"
    assert main(["export", str(model_dir), str(out), "--engine", "onnxruntime"]) == 0
    import onnx

    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert "Attention" in ops and "LayerNormalization" in ops and "FastGelu" not in ops  # erf GELU: BiasGelu
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(meta["vitlab"])["class_names"][0] == "T-shirt/top"
    q = tmp_path / "int8.onnx"
    capsys.readouterr()
    assert main(["export", str(model_dir), str(q), "--int8", "static", "--calibration", "bundled"]) == 0
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(str(q)).graph.node)
    # the same words as the portable export's line: a free batch (as the graph has) and where the metadata is
    assert "input 'images' Bx1x28x28, output 'logits' Bx10; class names" in capsys.readouterr().out
    batch_dim = onnx.load(str(q)).graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value
    assert json.loads({p.key: p.value for p in onnx.load(str(q)).metadata_props}["vitlab"])["class_names"]
    assert main(["export", str(model_dir), str(tmp_path / "x.onnx"), "--int8", "static"]) == 2
    assert "--calibration" in capsys.readouterr().err
    assert main(["export", str(model_dir), str(tmp_path / "x.onnx"), "--engine", "compiled"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_inspect_onnxruntime_matches_torch(model_dir, tmp_path, capsys):
    runs = {}
    for engine in ("torch", "onnxruntime"):
        out = tmp_path / f"inspect-{engine}"
        assert main(["inspect", str(model_dir), "--data", "bundled", "-n", "16", "--rollout-images", "2",
                     "--engine", engine, "--out", str(out), "--quiet"]) == 0
        runs[engine] = np.load(out / "inspect.npz")
    capsys.readouterr()
    for key in ("attention_distance_per_image", "rollout_maps", "predictions"):
        assert np.allclose(runs["torch"][key], runs["onnxruntime"][key], atol=1e-4), key


def test_engines_other_than_torch_refuse_a_gpu_in_one_line():
    from vitlab.commands._engine_args import engine_for

    args = argparse.Namespace(engine="onnxruntime", int8=None, quiet=True)
    with pytest.raises(VitlabError, match="runs on the CPU"):
        engine_for(args, None, source=None, preprocess=None, batch_size=1, device=torch.device("cuda"),
                   command="predict")
    args.engine = "auto"  # auto on a GPU: the torch model, as before
    assert engine_for(args, None, source=None, preprocess=None, batch_size=1, device=torch.device("cuda"),
                      command="predict") is None


def test_auto_never_runs_a_cached_graph_it_did_not_build(model_dir, images, tmp_path, capsys):
    """A graph in MODEL/engines/ that vitlab did not write there (edited, or brought by a copied folder) is rebuilt,
    never run: `auto` reuses its cached pick without comparing the graph with the weights."""
    import vitlab
    from vitlab.engine.ort import build_fp32

    on_cpu = ("--device", "cpu", "--engine", "auto")
    ref = _predict_json(capsys, str(model_dir), str(images), "--engine", "torch", "--device", "cpu")
    _predict_json(capsys, str(model_dir), str(images), *on_cpu)
    folder = next((model_dir / "engines").iterdir())
    choices = json.loads((folder / "choices.json").read_text())
    for entry in choices.values():  # whatever was faster here, the next call takes the ONNX Runtime graph
        entry["picked"] = "onnxruntime"
    (folder / "choices.json").write_text(json.dumps(choices))
    assert "building" not in _predict_err(capsys, str(model_dir), str(images), *on_cpu)[1]  # its own, unchanged

    other = vitlab.load(model_dir)
    with torch.no_grad():
        other.head.bias[0] += 20  # the graph of another model, put in place of this one's
    (tmp_path / "evil").mkdir()
    shutil.copy(build_fp32(other.eval(), tmp_path / "evil", tuple(other.config.image_size)), folder / "fp32.onnx")
    out, err = _predict_err(capsys, str(model_dir), str(images), *on_cpu)
    assert "not built by vitlab on this machine, or has changed" in err
    assert [r["top"][0]["label"] for r in out] == [r["top"][0]["label"] for r in ref]
    assert np.allclose([r["top"][0]["probability"] for r in out], [r["top"][0]["probability"] for r in ref],
                       atol=1e-4)

    copied = tmp_path / "copied"  # a model folder copied with its engines: not built here
    shutil.copytree(model_dir, copied)
    assert "not built by vitlab on this machine" in _predict_err(capsys, str(copied), str(images), *on_cpu)[1]


def test_evaluate_records_the_engine_in_its_report(model_dir, tmp_path, capsys):
    for flags, name in ((["--engine", "torch"], "torch"), (["--int8", "dynamic", "--engine", "onnxruntime"],
                                                                  "onnxruntime-int8-dynamic")):
        out = tmp_path / name.split()[0]
        assert main(["evaluate", str(model_dir), "--data", "bundled", "--device", "cpu", *flags, "--out", str(out),
                     "--quiet"]) == 0
        info = json.loads((out / "metrics.json").read_text())["info"]
        assert info["engine"]["name"] == name
        assert f"Engine: {name}." in (out / "report.md").read_text()


def test_an_int8_evaluation_keeps_the_fp32_report(tmp_path, capsys):
    """`vitlab evaluate RUN --int8 ...` wrote over RUN/eval-test/: the fp32 report (with its few-shot and kNN rows)
    was gone, and only a line inside report.md said the numbers were int8's."""
    from vitlab.train import resolve_config, train

    cfg = resolve_config("demo", overrides={"steps": 2, "batch_size": 16, "out_dir": str(tmp_path), "name": "run",
                                            "quiet": True})
    run = train(cfg).run_dir
    assert main(["evaluate", str(run), "--quiet", "--engine", "torch"]) == 0
    assert main(["evaluate", str(run), "--quiet", "--engine", "onnxruntime", "--int8", "dynamic"]) == 0
    fp32 = json.loads((run / "eval-test" / "metrics.json").read_text())
    int8 = json.loads((run / "eval-test-int8-dynamic" / "metrics.json").read_text())
    assert "int8" not in json.dumps(fp32.get("info", {}).get("engine", {})) and "int8" in json.dumps(int8)
    capsys.readouterr()
