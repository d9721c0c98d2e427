"""An explicit `--engine onnxruntime|openvino` is checked against eager PyTorch once per machine and built files,
not on every start (engine/choose.py `_checked_before`): the same files on the same runtime compute the same
logits, and the check was most of such a start's own time. Anything that could change them checks again."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.engine import choose

pytest.importorskip("onnxruntime")


@pytest.fixture()
def model():
    torch.manual_seed(0)
    m = vitlab.create_model("custom", image_size=32, patch_size=8, dim=64, depth=2, heads=4, mlp_dim=128,
                            num_classes=10).eval()
    m.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in m.state_dict().items()})
    return m


@pytest.fixture()
def checks(monkeypatch) -> list[str]:
    seen, real = [], choose.check_exact

    def spy(candidate, *args, **kwargs):
        seen.append(candidate.name)
        return real(candidate, *args, **kwargs)

    monkeypatch.setattr(choose, "check_exact", spy)
    return seen


def prepare(model, folder, engine="onnxruntime"):
    return choose.prepare_engine(model, engine, source=folder, quiet=True)


def test_checked_on_the_first_start_only(model, tmp_path, checks):
    x = torch.randn(3, 3, 32, 32)
    first = prepare(model, tmp_path)(x)
    again = prepare(model, tmp_path)(x)
    assert checks == ["onnxruntime"]
    assert torch.equal(first, again)


def test_a_check_of_other_files_does_not_count(model, tmp_path, checks):
    """The record names the digests of the files it checked; other files (rebuilt differently, another export)
    are checked again. A graph rebuilt byte for byte the same keeps its check."""
    import json

    engine = prepare(model, tmp_path)
    with open(engine.path, "ab") as f:  # changed after it was built: not trusted, so built again
        f.write(b"\0")
    prepare(model, tmp_path)
    assert checks == ["onnxruntime"]  # the deterministic export wrote the same bytes
    record = engine.path.parent / "choices.json"
    entries = json.loads(record.read_text())
    for entry in entries.values():
        entry["digests"] = ["0" * 64]
    record.write_text(json.dumps(entries))
    prepare(model, tmp_path)
    assert checks == ["onnxruntime", "onnxruntime"]


def test_retime_checks_again(model, tmp_path, checks, monkeypatch):
    prepare(model, tmp_path)
    monkeypatch.setenv("VITLAB_RETIME", "1")
    prepare(model, tmp_path)
    assert checks == ["onnxruntime", "onnxruntime"]


def test_another_thread_count_checks_again(model, tmp_path, checks):
    threads = torch.get_num_threads()
    prepare(model, tmp_path)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        prepare(model, tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert checks == ["onnxruntime", "onnxruntime"]


def test_a_graph_that_fails_its_check_is_never_remembered(model, tmp_path, monkeypatch):
    monkeypatch.setattr(choose, "exact_enough", lambda difference, scale: False)
    for _ in range(2):  # refused every time, not only the first
        with pytest.raises(vitlab.VitlabError, match="does not reproduce the model"):
            prepare(model, tmp_path)
