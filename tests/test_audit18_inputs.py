"""Audit 18: odd and hostile inputs to the folder walk of `vitlab predict`, file names, class names and IDX files."""

from __future__ import annotations

import os

import pytest
from PIL import Image
from tests.test_data_hostile import deadline  # fails a test that would hang (not an OSError)

from vitlab.cli import main
from vitlab.data.preprocess import Preprocess
from vitlab.models.registry import create_model
from vitlab.predict import collect_images
from vitlab.weights import save_native


def picture(path, value: int = 0, size=(20, 20)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 50, 200 - value)).save(path)
    return path


@pytest.fixture()
def weights(tmp_path):
    model = create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=16,
                         num_classes=3, seed=0).eval()
    save_native(model, tmp_path / "w", class_names=["a", "b", "c"],
                preprocess=Preprocess(image_size=(16, 16), mean=(0.5,) * 3, std=(0.5,) * 3))
    return tmp_path / "w"


# --- the folder walk of `vitlab predict` ------------------------------------------------------------------


def test_predict_follows_linked_folders_and_lists_dangling_links(tmp_path):
    """A symlink farm's class folders are links: predict found none of their photos (the data loader reads them),
    and a dangling link was dropped without a word."""
    picture(tmp_path / "real" / "cats" / "a.png")
    farm = tmp_path / "farm"
    picture(farm / "own.png")
    (farm / "cats").symlink_to(tmp_path / "real" / "cats")
    (farm / "gone.png").symlink_to(tmp_path / "nowhere.png")
    files, skipped = collect_images([farm])
    assert [f.relative_to(farm).as_posix() for f in files] == ["cats/a.png", "own.png"]
    assert skipped == [(str(farm / "gone.png"), "dangling link (its target does not exist)")]


def test_predict_walks_a_link_loop_once(tmp_path):
    picture(tmp_path / "imgs" / "x" / "a.png")
    (tmp_path / "imgs" / "x" / "up").symlink_to("..")
    files, skipped = collect_images([tmp_path / "imgs"])
    assert [f.name for f in files] == ["a.png"]
    assert [p for p, why in skipped if "already walked" in why] == [str(tmp_path / "imgs" / "x" / "up")]


def test_predict_walks_a_very_deep_tree(tmp_path):
    """Path.rglob recursed once per folder: a tree 1,200 folders deep raised RecursionError (an 'unexpected
    failure')."""
    deep, levels = tmp_path / "deep", 1200
    deep.mkdir()
    here = os.getcwd()
    try:
        os.chdir(deep)  # short relative names: the full path would pass PATH_MAX
        for _ in range(levels):
            os.mkdir("d")
            os.chdir("d")
        picture(type(deep)("bottom.png"))
        os.chdir(here)
        files, _ = collect_images([deep])
        assert [f.name for f in files] == ["bottom.png"]
    finally:  # removed here, bottom up: pytest's own clean-up (shutil.rmtree) recurses and fails on it
        os.chdir(deep)
        depth = 0
        while os.path.isdir("d"):
            os.chdir("d")
            depth += 1
        if os.path.exists("bottom.png"):
            os.remove("bottom.png")
        for _ in range(depth):
            os.chdir("..")
            os.rmdir("d")
        os.chdir(here)


def test_a_quoted_double_star_pattern_ends_on_link_loops(tmp_path, weights, capsys):
    """glob.glob's `**` follows every link into folders: two `ln -s .. up` links made `vitlab predict W
    'imgs/**/*.png'` run for ever (killed after a minute)."""
    picture(tmp_path / "imgs" / "x" / "a.png")
    picture(tmp_path / "imgs" / "b.png")
    (tmp_path / "imgs" / "x" / "up").symlink_to("..")
    (tmp_path / "imgs" / "x" / "up2").symlink_to("..")
    with deadline(20):
        files, _ = collect_images([str(tmp_path / "imgs" / "**" / "*.png")])
    assert [f.relative_to(tmp_path / "imgs").as_posix() for f in files] == ["b.png", "x/a.png"]
    assert [f.name for f in collect_images([str(tmp_path / "imgs" / "*" / "*.png")])[0]] == ["a.png"]
    assert [f.name for f in collect_images([str(tmp_path / "imgs" / "*.png")])[0]] == ["b.png"]
    assert main(["predict", str(weights), str(tmp_path / "imgs" / "**" / "*.png"), "--engine", "torch",
                 "--format", "csv", "--quiet"]) == 0
    assert capsys.readouterr().out.count("\n") == 1 + 2 * 3  # a header, 2 images x 3 classes


# --- file and folder names that are not UTF-8 ------------------------------------------------------------


def test_predict_prints_names_that_are_not_utf8_on_a_strict_stdout(tmp_path, weights, capsys):
    """Linux file names are bytes; one that is not UTF-8 (a Latin-1 `é`) reaches Python as a surrogate escape.
    Printed as it was, it stopped `vitlab predict` with UnicodeEncodeError on any strict UTF-8 stdout (every UTF-8
    locale but C.UTF-8; pytest's capture is one), after all the images were classified."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    picture(type(folder)(os.fsdecode(os.fsencode(folder) + b"/caf\xe9.png")))
    for fmt in ("table", "csv"):
        assert main(["predict", str(weights), str(folder), "--engine", "torch", "--format", fmt, "--quiet"]) == 0
        assert "caf\\xe9.png" in capsys.readouterr().out


def test_class_folder_names_that_are_not_utf8_are_escaped_class_names(tmp_path, capsys):
    """A class folder `cat<0xff>` became a class name matplotlib cannot draw: `vitlab train` failed at its very end
    (the confusion matrix) and `vitlab data inspect` on its sample grid, each an 'unexpected failure'."""
    from vitlab.data import load_data

    root = tmp_path / "data"
    for name in (b"cat\xff", b"dog"):
        for i in range(3):
            picture(type(root)(os.fsdecode(os.fsencode(root) + b"/" + name + b"/%d.png" % i)), 40 * i)
    (root / "dog" / "3.png").write_bytes(b"junk")
    os.rename(root / "dog" / "3.png", os.fsencode(root / "dog") + b"/bad\xfe.png")
    assert load_data(str(root), progress=False).class_names == ["cat\\xff", "dog"]
    assert main(["data", "inspect", str(root), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert "bad\\xfe.png" in (tmp_path / "out" / "skipped_files.txt").read_text()


# --- IDX files ---------------------------------------------------------------------------------------------


def test_idx_images_with_an_empty_side_are_one_line(tmp_path, capsys):
    """An IDX header of N x 0 x 28 loaded (0 bytes of data agree with it) and `vitlab train` failed in the resize
    of the first batch with an 'unexpected failure'."""
    import numpy as np

    from vitlab.data.idx import write_idx

    for prefix in ("train", "t10k"):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", np.zeros((10, 0, 28), np.uint8))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", np.zeros(10, np.uint8))
    assert main(["data", "inspect", f"mnist:{tmp_path}", "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "images of 0x28 pixels" in capsys.readouterr().err


def test_classes_that_differ_only_in_case_or_accent_encoding_are_noted(tmp_path):
    """Folders `café` (one character) and `café` (e + a combining accent, as macOS writes names) were two classes
    printed alike, without a word; `Cat` and `cat` too."""
    from vitlab.data import load_data

    for i, name in enumerate(("Cat", "cat", "caf\u00e9", "cafe\u0301", "dog", "1", "01", "2")):
        for j in range(3):
            picture(tmp_path / "data" / name / f"{j}.png", 20 * i + j)
    splits = load_data(str(tmp_path / "data"), progress=False)
    assert len(splits.class_names) == 8
    note = next(n for n in splits.notes if "differ only in case" in n)
    assert "Cat and cat" in note and "cafe\\u0301 and caf\\xe9" in note and "01 and 1" in note
    assert "dog" not in note and "2" not in note.split("(")[1]


# --- CSV files ---------------------------------------------------------------------------------------------


def test_csv_paths_missing_for_a_known_reason_say_how_to_write_them(tmp_path, monkeypatch):
    """A CSV written on Windows (`img\\0.png`) or with paths relative to the current folder instead of the CSV's
    was 'no usable image ... missing file; check the files or the path', which names neither cause nor fix."""
    from vitlab.data import load_data
    from vitlab.errors import VitlabError

    data = tmp_path / "data"
    for i in range(4):
        picture(data / "img" / f"{i}.png", 40 * i)
    (data / "win.csv").write_text("".join(f"img\\{i}.png,{i % 2}\n" for i in range(4)))
    with pytest.raises(VitlabError, match=r"written with Windows separators \(img\\0.png\): write them with / "
                                          r"\(img/0.png\)"):
        load_data(str(data / "win.csv"), progress=False)
    (data / "cwd.csv").write_text("".join(f"data/img/{i}.png,{i % 2}\n" for i in range(4)))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VitlabError, match=r"data/img/0.png is in the current folder, not in the CSV's folder"):
        load_data("data/cwd.csv", progress=False)
    (data / "mixed.csv").write_text("".join(f"img/{i}.png,{i % 2}\n" for i in range(4)) + "img\\1.png,1\n")
    assert any("Windows separators (img\\1.png)" in n for n in load_data("data/mixed.csv", progress=False).notes)


# --- tar shards --------------------------------------------------------------------------------------------


def shard(folder, labels: dict[str, bytes]):
    """One training shard: a 20x20 PNG and a .cls member of the given bytes per key."""
    import io
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "train-000000.tar", "w") as tar:
        for i, (key, label) in enumerate(labels.items()):
            buf = io.BytesIO()
            Image.new("RGB", (20, 20), (10 * i, 0, 0)).save(buf, "PNG")
            for name, data in ((f"{key}.png", buf.getvalue()), (f"{key}.cls", label)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return folder


def test_an_empty_cls_member_is_one_bad_sample_not_a_refused_set(tmp_path):
    """An empty .cls was read as the class name '' and refused the whole shard set as a mix of class numbers and
    names; the docs promise a bad label is one skipped, listed sample."""
    from vitlab.data import load_data

    good = {k: str(i % 2).encode() for i, k in enumerate("abcdef")}
    splits = load_data(str(shard(tmp_path / "sh", {**good, "z": b""})), progress=False, val_fraction=0,
                       test_fraction=0)
    assert splits.class_names == ["0", "1"] and len(splits.train) == 6
    assert [(p.rsplit("/", 1)[-1], why) for p, why in splits.all_skipped()] == [("z", "bad label (empty label member)")]


@pytest.mark.parametrize("label, culprit", [(b"99999999999999999999", "first such sample: "),
                                            (b"cat", "e.g. a name in "),
                                            ("\u0661".encode(), "e.g. a name in ")])  # Arabic-Indic 1: was index 1
def test_labels_refusing_a_shard_set_name_the_sample(tmp_path, label, culprit):
    """A label that refuses a whole shard set (a class number too large for an index, or names mixed with numbers)
    was said without the sample holding it: in a set of a million samples, no way to find it."""
    from vitlab.data import load_data
    from vitlab.errors import VitlabError

    good = {k: str(i % 2).encode() for i, k in enumerate("abcdef")}
    folder = shard(tmp_path / "sh", {**good, "z": label})
    with pytest.raises(VitlabError, match=f"{culprit}{folder}/train-000000.tar/z "):
        load_data(str(folder), progress=False)


def test_shard_output_that_is_no_folder_is_refused_first(tmp_path, capsys):
    """`vitlab data shard SRC OUT` with OUT a file or a dangling link read the whole source, then said "File exists:
    OUT; check the path, its permissions and the free disk space"."""
    for i in range(2):
        picture(tmp_path / "data" / f"c{i}" / "0.png", i)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for out in ("afile", "gone"):
        assert main(["data", "shard", str(tmp_path / "data"), str(tmp_path / out), "--quiet"]) == 2
        assert f"{tmp_path / out} exists and is not a folder" in capsys.readouterr().err


def test_hugging_face_label_refusing_the_set_names_the_row(tmp_path, monkeypatch):
    """A label too large for a class index (a corrupt row, an ID in the label column) refuses a Hugging Face data set
    as it must, but named no row: in 100,000 rows there was no way to find it."""
    import io

    from vitlab.data import load_data
    from vitlab.errors import VitlabError

    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    cells = []
    for i in range(5):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(buf, "PNG")
        cells.append({"bytes": buf.getvalue(), "path": None})
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    datasets.Dataset.from_dict({"image": cells, "label": [0, 1, 0, 99999999999, 1]},
                               features=feats).save_to_disk(str(tmp_path / "disk"))
    with pytest.raises(VitlabError, match=r"first such row: train\[3\] \(99999999999\)"):
        load_data(f"hf:{tmp_path / 'disk'}", progress=False)


def test_class_folder_links_whose_target_is_gone_are_listed(tmp_path):
    """A symlink farm whose class folder links point to a drive not mounted lost those classes without a word: the
    links are no folders, so they were passed over, and training went on with the classes left."""
    from vitlab.data import load_data

    for c in ("dogs", "owls"):
        for i in range(3):
            picture(tmp_path / "farm" / c / f"{i}.png", 40 * i)
    (tmp_path / "farm" / "cats").symlink_to(tmp_path / "unmounted" / "cats")
    splits = load_data(str(tmp_path / "farm"), progress=False)
    assert splits.class_names == ["dogs", "owls"]
    assert (str(tmp_path / "farm" / "cats"), "dangling link (its target does not exist; nothing read from it)") \
        in splits.all_skipped()


# --- the same photo, through predict and through a data set -------------------------------------------------


def test_odd_photos_reach_the_model_alike_through_predict_and_a_data_set(tmp_path):
    """EXIF orientations 1-8, CMYK, RGBA and palette GIFs of other shapes than the model's: the tensor `vitlab predict`
    gives the model and the one evaluation makes of the stored image agree within 8-bit rounding."""
    import numpy as np

    from vitlab.data import load_data
    from vitlab.data.images import open_image

    pre = Preprocess(image_size=(16, 16), mean=(0.5,) * 3, std=(0.5,) * 3)
    rng = np.random.default_rng(0)
    for i in range(16):
        w, h = int(rng.integers(18, 60)), int(rng.integers(18, 60))
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        exif = Image.Exif()
        exif[0x0112] = i % 8 + 1
        path = tmp_path / "data" / "test" / "xy"[i % 2] / f"{i}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if i % 4 == 0:
            img.save(f"{path}.jpg", exif=exif, quality=95)
        elif i % 4 == 1:
            img.convert("RGBA").save(f"{path}.png", exif=exif)
        elif i % 4 == 2:
            img.convert("CMYK").save(f"{path}.jpg", exif=exif)
        else:
            img.convert("P").save(f"{path}.gif")
        picture(tmp_path / "data" / "train" / "xy"[i % 2] / f"{i}.png", i)
    test = load_data(str(tmp_path / "data"), progress=False, **pre.storage()).test
    assert len(test) == 16
    for i, path in enumerate(test.paths):
        from_file = pre(open_image(path))
        from_store = pre.batch(test[i][0].unsqueeze(0))[0]
        assert from_file.shape == from_store.shape == (3, 16, 16)
        assert (from_file - from_store).abs().max() <= 1.01 / 127.5, path


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_a_photo_whose_exif_does_not_parse_is_read_as_stored(tmp_path, fmt):
    """A PNG (or WebP) with a garbled EXIF block has whole pixels, but applying the orientation raised ("not a TIFF
    file") and the photo was skipped as a corrupt image in training and refused by predict."""
    from vitlab.data.images import open_image

    path = tmp_path / f"x.{fmt.lower()}"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(path, fmt, exif=b"\xde\xad" * 10, **({"lossless": True} if fmt == "WEBP" else {}))
    img = open_image(path)
    assert img.size == (40, 30) and img.getpixel((0, 0)) == (200, 10, 10)


@pytest.mark.parametrize("classes", ["", ",,", []])
def test_classes_naming_no_class_is_refused_not_all_classes(tmp_path, classes):
    """`--classes "$SUBSET"` with an empty variable (or a stray `,`) loaded every class without a word."""
    from vitlab.data import load_data
    from vitlab.errors import VitlabError

    for c in ("a", "b", "c"):
        for i in range(3):
            picture(tmp_path / "data" / c / f"{i}.png", 40 * i)
    with pytest.raises(VitlabError, match="names no class"):
        load_data(str(tmp_path / "data"), classes=classes, progress=False)


def test_class_names_with_line_breaks_or_surrogates_keep_the_table_whole(tmp_path, capsys):
    """Class names come from the weights (a Hugging Face id2label, an old run): one with a line break split the
    table's lines, one holding a lone surrogate stopped predict with UnicodeEncodeError."""
    model = create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=16,
                         num_classes=3, seed=0).eval()
    save_native(model, tmp_path / "w", class_names=["two\nlines", "cat\udcff", "dog"],
                preprocess=Preprocess(image_size=(16, 16), mean=(0.5,) * 3, std=(0.5,) * 3))
    picture(tmp_path / "a.png")
    assert main(["predict", str(tmp_path / "w"), str(tmp_path / "a.png"), "--engine", "torch", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and any("two\\nlines" in line for line in out) and any("cat\\xff" in line for line in out)


def test_inspect_table_keeps_a_class_name_with_a_line_break_on_one_row(tmp_path, capsys):
    for i in range(4):
        picture(tmp_path / "img" / f"{i}.png", 40 * i)
    (tmp_path / "l.csv").write_text("".join(f'img/{i}.png,"{"a" if i % 2 else "b"}\nx"\n' for i in range(4)))
    assert main(["data", "inspect", str(tmp_path / "l.csv"), "--out", str(tmp_path / "out")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows[2:4]] == ["a\\nx", "b\\nx"]


def test_inspect_of_dot_dot_writes_inside_data_inspect(tmp_path, monkeypatch):
    """`vitlab data inspect ..` wrote samples.png and summary.json into the current folder (data-inspect/..), over
    any summary.json there; `vitlab data inspect .` into data-inspect/ itself."""
    for c in ("a", "b"):
        for i in range(3):
            picture(tmp_path / "data" / c / f"{i}.png", 40 * i)
    monkeypatch.chdir(tmp_path / "data" / "a")
    # data-inspect/ here is inside class folder a: its samples.png was read as an image of a by the next run
    # (audit 19), so the default --out inside the source is refused, and nothing is written
    assert main(["data", "inspect", "..", "--quiet"]) == 2
    assert not (tmp_path / "data" / "a" / "summary.json").exists()
    assert not (tmp_path / "data" / "a" / "data-inspect").exists()


@pytest.mark.parametrize("mode, key", [("RGB", (0, 0, 0)), ("L", 0)])
def test_a_transparent_colour_of_an_rgb_or_grey_png_becomes_white(tmp_path, mode, key):
    """A PNG's tRNS chunk makes one colour of an RGB or grey image transparent: those pixels came out as that colour
    (black here) while the same picture saved as RGBA or with a palette came out white, as the docs promise."""
    import numpy as np

    from vitlab.data.images import open_image

    pixels = np.zeros((4, 4, 3) if mode == "RGB" else (4, 4), np.uint8)
    pixels[0, 0] = 10
    Image.fromarray(pixels).save(tmp_path / "t.png", transparency=key)
    Image.fromarray(pixels).convert("RGBA").save(tmp_path / "rgba.png")
    rgba = np.array(Image.open(tmp_path / "rgba.png"))
    rgba[..., 3] = np.where((rgba[..., :3] == 0).all(-1), 0, 255)  # the same transparency, as an alpha channel
    Image.fromarray(rgba).save(tmp_path / "rgba.png")
    got = np.asarray(open_image(tmp_path / "t.png", mode="RGB"))
    assert np.array_equal(got, np.asarray(open_image(tmp_path / "rgba.png", mode="RGB")))
    assert got[1, 1].tolist() == [255, 255, 255] and got[0, 0].tolist() == [10, 10, 10]


def test_a_csv_line_of_millions_of_fields_is_refused_in_bounded_memory(tmp_path):
    """The csv module bounds each field (128 KiB) but not a row's number of fields: one 60 MB line of `,ab` made
    20 million strings (1.8 GB); a 256 MiB CSV, under the size limit, would have taken about 7 GB."""
    import tracemalloc

    from vitlab.data import load_data
    from vitlab.errors import VitlabError

    (tmp_path / "wide.csv").write_text("img/0.png,cat" + ",ab" * 2_000_000 + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(VitlabError, match="line 1 is over 1,048,576 characters"):
            load_data(str(tmp_path / "wide.csv"), progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 1024**2  # the 6 MB line is read once, never split into 2 million fields
