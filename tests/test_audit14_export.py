"""Audit of ONNX export and the ONNX engines: models over protobuf's 2 GB, output names, graphs per image size."""

import json

import numpy as np
import pytest
import torch

import vitlab
from vitlab.cli import main

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

# bytes: the tiny model's weights exceed it as ViT-H's (2.5 GB) exceed protobuf's 2 GB
LIMIT = 40_000
REAL_LIMIT = onnx.checker.MAXIMUM_PROTOBUF


def _tiny(**kw):
    model = vitlab.create_model("custom", dim=32, depth=2, heads=4, mlp_dim=64, patch_size=4, image_size=16,
                                num_classes=5, seed=0, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def _small_resnet():
    model = vitlab.create_model("resnet-18", num_classes=5, image_size=32, layers=(1, 1), base_width=8, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    return model.eval()


@pytest.fixture
def protobuf_limit(monkeypatch):
    """protobuf's 2 GB limit brought down to LIMIT, with what happens at it: torch's exporter writes each weight
    as its own file beside the graph, and serializing a larger message fails."""
    real_export, real_save = torch.onnx.export, onnx.save_model

    def export(model, args, f, *a, **kw):
        real_export(model, args, f, *a, **kw)
        proto = onnx.load(str(f))
        if proto.ByteSize() > LIMIT:
            real_save(proto, str(f), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)

    def save(proto, f, *a, **kw):  # at the limit the test has set (LIMIT, unless it puts 2 GB back)
        if not kw.get("save_as_external_data") and proto.ByteSize() > onnx.checker.MAXIMUM_PROTOBUF:
            raise ValueError("Message onnx.ModelProto exceeds maximum protobuf size of 2GB")
        return real_save(proto, f, *a, **kw)

    monkeypatch.setattr(onnx.checker, "MAXIMUM_PROTOBUF", LIMIT)
    monkeypatch.setattr(torch.onnx, "export", export)
    monkeypatch.setattr(onnx, "save", save)
    monkeypatch.setattr(onnx, "save_model", save)


def test_export_over_protobuf_limit_writes_graph_and_one_data_file(tmp_path, protobuf_limit, capsys):
    # before: the metadata was added by loading and saving the whole graph again, which fails over 2 GB
    # (EncodeError), with torch's per-weight files left beside the output
    from vitlab.weights import save_native

    model = _tiny()
    save_native(model, tmp_path / "native", class_names=list("abcde"))
    out = tmp_path / "out" / "m.onnx"
    assert main(["export", str(tmp_path / "native"), str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.onnx", "m.onnx.data"]
    assert "its weights in m.onnx.data beside it" in capsys.readouterr().out
    onnx.checker.check_model(str(out), full_check=True)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert json.loads(session.get_modelmeta().custom_metadata_map["vitlab"])["class_names"] == list("abcde")
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x).numpy()
    assert np.abs(session.run(["logits"], {"images": x.numpy()})[0] - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("separate", [False, True], ids=["fused-here", "fused-in-own-process"])
def test_onnxruntime_engines_of_a_model_over_the_limit_keep_one_weights_file(tmp_path, protobuf_limit, monkeypatch,
                                                                            separate):
    # before 2026-11-28 refused in one line (ViT-H had no ONNX Runtime engine, no int8); before that torch wrote the
    # weights as per-weight files into MODEL/engines/ and the optimizer or the quantizer failed on saving them.
    # A model as large as ViT-H is fused in a process of its own that reads the per-weight files lazily
    from vitlab.engine import ort as ort_engine
    from vitlab.engine import prepare_engine

    monkeypatch.setattr(ort_engine, "SEPARATE_FUSION_MIN_BYTES", 0 if separate else 1 << 60)
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "user-cache"))
    model = _tiny()
    source = tmp_path / "model"
    source.mkdir()
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x)
    engine = prepare_engine(model, "onnxruntime", source=source, quiet=True)
    assert float((engine(x) - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    (folder,) = (source / "engines").iterdir()
    graph_only = onnx.load(str(folder / "fp32.onnx"), load_external_data=False)
    assert any(node.op_type == "FastGelu" for node in graph_only.graph.node)  # ORT's optimizer ran
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(("choices", ".lock"))) == [
        "fp32.onnx", "fp32.onnx.data"]  # no per-weight files, no build folder left
    assert (folder / "fp32.onnx.data").stat().st_mode & 0o777 == (folder / "fp32.onnx").stat().st_mode & 0o777
    # int8 from that graph: a quarter of the weights, one file again (the limit back at 2 GB, which LIMIT less the
    # 1 MiB margin of `fits_one_protobuf` cannot show at this size)
    monkeypatch.setattr(onnx.checker, "MAXIMUM_PROTOBUF", REAL_LIMIT)
    int8 = prepare_engine(model, "onnxruntime", int8="dynamic", source=source, quiet=True, sub_batches=False)
    assert float((int8(x) - ref).abs().max()) < 0.05 * float(ref.abs().max())
    assert (folder / "int8-dynamic.onnx").is_file() and not list(folder.glob("*.src.onnx*"))
    # the weights file is checked with the graph: changed, the graph is built again instead of run
    monkeypatch.setattr(onnx.checker, "MAXIMUM_PROTOBUF", LIMIT)
    data = folder / "fp32.onnx.data"
    built = data.read_bytes()
    data.write_bytes(built[:-4] + b"\0\0\0\0")
    again = prepare_engine(model, "onnxruntime", source=source, quiet=True)
    assert data.read_bytes() == built  # built again, the same bytes
    assert float((again(x) - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_onnxruntime_engine_of_a_resnet_over_the_limit(tmp_path, protobuf_limit, monkeypatch):
    """Not a ViT: no fusions, the exported graph itself, written again with its weights in one file (torch leaves
    one file per weight)."""
    from vitlab.engine import prepare_engine

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "user-cache"))
    model = _small_resnet()
    source = tmp_path / "model"
    source.mkdir()
    from vitlab.engine.choose import artefact_folder

    killed = artefact_folder(model, source) / ".build-killed"  # what a build killed half-way leaves
    killed.mkdir(parents=True)
    (killed / "onnx__Conv_1").write_bytes(b"a per-weight file")
    engine = prepare_engine(model, "onnxruntime", source=source, quiet=True)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x)
    assert float((engine(x) - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    (folder,) = (source / "engines").iterdir()
    assert sorted(p.name for p in folder.iterdir() if p.suffix in (".onnx", ".data")) == ["fp32.onnx",
                                                                                        "fp32.onnx.data"]
    assert not list(folder.glob(".build-*"))


def test_attention_graph_of_a_model_over_the_limit(tmp_path, protobuf_limit, monkeypatch):
    from vitlab.engine.attention import prepare_attention_engine

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "user-cache"))
    model = _tiny()
    source = tmp_path / "model"
    source.mkdir()
    engine = prepare_attention_engine(model, "onnxruntime", source=source, quiet=True)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    logits, maps = engine(x)
    with torch.no_grad():
        ref = model(x)
    assert float((logits - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) and len(maps) == 2
    (folder,) = (source / "engines").iterdir()
    assert {"fp32-attention.onnx", "fp32-attention.onnx.data"} <= {p.name for p in folder.iterdir()}
    assert not list(folder.glob(".build-*"))


def test_export_for_onnxruntime_of_a_model_over_the_limit(tmp_path, protobuf_limit, monkeypatch, capsys):
    from vitlab.weights import save_native

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "user-cache"))
    model = _tiny()
    save_native(model, tmp_path / "native", class_names=list("abcde"))
    out = tmp_path / "out" / "m.onnx"
    assert main(["export", str(tmp_path / "native"), str(out), "--engine", "onnxruntime"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.onnx", "m.onnx.data"]
    assert (out.parent / "m.onnx.data").stat().st_mode & 0o777 == out.stat().st_mode & 0o777  # onnx made it 0600
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    meta = json.loads(session.get_modelmeta().custom_metadata_map["vitlab"])
    assert meta["class_names"] == list("abcde") and meta["engine"] == "onnxruntime fp32 (fused)"
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x).numpy()
    assert np.abs(session.run(["logits"], {"images": x.numpy()})[0] - ref).max() <= 1e-5 * np.abs(ref).max()


def test_int8_of_a_model_whose_int8_weights_exceed_the_limit_is_refused_in_one_line(tmp_path, monkeypatch):
    from vitlab.engine import prepare_engine
    from vitlab.errors import VitlabError

    monkeypatch.setattr(onnx.checker, "MAXIMUM_PROTOBUF", LIMIT // 8)  # the int8 weights (a quarter) exceed it
    source = tmp_path / "model"
    source.mkdir()
    with pytest.raises(VitlabError, match="int8 graphs are one ONNX file of at most 2 GB") as caught:
        prepare_engine(_tiny(), "onnxruntime", int8="dynamic", source=source, quiet=True)
    assert "\n" not in str(caught.value)


def test_openvino_build_of_a_model_over_the_limit_leaves_no_weight_files(tmp_path, protobuf_limit):
    pytest.importorskip("openvino")
    from vitlab.engine import prepare_engine

    model = _tiny()
    source = tmp_path / "model"
    source.mkdir()
    engine = prepare_engine(model, "openvino", source=source, quiet=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert float((engine(x) - model(x)).abs().max()) < 1e-4
    (folder,) = (source / "engines").iterdir()
    # and choices.json, where the check against eager PyTorch is recorded (engine/choose.py `_remember_checked`)
    assert sorted(p.name for p in folder.iterdir()) == ["choices.json", "openvino-fp32.bin", "openvino-fp32.xml"]


@pytest.mark.parametrize("name", ["out", "out.txt", "folder/"])
def test_export_refuses_a_name_that_is_not_onnx(tmp_path, capsys, name):
    # before: `vitlab export MODEL out/` wrote an ONNX file named `out`, and out.txt as given
    from vitlab.weights import save_native

    save_native(_tiny(), tmp_path / "native")
    target = str(tmp_path / name) + ("/" if name.endswith("/") else "")
    assert main(["export", str(tmp_path / "native"), target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "name it OUT.onnx" in err[0]
    assert not (tmp_path / name.rstrip("/")).exists()


def test_export_takes_onnx_in_any_case(tmp_path, capsys):
    from vitlab.weights import save_native

    save_native(_tiny(), tmp_path / "native")
    assert main(["export", str(tmp_path / "native"), str(tmp_path / "m.ONNX"), "--quiet"]) == 0
    assert (tmp_path / "m.ONNX").is_file()


def test_engine_at_another_image_size_builds_its_own_graph(tmp_path):
    # before: the graph built at the config's 32 px was reused at 48 px (one fingerprint), and ONNX Runtime refused
    # the images ("Got invalid dimensions"): `engine onnxruntime cannot run this model`
    from vitlab.engine import prepare_engine

    model = _small_resnet()
    source = tmp_path / "model"
    source.mkdir()
    for size in ((32, 32), (48, 48), (32, 32)):
        engine = prepare_engine(model, "onnxruntime", image_size=size, source=source, quiet=True)
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            assert float((engine(x) - model(x)).abs().max()) < 1e-4
    assert len(list((source / "engines").glob("*/fp32.onnx"))) == 2


def test_portable_export_is_one_file_and_valid_at_every_opset(tmp_path):
    """The portable graph below the limit: one file, no temporary folder left, valid for onnx's full check."""
    from vitlab.export import export_onnx

    model = _tiny(classifier="map")
    for opset in (14, 18):
        path = export_onnx(model, tmp_path / f"m{opset}.onnx", opset=opset, metadata={"class_names": list("abcde")})
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m14.onnx", "m18.onnx"]


def test_a_build_short_of_memory_is_refused_in_one_line_and_auto_runs_torch(tmp_path, monkeypatch):
    """A build holds several copies of the weights at its peak: ViT-H/14's build on a 24 GB machine was once
    killed by the OS without a word. A build short of free memory is refused first; auto leaves ORT out."""
    from vitlab.engine import prepare_engine
    from vitlab.engine.ort import build_memory_need
    from vitlab.errors import VitlabError
    from vitlab.models import fast_linear

    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "user-cache"))
    model = _tiny()
    monkeypatch.setattr(fast_linear, "available_memory_bytes", lambda: build_memory_need(model) - 1)
    source = tmp_path / "model"
    source.mkdir()
    with pytest.raises(VitlabError, match=r"takes about 1 GiB of memory at its peak and 1 GiB are free: use --engine "
                                          r"torch") as caught:
        prepare_engine(model, "onnxruntime", source=source, quiet=True)
    assert "\n" not in str(caught.value) and not list(source.rglob("*.onnx*"))
    engine = prepare_engine(model, "auto", source=source, quiet=True, sub_batches=False)
    assert engine.name in ("torch", "openvino") and "onnxruntime left out: building ONNX Runtime's graph" in engine.note
    monkeypatch.setattr(fast_linear, "available_memory_bytes", lambda: build_memory_need(model))
    assert prepare_engine(model, "onnxruntime", source=source, quiet=True).name == "onnxruntime"
