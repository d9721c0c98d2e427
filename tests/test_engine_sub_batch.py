"""Sub-batches (vitlab.engine.sub_batch): a large batch cut into smaller calls gives each image the same logits,
`--engine auto` and `--int8` keep sub-batches only where they measured faster, and the choice is cached."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from vitlab.engine.sub_batch import MIN_SUB_BATCH, SubBatched, sub_batch_sizes

pytest.importorskip("onnxruntime")
from test_engine import images, tiny  # noqa: E402
from vitlab.engine import choose, prepare_engine  # noqa: E402


class Recorder:
    """A stand-in engine: logits are a fixed function of each image, and every call's batch size is kept."""

    name, exact, path = "recorder", True, "graph.onnx"

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(x))
        return x.flatten(1)[:, :3] * 2


def test_sizes_are_the_halvings_down_to_the_minimum():
    assert MIN_SUB_BATCH == 4
    assert sub_batch_sizes(32) == [16, 8, 4]
    assert sub_batch_sizes(64) == [32, 16, 8, 4]
    assert sub_batch_sizes(48) == [24, 12, 6]
    assert sub_batch_sizes(8) == [4] and sub_batch_sizes(15) == [7]
    assert sub_batch_sizes(7) == [] and sub_batch_sizes(1) == []


def test_sub_batches_give_each_image_its_own_logits_in_order():
    inner = Recorder()
    engine = SubBatched(inner, 8)
    x = images(21, size=4)
    out = engine(x)
    assert inner.calls == [8, 8, 5]
    assert torch.equal(out, x.flatten(1)[:, :3] * 2)
    inner.calls.clear()
    engine(x[:8])
    assert inner.calls == [8]  # a batch no larger than the sub-batch is one call
    assert (engine.name, engine.exact, engine.path) == ("recorder", True, "graph.onnx")
    with pytest.raises(AttributeError):
        getattr(engine, "no_such_attribute")  # noqa: B009 (the lookup is what is tested)
    with pytest.raises(ValueError):
        SubBatched(inner, 0)


def fake_speeds(sub_batch_speeds: dict[str, float], timed: list[dict]):
    """interleaved_speeds stand-in: onnxruntime beats openvino beats torch; the sub-batch candidates get the given
    speeds, and eager torch timed beside them (fp32 auto) `sub_batch_speeds["torch"]`, else 0.5."""

    def speeds(engines, x, rounds=5):
        timed.append({"names": sorted(engines), "x": len(x),
                      "sub_batches": {k: getattr(e, "size", None) for k, e in engines.items()}})
        if "onnxruntime" in engines:
            return {name: {"torch": 1.0, "onnxruntime": 2.0}.get(name, 1.5) for name in engines}
        return {name: sub_batch_speeds.get(name, 0.5) if name == "torch" else sub_batch_speeds[name]
                for name in engines}

    return speeds


def test_auto_keeps_the_faster_sub_batch_and_caches_it(tmp_path, monkeypatch, capsys):
    timed: list[dict] = []
    monkeypatch.setattr(choose, "interleaved_speeds", fake_speeds({"16": 10.0, "8": 12.5, "4": 11.0}, timed))
    model = tiny()
    engine = prepare_engine(model, "auto", batch_size=16, source=tmp_path, command="evaluate")
    err = capsys.readouterr().err
    assert isinstance(engine, SubBatched) and engine.size == 8 and engine.name == "onnxruntime"
    assert "timing onnxruntime at batch 16 against sub-batches of 8, 4 and eager torch once" in err
    assert ("in sub-batches of 8 (auto, measured: 12.5 images/s; batches of 16: 10.0, 4: 11.0; torch 0.5)"
            in engine.note)
    # every candidate runs the whole batch; the sub-batched ones cut it as they will at run time
    assert timed[-1] == {"names": ["16", "4", "8", "torch"], "x": 16,
                         "sub_batches": {"16": None, "8": 8, "4": 4, "torch": None}}
    x = images(20)
    with torch.no_grad():
        assert (engine(x) - model(x)).abs().max() < 1e-4
    # the next run reads the choice instead of timing again
    monkeypatch.setattr(choose, "interleaved_speeds", lambda *a, **k: pytest.fail("timed again"))
    again = prepare_engine(model, "auto", batch_size=16, source=tmp_path, quiet=True)
    assert isinstance(again, SubBatched) and again.size == 8
    assert "in sub-batches of 8 (auto, chosen before on this machine: 12.5 images/s" in again.note


def test_whole_batches_stay_whole_where_they_are_faster(tmp_path, monkeypatch):
    monkeypatch.setattr(choose, "interleaved_speeds", fake_speeds({"32": 9.0, "16": 8.0, "8": 7.0, "4": 6.0}, []))
    engine = prepare_engine(tiny(), "auto", batch_size=32, source=tmp_path, quiet=True)
    assert not isinstance(engine, SubBatched) and engine.name == "onnxruntime"
    assert ("whole batches of 32 (auto, measured: 9.0 images/s; sub-batches of 16: 8.0, 8: 7.0, 4: 6.0; torch 0.5)"
            in engine.note)


def test_small_batches_and_asked_for_engines_are_not_timed_for_sub_batches(tmp_path, monkeypatch):
    timed: list[dict] = []
    monkeypatch.setattr(choose, "interleaved_speeds", fake_speeds({}, timed))
    small = prepare_engine(tiny(), "auto", batch_size=7, source=tmp_path, quiet=True)
    exact = ["onnxruntime", "torch"] + (["openvino"] if importlib.util.find_spec("openvino") else [])
    assert not isinstance(small, SubBatched) and [t["names"] for t in timed] == [sorted(exact)]
    asked = prepare_engine(tiny(), "onnxruntime", batch_size=64, source=tmp_path, quiet=True)
    assert not isinstance(asked, SubBatched) and len(timed) == 1 and "sub-batch" not in asked.note


def test_int8_is_timed_in_sub_batches_but_export_is_not(tmp_path, monkeypatch):
    timed: list[dict] = []
    monkeypatch.setattr(choose, "interleaved_speeds", fake_speeds({"16": 3.0, "8": 4.0, "4": 3.5}, timed))
    model = tiny()
    engine = prepare_engine(model, "auto", int8="dynamic", batch_size=16, source=tmp_path, quiet=True)
    assert isinstance(engine, SubBatched) and engine.size == 8 and engine.name == "onnxruntime-int8-dynamic"
    assert engine.path.is_file()  # what export copies is the wrapped engine's graph
    from vitlab.export import export_for_engine

    before = len(timed)
    path, what = export_for_engine(model, tmp_path / "out.onnx", "onnxruntime", int8="dynamic", source=tmp_path,
                                   quiet=True)
    assert path.is_file() and len(timed) == before


def test_a_damaged_cached_sub_batch_choice_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(choose, "interleaved_speeds", fake_speeds({"16": 1.0, "8": 2.0, "4": 1.5}, []))
    model = tiny()
    prepare_engine(model, "auto", batch_size=16, source=tmp_path, quiet=True)
    cache = choose.artefact_folder(model, tmp_path) / "choices.json"
    data = json.loads(cache.read_text())
    key = next(k for k in data if k.endswith("sub-batches of onnxruntime"))
    data[key] = {"picked": "7", "images_per_s": {"7": 1.0}}
    cache.write_text(json.dumps(data))
    timed: list[dict] = []
    monkeypatch.setattr(choose, "interleaved_speeds", fake_speeds({"16": 5.0, "8": 1.0, "4": 1.0}, timed))
    engine = prepare_engine(model, "auto", batch_size=16, source=tmp_path, quiet=True)
    assert not isinstance(engine, SubBatched) and [t["names"] for t in timed] == [["16", "4", "8", "torch"]]


def test_eager_torch_runs_where_it_beats_the_picks_best_sub_batches_in_the_same_timing(tmp_path, monkeypatch,
                                                                                        capsys):
    """fp32 auto picks its engine in one timing and that engine's sub-batches in another, minutes later; where eager
    PyTorch, timed beside the sub-batches, is faster than all of them, it runs (a pick measured faster than torch
    at first must not end up slower than it)."""
    timed: list[dict] = []
    monkeypatch.setattr(choose, "interleaved_speeds",
                        fake_speeds({"16": 1.2, "8": 1.4, "4": 1.3, "torch": 1.6}, timed))
    model = tiny()
    engine = prepare_engine(model, "auto", batch_size=16, source=tmp_path, command="predict")
    assert not isinstance(engine, SubBatched) and engine.name == "torch"
    assert [t["names"] for t in timed][-1] == ["16", "4", "8", "torch"]
    assert ("torch after all, whole batches of 16 (auto, measured with the sub-batches: 1.6 images/s against "
            "onnxruntime's best, sub-batches of 8, 1.4)") in engine.note
    x = images(5)
    with torch.no_grad():
        assert torch.equal(engine(x), engine(x)) and (engine(x) - model(x)).abs().max() < 1e-5
    capsys.readouterr()
    monkeypatch.setattr(choose, "interleaved_speeds", lambda *a, **k: pytest.fail("timed again"))
    again = prepare_engine(model, "auto", batch_size=16, source=tmp_path, quiet=True)
    assert again.name == "torch" and not isinstance(again, SubBatched)
    assert "torch after all, whole batches of 16 (auto, chosen before on this machine" in again.note


def test_int8_and_a_torch_pick_time_no_extra_torch_row(tmp_path, monkeypatch):
    timed: list[dict] = []
    monkeypatch.setattr(choose, "interleaved_speeds", fake_speeds({"16": 3.0, "8": 4.0, "4": 3.5}, timed))
    prepare_engine(tiny(), "auto", int8="dynamic", batch_size=16, source=tmp_path, quiet=True)
    assert all("torch" not in t["names"] for t in timed)

    def torch_first(engines, x, rounds=5):
        timed.append(sorted(engines))
        return {name: 3.0 if name == "torch" else 1.0 for name in engines}

    timed.clear()
    monkeypatch.setattr(choose, "interleaved_speeds", torch_first)
    (tmp_path / "other").mkdir()  # a folder of its own: the int8 run above cached its fp32 choice beside tmp_path
    engine = prepare_engine(tiny(), "auto", batch_size=16, source=tmp_path / "other", quiet=True)
    assert engine.name == "torch" and timed[-1] == ["16", "4", "8"]  # torch's own sub-batches, no second torch
