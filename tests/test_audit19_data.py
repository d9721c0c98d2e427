"""Audit 19 of the data handling: 16-bit grey+alpha PNGs, CIFAR-100 without its names file, `vitlab data shard`
into its own source, and the studies' messages naming their own flags. Each test fails on the code before it."""

from __future__ import annotations

import io
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from test_cli_hostile import run_cli  # (exit code, stderr lines) of `vitlab ARGV`
from vitlab.cli import main
from vitlab.data import load_data
from vitlab.data.images import check_image_header, decode_image, open_image, pil_to_tensor

# ---------------------------------------------------------------------------------------------------------------
# A PNG writer by hand (zlib + struct), so the 16-bit values are known exactly: Pillow cannot write 16-bit LA.

ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def _filtered(rows: np.ndarray, bpp: int) -> bytes:
    """Rows of bytes, each with the next of the five PNG filters in turn (so every filter's inverse is tested)."""
    out, prior = [], np.zeros(rows.shape[1], np.int64)
    for y, row in enumerate(rows.astype(np.int64)):
        kind = y % 5
        left = np.concatenate([np.zeros(bpp, np.int64), row[:-bpp]])
        upleft = np.concatenate([np.zeros(bpp, np.int64), prior[:-bpp]])
        if kind == 0:
            line = row
        elif kind == 1:
            line = row - left
        elif kind == 2:
            line = row - prior
        elif kind == 3:
            line = row - (left + prior) // 2
        else:
            line = row - np.array([_paeth(a, b, c) for a, b, c in zip(left, prior, upleft)], np.int64)
        out.append(bytes([kind]) + (line % 256).astype(np.uint8).tobytes())
        prior = row
    return b"".join(out)


def png16(samples: np.ndarray, colour_type: int, interlace: bool = False, trns: bytes | None = None) -> bytes:
    """A 16-bit PNG of `samples` (H, W[, C]) uint16: colour type 0 grey, 4 grey+alpha, 6 RGBA."""
    arr = samples.reshape(samples.shape[0], samples.shape[1], -1).astype(">u2")
    h, w, c = arr.shape
    bpp = 2 * c
    if interlace:
        passes = [arr[y0::dy, x0::dx] for x0, y0, dx, dy in ADAM7]
        raw = b"".join(_filtered(p.view(np.uint8).reshape(p.shape[0], -1), bpp) for p in passes if p.size)
    else:
        raw = _filtered(arr.view(np.uint8).reshape(h, -1), bpp)
    head = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, int(interlace))
    extra = _chunk(b"tRNS", trns) if trns is not None else b""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", head) + extra + _chunk(b"IDAT", zlib.compress(raw))
            + _chunk(b"IEND", b""))


def on_white_8bit(grey: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """The reference: 16-bit grey over white by 16-bit alpha, in exact arithmetic, then 0..65535 -> 0..255 by
    the fixed scale vitlab reads 16-bit grey with (rounded once)."""
    g, a = grey.astype(np.float64), alpha.astype(np.float64)
    return np.round((g * a + 65535 * (65535 - a)) / 65535 * 255 / 65535).astype(np.uint8)


def _grey_alpha(seed: int, shape=(13, 11)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    grey = rng.integers(0, 65536, shape, dtype=np.uint16)
    alpha = rng.integers(0, 65536, shape, dtype=np.uint16)
    alpha[0, :4] = (0, 65535, 1, 65534)  # the ends of the alpha range
    grey[1, :3] = (65280, 383, 32768)  # values whose high byte alone is not their 8-bit level
    alpha[1, :3] = 65535
    return grey, alpha


# ---------------------------------------------------------------------------------------------------------------
# 1. 16-bit grey + alpha


@pytest.mark.parametrize("interlace", [False, True], ids=["plain", "adam7"])
def test_16bit_grey_alpha_png_is_grey_on_white_from_all_16_bits(interlace):
    grey, alpha = _grey_alpha(1)
    data = png16(np.stack([grey, alpha], -1), 4, interlace)
    img = decode_image(io.BytesIO(data), "la16.png")
    assert img.mode == "L"  # was RGB: Pillow opens it as RGBA
    np.testing.assert_array_equal(np.asarray(img), on_white_8bit(grey, alpha))
    assert pil_to_tensor(decode_image(io.BytesIO(data), "la16.png", "RGB")).shape == (3, 13, 11)


def test_16bit_grey_alpha_agrees_with_8bit_la_and_16bit_grey():
    """The same picture stored three ways comes out the same: 8-bit LA (Pillow writes it), 16-bit LA with each
    8-bit value times 257, and (fully opaque) plain 16-bit grey."""
    rng = np.random.default_rng(2)
    g8, a8 = rng.integers(0, 256, (9, 7), dtype=np.uint8), rng.integers(0, 256, (9, 7), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.stack([g8, a8], -1), "LA").save(buf, "PNG")
    eight = np.asarray(decode_image(io.BytesIO(buf.getvalue()), "la8.png")).astype(int)
    sixteen = np.asarray(decode_image(io.BytesIO(png16(np.stack([g8, a8], -1).astype(np.uint16) * 257, 4)),
                                      "la16.png")).astype(int)
    assert np.abs(eight - sixteen).max() <= 1  # Pillow's 8-bit compositing rounds in between
    grey = rng.integers(0, 65536, (9, 7), dtype=np.uint16)
    opaque = png16(np.stack([grey, np.full_like(grey, 65535)], -1), 4)
    np.testing.assert_array_equal(np.asarray(decode_image(io.BytesIO(opaque), "a.png")),
                                  np.asarray(decode_image(io.BytesIO(png16(grey, 0)), "g.png")))


def test_16bit_grey_alpha_header_is_grey_so_a_folder_stores_one_channel(tmp_path):
    for cls, seed in (("a", 3), ("b", 4)):
        (tmp_path / cls).mkdir()
        for i in range(3):
            grey, alpha = _grey_alpha(seed * 10 + i, (20, 20))
            (tmp_path / cls / f"{i}.png").write_bytes(png16(np.stack([grey, alpha], -1), 4))
    first = tmp_path / "a" / "0.png"
    assert check_image_header(first)[2] == "LA"
    data = load_data(str(tmp_path), val_fraction=0, test_fraction=0, progress=False)
    assert data.channels == 1
    stored = data.train.images if hasattr(data.train, "images") else None
    assert stored is None or stored.shape[1] == 1
    assert np.asarray(open_image(first)).ndim == 2


def test_16bit_grey_alpha_in_a_shard_is_grey():
    from vitlab.data.shards import image_header

    grey, alpha = _grey_alpha(5)
    assert image_header(io.BytesIO(png16(np.stack([grey, alpha], -1), 4)), "x/0.png")[2] == "LA"


def test_16bit_grey_transparent_colour_is_white():
    """A 16-bit grey PNG whose tRNS names a transparent grey value: those pixels are white, as in 8-bit grey
    (they kept their own grey), and a value one step off stays."""
    grey = np.array([[300, 301, 40000, 0]], np.uint16)
    img = decode_image(io.BytesIO(png16(grey, 0, trns=struct.pack(">H", 300))), "t.png")
    np.testing.assert_array_equal(np.asarray(img), [[255, 1, 156, 0]])


@pytest.mark.parametrize("interlace", [False, True], ids=["plain", "adam7"])
def test_the_png_writer_here_is_right(interlace):
    """The writer above, checked where Pillow reads every bit: 16-bit grey (all five filters, Adam7)."""
    grey, _ = _grey_alpha(6)
    with Image.open(io.BytesIO(png16(grey, 0, interlace))) as img:
        np.testing.assert_array_equal(np.asarray(img), grey)


# ---------------------------------------------------------------------------------------------------------------
# 2. CIFAR-100 without its names file


def _cifar100_folder(root: Path, top_label: int, names: list[str] | None = None) -> Path:
    """A cifar-100-binary folder whose fine labels run 0..top_label (coarse = fine // 5)."""
    from vitlab.data.cifar import write_cifar_records

    folder = root / "cifar-100-binary"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for fname, n in (("train.bin", 30), ("test.bin", 10)):
        fine = np.arange(n) % (top_label + 1)
        images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        write_cifar_records(folder / fname, images, fine, fine // 5)
    if names is not None:
        (folder / "fine_label_names.txt").write_text("".join(f"{n}\n" for n in names))
    return folder


def test_cifar100_without_names_has_its_100_classes(tmp_path):
    _cifar100_folder(tmp_path, top_label=41)  # labels stop at 41 (coarse at 8)
    fine = load_data(f"cifar100:{tmp_path}", val_fraction=0.0, progress=False)
    assert fine.num_classes == 100  # was 42
    assert fine.class_names[0] == "class_0" and fine.class_names[99] == "class_99"
    assert any("no fine_label_names.txt" in n and "100 classes" in n for n in fine.notes)
    coarse = load_data(f"cifar100-coarse:{tmp_path}", val_fraction=0.0, progress=False)
    assert coarse.num_classes == 20  # was 9
    assert any("coarse_label_names.txt" in n for n in coarse.notes)


def test_cifar_short_names_file_keeps_its_names_and_says_so(tmp_path):
    _cifar100_folder(tmp_path, top_label=98, names=[f"fine{i}" for i in range(95)])
    data = load_data(f"cifar100:{tmp_path}", val_fraction=0.0, progress=False)
    # was class_0 .. class_98: five names short threw all 95 away, and the 100th class was lost
    assert data.num_classes == 100
    assert data.class_names[:2] == ["fine0", "fine1"] and data.class_names[95:] == [f"class_{i}" for i in range(95, 100)]
    assert any("names 95 classes, but cifar100 has 100" in n for n in data.notes)


# ---------------------------------------------------------------------------------------------------------------
# 3. `vitlab data shard SRC OUT` with OUT and SRC nested


def _photos(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for cls in ("Cat", "Dog"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("out", ["src/Cat", "src", "src/Dog/../Cat/shards", "./src/new", "linked/Cat", "."],
                         ids=["class-folder", "same", "dotdot", "relative", "through-link", "above"])
def test_shard_out_nested_with_its_source_is_refused_in_one_line(tmp_path, monkeypatch, capsys, out):
    _photos(tmp_path / "src")
    (tmp_path / "linked").symlink_to(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path / "src")
    code, err = run_cli(["data", "shard", "src", out, "--quiet"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "source folder" in err[0] and ("inside" in err[0] or "holds" in err[0] or " is the " in err[0])
    assert _files(tmp_path / "src") == before  # nothing written into the source (was: shards in src/Cat)
    assert not list(tmp_path.glob("*.tar")) and not (tmp_path / "classes.txt").exists()


def test_shard_out_inside_a_class_folder_linked_from_elsewhere_is_refused(tmp_path, capsys):
    """A folder of links to class folders kept elsewhere (a symlink farm) reads those folders: OUT inside one of
    them is inside the source too."""
    _photos(tmp_path / "photos")
    farm = tmp_path / "farm"
    farm.mkdir()
    for cls in ("Cat", "Dog"):
        (farm / cls).symlink_to(tmp_path / "photos" / cls)
    code, err = run_cli(["data", "shard", str(farm), str(tmp_path / "photos" / "Dog" / "shards"), "--quiet"], capsys)
    assert code == 2 and len(err) == 1 and "inside the source folder" in err[0], err
    assert not (tmp_path / "photos" / "Dog" / "shards").exists()


def test_shard_of_shards_into_their_own_folder_keeps_them(tmp_path, capsys):
    """`vitlab data shard S S --force` deleted the source's shards before reading them."""
    _photos(tmp_path / "src")
    assert main(["data", "shard", str(tmp_path / "src"), str(tmp_path / "s"), "--quiet"]) == 0
    capsys.readouterr()
    first = (tmp_path / "s" / "train-000000.tar").read_bytes()
    for source in (str(tmp_path / "s"), str(tmp_path / "s" / "train-{000000..000000}.tar")):
        code, err = run_cli(["data", "shard", source, str(tmp_path / "s"), "--force", "--quiet"], capsys)
        assert code == 2 and len(err) == 1 and "is the source folder" in err[0], err
    assert (tmp_path / "s" / "train-000000.tar").read_bytes() == first


def test_shard_out_beside_the_source_is_fine(tmp_path, monkeypatch, capsys):
    _photos(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    assert main(["data", "shard", "src", "src-shards", "--quiet"]) == 0
    assert load_data("src-shards", val_fraction=0, test_fraction=0, progress=False).num_classes == 2


# ---------------------------------------------------------------------------------------------------------------
# 4. The studies' messages name the studies' own flags

TRAIN_ONLY = re.compile(r"(?<![\w-])--(epochs|steps|batch-size|lr)(?![\w-])|(?<![\w-])(epochs|steps|batch_size|lr)(?![\w-])")


@pytest.mark.parametrize("argv, flag", [
    (["--finetune-epochs", "0", "--finetune-min-steps", "0"], "--finetune-epochs"),
    (["--finetune-min-steps", "-1"], "--finetune-min-steps"),
], ids=["no-finetune-length", "negative-min-steps"])
def test_study_transfer_names_its_own_flags(tmp_path, capsys, argv, flag):
    code, err = run_cli(["study", "transfer", "--data", "bundled", "--out", str(tmp_path / "st"), *argv], capsys)
    assert code == 2 and len(err) == 1, err
    assert flag in err[0] and not TRAIN_ONLY.search(err[0]), err[0]  # was "(e.g. --epochs 10)"
    assert not (tmp_path / "st").exists()


def test_study_scaling_refuses_a_negative_multi_seed_max(tmp_path, capsys):
    """--multi-seed-max -1 was taken (every size one seed) where the other counts refuse a negative."""
    code, err = run_cli(["study", "scaling", "--data", "bundled", "--out", str(tmp_path / "sc"),
                      "--multi-seed-max", "-1"], capsys)
    assert code == 2 and len(err) == 1 and "--multi-seed-max" in err[0], err
    assert not (tmp_path / "sc").exists()


def test_study_scaling_messages_name_its_flags():
    from vitlab.commands.study import SCALING_FLAGS, in_study_flags

    assert in_study_flags("set epochs > 0 or steps > 0 (e.g. --epochs 10)", SCALING_FLAGS) == (
        "set --min-epochs > 0 or --min-steps > 0 (e.g. --min-epochs 10)")
    assert in_study_flags("batch_size must be >= 1, got 0; lr_end and warmup_epochs stay", SCALING_FLAGS) == (
        "--batch-size must be >= 1, got 0; lr_end and warmup_epochs stay")


@pytest.mark.parametrize("flag, value", [("--batch-size", "0"), ("--warmup-steps", "-1"), ("--weight-decay", "-1"),
                                         ("--grad-clip", "-1")])
def test_compare_refuses_a_bad_value_by_its_flag(tmp_path, capsys, flag, value):
    code, err = run_cli(["compare", "--data", "bundled", "--models", "vit-ti/16", "--out", str(tmp_path / "c"),
                      flag, value], capsys)
    assert code == 2 and len(err) == 1 and f"argument {flag}:" in err[0], err  # was "batch_size must be >= 1"


def test_transfer_fine_tuning_divergence_advice_names_the_study_flag(tmp_path, capsys):
    """A downstream model that diverges: compare's advice (lower --lr, --grad-clip, --precision) is said with the
    study's --finetune-lr, in the printed line and in the row study.md shows."""
    from vitlab.errors import VitlabError
    from vitlab.experiments.compare import ModelSpec, _failure
    from vitlab.experiments.transfer import finetune_error
    from vitlab.train.loop import DIVERGENCE_ADVICE

    exc = VitlabError(f"training diverged: loss is nan at step 3{DIVERGENCE_ADVICE}")
    row = _failure(ModelSpec(name="vit", spec="x"), tmp_path / "vit", "fine-tuning", exc, finetune_error)
    printed = capsys.readouterr().err
    for text in (row["error"], printed):
        assert "--finetune-lr" in text and "--grad-clip" not in text and not TRAIN_ONLY.search(text), text
    assert _failure(ModelSpec(name="vit", spec="x"), tmp_path / "v2", "fine-tuning", exc)["error"].endswith(
        DIVERGENCE_ADVICE)  # vitlab compare itself keeps its own advice


# ---------------------------------------------------------------------------------------------------------------
# More of the same kind: `vitlab data inspect` writing into its own source


@pytest.mark.parametrize("argv", [["--out", "src/Cat"], ["--out", "linked/Dog/insp"], []],
                         ids=["class-folder", "through-link", "default-from-inside"])
def test_inspect_out_inside_its_source_is_refused(tmp_path, monkeypatch, capsys, argv):
    """samples.png written into a class folder became one more image of that class (train 8 -> 9), and the
    default data-inspect/ inside a folder of class folders one more class."""
    _photos(tmp_path / "src")
    (tmp_path / "linked").symlink_to(tmp_path / "src")
    monkeypatch.chdir(tmp_path / "src" if not argv else tmp_path)
    source = "." if not argv else "src"
    before = _files(tmp_path / "src")
    code, err = run_cli(["data", "inspect", source, "--quiet", *argv], capsys)
    assert code == 2 and len(err) == 1 and "inside the source folder" in err[0], err
    assert _files(tmp_path / "src") == before


def test_inspect_out_beside_its_source_is_fine(tmp_path, monkeypatch, capsys):
    _photos(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    assert main(["data", "inspect", "src", "--quiet"]) == 0
    assert (tmp_path / "data-inspect" / "src" / "samples.png").is_file()
