"""Audit of the inference engines, their cache beside the model, int8 and ONNX export: cases that gave another
model's outputs, hung, or failed without one clear line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import vitlab

pytest.importorskip("onnxruntime")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test its own user cache: the records of what vitlab built (engine/trusted.py) live there."""
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "user-cache"))


def tiny_vit(seed: int, **overrides) -> torch.nn.Module:
    """A 2-block ViT whose weights (head included) are random, so two seeds give clearly different logits."""
    config = dict(dim=32, depth=2, heads=2, mlp_dim=64, patch_size=8, image_size=32, num_classes=5)
    model = vitlab.create_model("custom", seed=seed, **{**config, **overrides})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or "head" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return model.eval()


def saved(model: torch.nn.Module, folder: Path) -> Path:
    vitlab.save(model, folder)
    return folder


def test_inspect_auto_never_runs_an_attention_graph_vitlab_did_not_build(tmp_path):
    """inspect's attention graph was reused from the cache folder whatever it held (the fp32 and int8 graphs are
    checked against the user's record of what vitlab built): with auto's cached pick, a graph of other weights gave
    that model's logits and attention maps."""
    from vitlab.engine.attention import prepare_attention_engine
    from vitlab.engine.choose import _Choices, machine_key

    a, b = tiny_vit(0), tiny_vit(1)
    folder_a, folder_b = saved(a, tmp_path / "a"), saved(b, tmp_path / "b")
    prepare_attention_engine(a, "onnxruntime", batch_size=2, source=folder_a, quiet=True)
    prepare_attention_engine(b, "onnxruntime", batch_size=2, source=folder_b, quiet=True)
    engines_a = next((folder_a / "engines").iterdir())
    engines_b = next((folder_b / "engines").iterdir())
    # what `auto` records when ONNX Runtime timed faster here
    _Choices(engines_a).put(f"{machine_key(torch.get_num_threads())}|batch 2|32x32|fp32+attention",
                            {"picked": "onnxruntime", "images_per_s": {"onnxruntime": 2.0, "torch": 1.0}})
    shutil.copyfile(engines_b / "fp32-attention.onnx", engines_a / "fp32-attention.onnx")

    engine = prepare_attention_engine(a, "auto", batch_size=2, source=folder_a, quiet=True)
    x = torch.randn(2, 3, 32, 32)
    logits, maps = engine(x)
    with torch.no_grad():
        expected, expected_maps = a(x, return_attention=True)
    assert torch.allclose(logits, expected, atol=1e-4)
    assert torch.allclose(maps[0], expected_maps[0], atol=1e-5)


def test_choices_written_by_several_commands_at_once(tmp_path):
    """Commands that finish timing together each record their choice: all wrote through one `choices.tmp`, so one
    moved it into place and the other failed ('no such file or folder: ...choices.tmp'), or overwrote the
    other's choice with the file as it had read it at start."""
    import threading

    from vitlab.engine.choose import _Choices

    writers = [_Choices(tmp_path) for _ in range(4)]  # each read the file before any wrote, as parallel commands do
    failures = []

    def record(i: int) -> None:
        try:
            for j in range(60):
                writers[i].put(f"key {i} {j}", {"picked": "torch", "images_per_s": {"torch": 1.0}})
        except Exception as exc:  # noqa: BLE001 - collected for the assert
            failures.append(exc)

    threads = [threading.Thread(target=record, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    kept = _Choices(tmp_path)
    assert all(kept.get(f"key {i} 59") for i in range(4))
    assert not list(tmp_path.glob("*.part")) and not list(tmp_path.glob("*.tmp"))


BUILD_AT_ONCE = """
import sys, time
import torch
import vitlab
import vitlab.engine.onnx_graph as onnx_graph
from vitlab.engine import prepare_engine

export = onnx_graph.export_fusable

def slow_export(*args, **kwargs):  # the window of a real model's export (seconds), so both builds overlap
    path = export(*args, **kwargs)
    time.sleep(1.5)
    return path

onnx_graph.export_fusable = slow_export
model = vitlab.load(sys.argv[1])
engine = prepare_engine(model, "onnxruntime", source=sys.argv[1], batch_size=2, command="test")
x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    print(float((engine(x) - model(x)).abs().max()))
"""


def test_commands_building_the_same_engine_at_once(tmp_path):
    """Two commands started together on a fresh model built the same graph through the same files (raw.onnx,
    fp32.onnx): one removed the file the other was reading, which then built again or failed with 'engine
    onnxruntime cannot run this model (FileNotFoundError ...)'. Now one builds and the other waits and reuses it."""
    import os
    import subprocess
    import sys

    folder = saved(tiny_vit(0), tmp_path / "model")
    env = {**os.environ, "VITLAB_CACHE": str(tmp_path / "user-cache")}
    runs = [subprocess.Popen([sys.executable, "-c", BUILD_AT_ONCE, str(folder)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [run.communicate(timeout=240) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in outputs]
    assert all(float(out) < 1e-4 for out, _ in outputs)
    said = "".join(err for _, err in outputs)
    assert said.count("engine: building") == 1, said


def test_export_int8_with_engine_torch_is_refused(tmp_path, capsys):
    """`--engine torch` asks for the portable graph (standard operators, any runtime); with --int8 export wrote ONNX
    Runtime's int8 graph under the same name (predict refuses the pair). --int8 alone still writes it."""
    from vitlab.cli import main

    folder = saved(tiny_vit(0), tmp_path / "model")
    out = tmp_path / "q.onnx"
    assert main(["export", str(folder), str(out), "--int8", "dynamic", "--engine", "torch"]) == 2
    assert "--engine torch" in capsys.readouterr().err and not out.exists()
    assert main(["export", str(folder), str(out), "--int8", "dynamic", "--quiet"]) == 0
    assert "onnxruntime-int8-dynamic" in capsys.readouterr().out
    assert main(["export", str(folder), str(tmp_path / "p.onnx"), "--quiet"]) == 0  # the portable default


@pytest.mark.parametrize("engine", ["torch", "onnxruntime"])
def test_export_of_a_model_without_head_names_its_output_width(tmp_path, capsys, engine):
    """A feature extractor (num_classes 0) exports its features; the closing line said output 'logits' Bx0."""
    import onnxruntime as ort

    from vitlab.cli import main

    folder = saved(tiny_vit(0, num_classes=0), tmp_path / "model")
    out = tmp_path / "f.onnx"
    assert main(["export", str(folder), str(out), "--engine", engine, "--quiet"]) == 0
    said = capsys.readouterr().out
    width = ort.InferenceSession(str(out)).get_outputs()[0].shape[-1]
    assert width == 32 and "Bx0" not in said and f"Bx{width} (features" in said


def test_a_link_planted_in_the_engine_folder_is_not_written_through(tmp_path):
    """The builders write fixed names into MODEL/engines/<hash>/ (raw.onnx, attention-raw.onnx, ...): a link left
    there under such a name (anyone who can write to a shared model folder) made vitlab overwrite its target, any
    file of the user running it, with an ONNX graph."""
    from vitlab.engine import prepare_engine
    from vitlab.engine.attention import prepare_attention_engine
    from vitlab.engine.choose import fingerprint

    model = tiny_vit(0)
    folder = saved(model, tmp_path / "model")
    engines = folder / "engines" / fingerprint(model)
    engines.mkdir(parents=True)
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    for name in ("raw.onnx", "attention-raw.onnx"):
        (engines / name).symlink_to(victim)
    x = torch.randn(2, 3, 32, 32)
    engine = prepare_engine(model, "onnxruntime", source=folder, batch_size=2, quiet=True)
    logits, _ = prepare_attention_engine(model, "onnxruntime", batch_size=2, source=folder, quiet=True)(x)
    assert victim.read_bytes() == b"precious"
    with torch.no_grad():
        assert torch.allclose(engine(x), model(x), atol=1e-4) and torch.allclose(logits, model(x), atol=1e-4)


def test_calibration_images_that_cannot_be_used_are_said_so(tmp_path, capsys):
    """--calibration given, no image in it readable: the command said 'static int8 needs calibration images: add
    --calibration DATA' (and --int8 auto 'no calibration images'), as if none were given; one image file was
    refused as 'cannot use ... as data'; the data loader's refusals did not name the flag."""
    from PIL import Image

    from vitlab.cli import main

    folder = saved(tiny_vit(0), tmp_path / "model")
    image = tmp_path / "one.png"
    Image.new("RGB", (40, 40), (90, 20, 200)).save(image)
    broken = tmp_path / "broken"
    broken.mkdir()
    for i in range(3):
        (broken / f"{i}.png").write_bytes(b"not a png")
    empty = tmp_path / "empty"
    empty.mkdir()

    def error(*flags: str) -> str:
        assert main(["predict", str(folder), str(image), "--quiet", *flags]) == 2
        return capsys.readouterr().err

    for mode in ("static", "auto"):
        said = error("--int8", mode, "--calibration", str(broken))
        assert "none of the 3 calibration images could be read" in said and "--calibration" in said
    assert "at least 16 calibration images, got 1" in error("--int8", "static", "--calibration", str(image))
    assert f"--calibration {empty}:" in error("--int8", "static", "--calibration", str(empty))


def test_an_engine_with_nowhere_to_write_says_so(tmp_path, monkeypatch):
    """A read-only model folder and a user cache that cannot be written: 'engine onnxruntime cannot run this model
    (...)', which blamed the model; now the line names the folder and VITLAB_CACHE."""
    from vitlab.engine import prepare_engine
    from vitlab.errors import VitlabError

    model = tiny_vit(0)
    folder = saved(model, tmp_path / "model")
    not_a_folder = tmp_path / "cache-is-a-file"
    not_a_folder.write_text("")
    monkeypatch.setenv("VITLAB_CACHE", str(not_a_folder))
    folder.chmod(0o555)
    try:
        for engine, int8 in (("onnxruntime", None), ("auto", "dynamic")):
            with pytest.raises(VitlabError, match="cannot write its files in .*set VITLAB_CACHE to a writable folder"):
                prepare_engine(model, engine, int8=int8, source=folder, batch_size=2, quiet=True)
    finally:
        folder.chmod(0o755)


def test_an_openvino_name_without_its_engine_says_which_engine(tmp_path, capsys):
    """`vitlab export M x.xml` said only 'name it OUT.onnx'; the .xml means OpenVINO, which --engine openvino writes."""
    from vitlab.cli import main

    folder = saved(tiny_vit(0), tmp_path / "model")
    assert main(["export", str(folder), str(tmp_path / "x.xml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--engine openvino" in err[0] and not (tmp_path / "x.xml").exists()
