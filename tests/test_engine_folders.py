"""`vitlab engines MODEL [--clean]` (engine/folders.py): the engine folders beside a model, which the weights as
they load now use, and removing the others without touching anything vitlab did not make."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.cli import main

pytest.importorskip("onnxruntime")


def tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return vitlab.create_model("custom", image_size=32, patch_size=8, dim=32, depth=1, heads=2, mlp_dim=64,
                               num_classes=5).eval()


def built(folder, seed: int, size=None):
    """Save weights of `seed` into `folder` and build their ONNX Runtime engine beside them, as predict does."""
    from vitlab.engine import prepare_engine

    vitlab.save(tiny(seed), folder)
    model = vitlab.load(folder)
    engine = prepare_engine(model, "onnxruntime", source=folder, quiet=True, image_size=size)
    return engine.path.parent


def test_lists_and_cleans_the_folders_of_older_weights(tmp_path, capsys):
    from vitlab.engine.trusted import is_trusted

    model = tmp_path / "model"
    old = built(model, 0)
    new = built(model, 1)  # the run trained further: new weights, a new folder; the old one stays
    other_size = built(model, 1, size=(48, 48))  # the same weights at another size: theirs too
    assert len({old, new, other_size}) == 3
    assert main(["engines", str(model)]) == 0
    out = capsys.readouterr().out
    assert f"{old.name}" in out and f"{new.name}" in out and other_size.name in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert " other " in lines[old.name] and " current " in lines[new.name] and " current " in lines[other_size.name]
    assert "1 folder" in out and "--clean` removes it" in out
    assert old.exists()  # listing removes nothing

    old_files = sorted(old.iterdir())
    assert main(["engines", str(model), "--clean"]) == 0
    assert "removed 1 folder of other weights or settings" in capsys.readouterr().out
    assert not old.exists() and new.exists() and other_size.exists()
    assert not is_trusted(old_files)
    assert is_trusted([new / "fp32.onnx"])  # the kept engine is reused, not rebuilt


def test_clean_leaves_what_vitlab_did_not_make(tmp_path, capsys):
    model = tmp_path / "model"
    built(model, 0)
    engines = model / "engines"
    (engines / "notes.txt").write_text("mine")
    (engines / "mine").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (engines / ("ab" * 12)).symlink_to(outside)  # named like a folder of vitlab's, but a link
    vitlab.save(tiny(1), model)  # new weights: the built folder is now an old one
    assert main(["engines", str(model), "--clean"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in engines.iterdir()) == ["ab" * 12, "mine", "notes.txt"]
    assert (outside / "keep.txt").read_text() == "keep"


def test_a_model_without_engines(tmp_path, capsys):
    vitlab.save(tiny(0), tmp_path / "model")
    assert main(["engines", str(tmp_path / "model")]) == 0
    assert "no engines kept for" in capsys.readouterr().out


def kernels(folder, size: int) -> None:
    """Files as the compiled engine's Inductor cache leaves them: in an `inductor` subfolder, nested."""
    (folder / "inductor" / "ab").mkdir(parents=True)
    (folder / "inductor" / "ab" / "kernel.py").write_bytes(b"x" * size)


def test_compiled_kernels_in_the_user_cache_are_listed_and_cleaned_with_the_model(tmp_path, monkeypatch, capsys):
    """--engine compiled keeps its kernels in the user cache, in a folder named as the one beside the model: listed
    (size of every file under it) and removed with that model's other folders; other models' are not touched."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("VITLAB_CACHE", str(cache))
    model = tmp_path / "model"
    old = built(model, 0)
    new = built(model, 1)
    for folder, size in ((old, 3 * 2**20), (new, 2**20), (cache / "engines" / ("cd" * 12), 2**20)):
        kernels(cache / "engines" / folder.name if folder.parent != cache / "engines" else folder, size)
    assert main(["engines", str(model)]) == 0
    out = capsys.readouterr().out
    assert f"compiled kernels in {cache / 'engines'}" in out and "cd" * 12 not in out
    lines = {line.split()[0] + (" cache" if "(in the user cache)" in line else ""): line
             for line in out.splitlines() if line.startswith("  ")}
    assert set(lines) == {old.name, new.name, old.name + " cache", new.name + " cache"}
    assert " other " in lines[old.name + " cache"] and " current " in lines[new.name + " cache"]
    assert "3.0 MB" in lines[old.name + " cache"] and lines[old.name + " cache"].endswith("compiled  (in the user cache)")
    assert "2 folders" in out

    assert main(["engines", str(model), "--clean"]) == 0
    assert "removed 2 folders" in capsys.readouterr().out
    assert not old.exists() and not (cache / "engines" / old.name).exists()
    assert new.exists() and (cache / "engines" / new.name / "inductor").exists()
    assert (cache / "engines" / ("cd" * 12) / "inductor").exists()


def test_a_folders_size_counts_its_subfolders_but_not_links(tmp_path):
    from vitlab.engine.folders import engine_folders

    folder = tmp_path / "engines" / ("ef" * 12)
    folder.mkdir(parents=True)
    (folder / "fp32.onnx").write_bytes(b"x" * 1000)
    kernels(folder, 500)
    outside = tmp_path / "big"
    outside.write_bytes(b"x" * 10_000)
    (folder / "inductor" / "link").symlink_to(outside)
    (found,) = engine_folders(folder)
    assert found.size == 1500 and found.files == ("fp32.onnx",) and found.subfolders == ("inductor",)
