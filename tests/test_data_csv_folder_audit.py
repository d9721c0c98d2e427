"""The data audit's folder and CSV findings: number labels, header columns, separators, --classes matching, the
memory budget variable, and what split folders leave unread."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from vitlab.data import load_data
from vitlab.data.load import _memory_budget
from vitlab.data.splits import resolve_classes
from vitlab.errors import VitlabError

KW = dict(val_fraction=0, test_fraction=0, progress=False, report=False, in_memory=True)


def images(folder: Path, n: int, value: int = 100, suffix: str = ".png") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(n):
        p = folder / f"{value}_{k}{suffix}"
        Image.new("L", (8, 8), value).save(p, format="JPEG" if suffix in (".jpg", ".jfif") else "PNG")
        out.append(p)
    return out


def csv_of(tmp_path: Path, text: str, name: str = "d.csv") -> str:
    images(tmp_path / "img", 6)
    (tmp_path / name).write_text(text, encoding="utf-8")
    return str(tmp_path / name)


def img(k: int) -> str:
    return f"img/100_{k}.png"


def one_line_error(fn) -> str:
    with pytest.raises(VitlabError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# --- 1. a number is one class, named by its plain integer form ---------------------------------------------------


def test_csv_same_number_written_differently_is_one_class(tmp_path):
    """`007` and `7` made two classes both named "7" (the first with no image, a phantom class in the head)."""
    labels = ["007", "7", "10", "10", "7"]
    src = csv_of(tmp_path, "path,label\n" + "".join(f"{img(k)},{lab}\n" for k, lab in enumerate(labels)))
    d = load_data(src, **KW)
    assert d.class_names == ["7", "10"]
    assert d.train.class_counts() == [3, 2]
    assert any("007 and 7 -> 7" in n for n in d.notes)


def test_csv_integral_floats_are_class_numbers(tmp_path):
    """`1.0` and `1` were two classes in a CSV, though the Hugging Face reader reads 1.0 as 1."""
    labels = ["1.0", "2.0", "1", "10"]
    src = csv_of(tmp_path, "".join(f"{img(k)},{lab}\n" for k, lab in enumerate(labels)))
    d = load_data(src, **KW)
    assert d.class_names == ["1", "2", "10"]  # numerically, not as text
    assert d.train.class_counts() == [2, 1, 1]


def test_csv_negative_label_is_no_label_as_in_hugging_face(tmp_path):
    """A CSV row labelled -1 made a class "-1", while the Hugging Face reader skips -1 as "no label"."""
    labels = ["0", "1", "-1", "1", "-1.0", "0"]
    src = csv_of(tmp_path, "path,label\n" + "".join(f"{img(k)},{lab}\n" for k, lab in enumerate(labels)))
    d = load_data(src, **KW)
    assert d.class_names == ["0", "1"]
    assert d.train.class_counts() == [2, 2]
    reasons = {where.rsplit(":", 1)[-1]: why for where, why in d.skipped}
    assert set(reasons) == {"line 4", "line 6"}
    assert all("no label" in why for why in reasons.values())


def test_csv_numbers_and_names_mixed_never_repeat_a_class(tmp_path):
    """`01` and `1` merged only when every label was an integer."""
    labels = ["1", "01", "cat", "10"]
    src = csv_of(tmp_path, "".join(f"{img(k)},{lab}\n" for k, lab in enumerate(labels)))
    d = load_data(src, **KW)
    assert d.class_names == ["1", "10", "cat"]  # numbers as plain integers; a mix is ordered as text
    assert d.train.class_counts() == [2, 1, 1]
    assert any("mix class numbers" in n for n in d.notes)


# --- 2. --classes: an exact name wins; equal loose matches are ambiguous -----------------------------------------


def test_classes_exact_match_wins_over_case_insensitive():
    assert resolve_classes(["Cat"], ["Cat", "cat"]) == [0]
    assert resolve_classes(["cat"], ["Cat", "cat"]) == [1]
    assert resolve_classes(["Cat", "cat"], ["Cat", "cat"]) == [0, 1]
    assert resolve_classes(["CAT"], ["Cat", "dog"]) == [0]  # one loose match is still found
    assert resolve_classes(["007"], ["7", "10"]) == [0]  # a number finds its class before an index


def test_classes_ambiguous_loose_match_is_refused():
    assert "ambiguous" in one_line_error(lambda: resolve_classes(["CAT"], ["Cat", "cat", "dog"]))
    msg = one_line_error(lambda: resolve_classes(["T_shirt"], ["t-shirt", "tshirt"]))
    assert "ambiguous" in msg and "'t-shirt'" in msg and "'tshirt'" in msg


def test_classes_picks_the_folder_named_exactly(tmp_path):
    images(tmp_path / "d" / "Cat", 2, 10)
    images(tmp_path / "d" / "cat", 2, 20)
    d = load_data(str(tmp_path / "d"), classes="Cat", **KW)
    assert d.class_names == ["Cat"]
    assert {Path(p).parent.name for p in d.train.paths} == {"Cat"}


# --- 3. VITLAB_DATA_MEMORY_MB -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["512MB", "-5", "nan", "inf", "lots"])
def test_memory_budget_variable_not_a_size_is_one_line(monkeypatch, value):
    """`512MB` was a ValueError reported as an unexpected failure; `-5` silently streamed everything."""
    monkeypatch.setenv("VITLAB_DATA_MEMORY_MB", value)
    msg = one_line_error(_memory_budget)
    assert "VITLAB_DATA_MEMORY_MB" in msg and "MiB" in msg


def test_memory_budget_variable_numbers(monkeypatch):
    monkeypatch.setenv("VITLAB_DATA_MEMORY_MB", " 0.5 ")
    assert _memory_budget() == 512 * 1024
    monkeypatch.setenv("VITLAB_DATA_MEMORY_MB", "0")
    assert _memory_budget() == 0


# --- 4. separators ------------------------------------------------------------------------------------------------


def test_tsv_is_read_tab_separated(tmp_path):
    """A .tsv was read with commas: every row a bad row, then "no usable image"."""
    src = csv_of(tmp_path, f"path\tlabel\n{img(0)}\tcat\n{img(1)}\tdog\n", "d.tsv")
    d = load_data(src, **KW)
    assert d.class_names == ["cat", "dog"] and d.skipped == []


def test_csv_of_semicolons_is_sniffed_but_commas_win(tmp_path):
    d = load_data(csv_of(tmp_path, f"path;label\n{img(0)};cat\n{img(1)};dog\n"), **KW)
    assert d.class_names == ["cat", "dog"]
    assert any("semicolon-separated" in n for n in d.notes)
    (tmp_path / "img" / "a;b.png").write_bytes((tmp_path / img(2)).read_bytes())
    d = load_data(csv_of(tmp_path, "path,label\nimg/a;b.png,cat\n" + f"{img(1)},dog\n", "e.csv"), **KW)
    assert d.class_names == ["cat", "dog"] and not any("separated" in n for n in d.notes)


# --- 5. a header picks the columns by name ------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "label,path\ncat,{0}\ndog,{1}\n",
    "path,split,label\n{0},train,cat\n{1},train,dog\n",
    "Image Path,Class\n{0},cat\n{1},dog\n",
    "id,file_name,label\nx,{0},cat\ny,{1},dog\n",
])
def test_csv_header_picks_columns_by_name(tmp_path, text):
    """`label,path` read the label as the path; `path,split,label` read the label as the split."""
    d = load_data(csv_of(tmp_path, text.format(img(0), img(1))), **KW)
    assert d.class_names == ["cat", "dog"] and d.skipped == []
    assert sorted(Path(p).name for p in d.train.paths) == ["100_0.png", "100_1.png"]


def test_csv_unknown_columns_are_ignored_and_said(tmp_path):
    """Hugging Face's metadata.csv: `file_name,label,caption` read the caption as a split."""
    d = load_data(csv_of(tmp_path, f"file_name,label,caption\n{img(0)},cat,a cat\n{img(1)},dog,a dog\n"), **KW)
    assert d.class_names == ["cat", "dog"] and d.skipped == []
    assert sum("caption not read" in n for n in d.notes) == 1


def test_csv_unrecognised_header_is_refused(tmp_path):
    """`fname,digit` became a data row (a missing file) and the digits sorted as text."""
    src = csv_of(tmp_path, f"fname,digit\n{img(0)},10\n{img(1)},2\n")
    msg = one_line_error(lambda: load_data(src, **KW))
    assert "fname,digit" in msg and "file_name" in msg and "label" in msg and "line 1" in msg


def test_csv_first_row_naming_a_missing_image_stays_data(tmp_path):
    d = load_data(csv_of(tmp_path, f"img/missing.png,cat\n{img(0)},cat\n{img(1)},dog\n"), **KW)
    assert d.class_names == ["cat", "dog"]
    assert [r for _, r in d.skipped] == ["missing file"]


def test_csv_first_row_without_extension_is_data_when_no_header_names_match(tmp_path):
    src = csv_of(tmp_path, f"0001,cat\n{img(1)},dog\n")
    (tmp_path / "0001").write_bytes((tmp_path / img(0)).read_bytes())  # a file with no extension
    assert load_data(src, **KW).train.class_counts() == [1, 1]
    (tmp_path / "image").write_bytes((tmp_path / img(0)).read_bytes())  # column names win over such a file
    d = load_data(csv_of(tmp_path, f"image,label\n{img(0)},cat\n{img(1)},dog\n", "e.csv"), **KW)
    assert d.class_names == ["cat", "dog"] and d.skipped == []


def test_csv_skipped_rows_are_named_by_their_line(tmp_path):
    """Rows were numbered as data rows: "row 3" was line 4 of the file."""
    text = f"# my images\npath,label,split\n\n{img(0)},cat\n{img(1)},\n{img(2)},dog,holdout\n{img(3)},dog\n"
    d = load_data(csv_of(tmp_path, text), **KW)
    where = [w.rsplit(":", 1)[1] for w, _ in d.skipped]
    assert where == ["line 5", "line 6"]


# --- 6. split folders say what they leave unread ------------------------------------------------------------------


def test_split_folders_note_what_is_not_read(tmp_path):
    root = tmp_path / "sf"
    for c in ("cat", "dog"):
        images(root / "Train" / c, 3, 10)
        images(root / "test" / c, 2, 20)
    images(root / "test" / "bird", 2, 30)  # a class with no training image
    for extra in ("unlabeled/x", "extra_train/cat", "tst/cat", "validation/cat"):
        images(root / extra, 1, 40)
    images(root / "val" / "cat", 1, 50)
    images(root, 1, 60)  # a loose image beside the split folders
    images(root / "Train", 1, 70)  # and one directly in a split folder
    d = load_data(str(root), **KW)
    assert d.class_names == ["bird", "cat", "dog"] and d.train.class_counts()[0] == 0
    notes = " | ".join(d.notes)
    assert "no training image" in notes and "(bird)" in notes
    assert "extra_train/, tst/, unlabeled/" in notes and "validation/ (a second val folder; val/ is read)" in notes
    assert sum("in no class folder" in n for n in d.notes) == 2


def test_plain_folder_has_no_notes(tmp_path):
    for c in ("a", "b"):
        images(tmp_path / "d" / c, 2)
    assert load_data(str(tmp_path / "d"), **KW).notes == []


# --- 7. .jfif images; integer folder names in numeric order -------------------------------------------------------


def test_jfif_files_are_images(tmp_path):
    images(tmp_path / "d" / "a", 2, 10, ".jfif")
    images(tmp_path / "d" / "b", 2, 20, ".jpg")
    d = load_data(str(tmp_path / "d"), **KW)
    assert d.train.class_counts() == [2, 2] and d.skipped == []


def test_integer_folder_names_sort_as_numbers(tmp_path):
    for c in ("0", "1", "2", "10", "11"):
        images(tmp_path / "d" / c, 1, 10 + int(c))
    assert load_data(str(tmp_path / "d"), **KW).class_names == ["0", "1", "2", "10", "11"]
