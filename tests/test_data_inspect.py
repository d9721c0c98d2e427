"""`vitlab data inspect`: table of classes and counts, size statistics, unreadable files, samples.png."""

from __future__ import annotations

import json

from PIL import Image

from vitlab.cli import main


def test_inspect_folder_with_bad_files(tmp_path, capsys):
    root = tmp_path / "shoes"
    sizes = {"boots": (40, 30), "sandals": (60, 44)}
    for cls, size in sizes.items():
        (root / cls).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", size, (30 * i, 100, 200)).save(root / cls / f"{i}.jpg")
    (root / "sandals" / "broken.jpg").write_bytes(b"")
    (root / "sandals" / "notes.txt").write_text("x")
    out = tmp_path / "report"
    rc = main(["data", "inspect", str(root), "--out", str(out), "--val-fraction", "0.2", "--test-fraction", "0",
               "--samples", "3"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "boots" in text and "sandals" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.split()[:1] in (["boots"], ["sandals"])}
    assert rows["boots"] == ["4", "1"] and rows["sandals"] == ["4", "1"]
    assert "width min/median/max 40/50/60" in text
    assert "skipped 2 files" in text and "broken.jpg" in text
    assert (out / "samples.png").stat().st_size > 1000
    with Image.open(out / "samples.png") as im:
        assert im.size[0] > 100
    assert len((out / "skipped_files.txt").read_text().splitlines()) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["classes"] == ["boots", "sandals"] and summary["counts"]["train"] == [4, 4]


def test_inspect_class_subset_quiet(tmp_path, capsys):
    rc = main(["data", "inspect", "bundled", "--classes", "sandal,ankle boot", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bundled: 2 classes, train 900, val 100, test 200" in text
    assert (tmp_path / "samples.png").exists()


def test_inspect_unknown_source_is_one_line_error(tmp_path, capsys):
    rc = main(["data", "inspect", str(tmp_path / "nothing-here")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitlab data inspect: error:") and "\n" not in err
