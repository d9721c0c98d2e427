"""Every kind of bad or odd image file: odd-but-valid ones are decoded correctly, bad ones skipped and listed."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.data import BadImageError, load_data, make_loader, open_image, write_skipped
from vitlab.data.images import check_image_header
from vitlab.errors import VitlabError


def _jpeg_bytes(size=(40, 30), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    arr = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
    arr[..., 0] = color[0]
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(width=20000, height=20000) -> bytes:
    """A tiny file whose header declares width*height pixels (above Pillow's bomb limit)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 16)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def good(path: Path, value: int = 100, size=(24, 20), mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, (value, value // 2, 255 - value) if mode == "RGB" else value).save(path)
    return path


def make_bad_files(folder: Path) -> dict[str, Path]:
    """One file of each bad kind in `folder`; returns kind -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    jpg = _jpeg_bytes()
    files = {
        "truncated": folder / "truncated.jpg",
        "zero": folder / "zero.png",
        "text_as_image": folder / "notes.png",
        "corrupt_png": folder / "corrupt.png",
        "bomb": folder / "bomb.png",
        "non_image": folder / "readme.txt",
    }
    files["truncated"].write_bytes(jpg[: len(jpg) // 2])
    files["zero"].write_bytes(b"")
    files["text_as_image"].write_bytes(b"this is not an image\n" * 10)
    buf = io.BytesIO()
    Image.fromarray((np.arange(32 * 32) % 251).astype(np.uint8).reshape(32, 32)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    start = data.index(b"IDAT") + 8
    data[start:start + 20] = b"\xff" * 20  # garbage inside the compressed pixel stream
    files["corrupt_png"].write_bytes(bytes(data))
    files["bomb"].write_bytes(bomb_png())
    files["non_image"].write_text("class notes")
    return files


# --- odd but valid images -------------------------------------------------------------------------


def test_cmyk_jpeg_becomes_rgb(tmp_path):
    p = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (10, 8), (0, 255, 255, 0)).save(p)  # pure red in CMYK
    img = open_image(p)
    assert img.mode == "RGB" and img.size == (10, 8)
    r, g, b = np.asarray(img)[4, 4].tolist()
    assert r > 200 and g < 60 and b < 60


def test_rgba_transparent_pixels_become_white(tmp_path):
    p = tmp_path / "rgba.png"
    arr = np.zeros((6, 6, 4), np.uint8)
    arr[:3] = (10, 20, 30, 255)  # opaque top half
    Image.fromarray(arr, "RGBA").save(p)
    out = np.asarray(open_image(p))
    assert out[0, 0].tolist() == [10, 20, 30]
    assert out[5, 5].tolist() == [255, 255, 255]


def test_palette_with_transparency(tmp_path):
    p = tmp_path / "pal.png"
    img = Image.new("P", (4, 4), 0)
    img.putpalette([0, 0, 255] + [255, 0, 0] * 255)
    img.putpixel((0, 0), 1)
    img.save(p, transparency=0)
    out = np.asarray(open_image(p))
    assert out[0, 0].tolist() == [255, 0, 0]  # opaque palette colour 1
    assert out[3, 3].tolist() == [255, 255, 255]  # transparent index 0 -> white


def test_16bit_grey_scaled_to_8bit(tmp_path):
    p = tmp_path / "deep.png"
    arr = np.array([[0, 65535], [32896, 257]], dtype=np.uint16)  # x / 257 = 0, 255, 128, 1
    Image.fromarray(arr).save(p)
    img = open_image(p)
    assert img.mode == "L"
    assert np.asarray(img).tolist() == [[0, 255], [128, 1]]


def test_exif_rotation_applied(tmp_path):
    p = tmp_path / "rot.jpg"
    img = Image.new("RGB", (20, 10), (0, 0, 0))
    img.paste((255, 255, 255), (0, 0, 5, 10))  # white stripe on the left
    exif = img.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    img.save(p, exif=exif, quality=95)
    out = open_image(p)
    assert out.size == (10, 20)  # width and height swapped
    arr = np.asarray(out.convert("L"))
    assert arr[:5].mean() > 200 and arr[-5:].mean() < 50  # left stripe is now at the top


def test_grey_and_mode_requests(tmp_path):
    p = good(tmp_path / "g.png", 77, mode="L")
    assert open_image(p).mode == "L"
    assert open_image(p, mode="RGB").mode == "RGB"
    assert np.asarray(open_image(p, mode="RGB"))[0, 0].tolist() == [77, 77, 77]


# --- bad files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,expected", [
    ("truncated", "corrupt or truncated"), ("zero", "empty file"), ("text_as_image", "not an image"),
    ("corrupt_png", "corrupt or truncated"), ("bomb", "image too large"), ("non_image", "not an image"),
])
def test_open_image_raises_one_line_error(tmp_path, kind, expected):
    files = make_bad_files(tmp_path)
    with pytest.raises(BadImageError) as info:
        open_image(files[kind])
    assert isinstance(info.value, VitlabError)
    msg = str(info.value)
    assert expected in msg and "\n" not in msg and str(files[kind]) in msg


def test_missing_file_and_pixel_limit(tmp_path):
    with pytest.raises(BadImageError, match="missing file"):
        open_image(tmp_path / "nope.jpg")
    p = good(tmp_path / "big.png", size=(100, 100))
    with pytest.raises(BadImageError, match="too large"):
        open_image(p, max_pixels=5000)
    with pytest.raises(BadImageError, match="too large"):
        check_image_header(tmp_path / "big.png", max_pixels=5000)


def _folder_with_bad_files(root: Path) -> dict[str, Path]:
    for i in range(6):
        good(root / "boots" / f"b{i}.png", 10 + i)
        good(root / "sandals" / f"s{i}.jpg", 200 - i)
    Image.new("CMYK", (24, 20), (0, 0, 0, 0)).save(root / "boots" / "cmyk.jpg")
    Image.new("RGBA", (24, 20), (1, 2, 3, 0)).save(root / "sandals" / "rgba.png")
    (root / "shoes").mkdir()  # an empty class folder
    return make_bad_files(root / "sandals")


def test_folder_skips_and_lists_every_bad_file(tmp_path):
    root = tmp_path / "photos"
    bad = _folder_with_bad_files(root)
    splits = load_data(str(root), val_fraction=0.2, test_fraction=0.0, seed=0, progress=False)
    assert splits.class_names == ["boots", "sandals"]  # the empty class is left out
    total = sum(len(d) for d in splits.splits().values())
    assert total == 14  # 12 good + CMYK + RGBA
    skipped = dict(splits.skipped)
    for path in bad.values():
        assert str(path) in skipped, path
    assert skipped[str(root / "shoes")] == "empty class (no usable image)"
    line = write_skipped(splits, tmp_path / "run")
    listing = (tmp_path / "run" / "skipped_files.txt").read_text().splitlines()
    assert len(listing) == len(bad) + 1
    assert "\n" not in line and "skipped 7 files" in line and "skipped_files.txt" in line


def test_streaming_replaces_files_that_fail_to_decode(tmp_path):
    root = tmp_path / "photos"
    _folder_with_bad_files(root)
    splits = load_data(str(root), val_fraction=0.0, test_fraction=0.0, in_memory=False, progress=False)
    ds = splits.train
    assert not ds.in_memory
    truncated = str(root / "sandals" / "truncated.jpg")
    assert truncated in ds.paths  # its header is fine: only decoding finds it
    seen = 0
    for images, labels in make_loader(ds, 4, shuffle=True, seed=0, num_workers=0):
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 20, 20)
        seen += len(labels)
    assert seen == len(ds)
    assert truncated in dict(splits.all_skipped())
    assert "skipped 7" in write_skipped(splits, tmp_path / "run")


def test_csv_row_pointing_to_missing_file(tmp_path):
    for i in range(4):
        good(tmp_path / "img" / f"a{i}.png", 30)
        good(tmp_path / "img" / f"b{i}.png", 220)
    rows = ["path,label"] + [f"img/a{i}.png,cat" for i in range(4)] + [f"img/b{i}.png,dog" for i in range(4)]
    rows.append("img/missing.png,dog")
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    splits = load_data(str(tmp_path / "list.csv"), val_fraction=0.25, test_fraction=0.0, progress=False)
    assert splits.class_names == ["cat", "dog"]
    assert len(splits.train) + len(splits.val) == 8
    assert splits.skipped == [(str(tmp_path / "img" / "missing.png"), "missing file")]


@pytest.mark.parametrize("header", ["img,class", "file_name,label", "image_id,category", "path,label,split", None])
def test_csv_headers_people_write_are_headers(tmp_path, header):
    """Only five path-column names counted as a header: `img,class` became a data row, a class "class" and a
    skipped "not a file"."""
    for i in range(3):
        good(tmp_path / "img" / f"{i}.png", 30)
        good(tmp_path / "img" / f"1{i}.png", 220)
    rows = [f"img/{i}.png,2" for i in range(3)] + [f"img/1{i}.png,10" for i in range(3)]
    (tmp_path / "list.csv").write_text("\n".join(([header] if header else []) + rows) + "\n")
    splits = load_data(str(tmp_path / "list.csv"), val_fraction=0, test_fraction=0, progress=False)
    assert splits.class_names == ["2", "10"] and len(splits.train) == 6 and splits.skipped == []


def test_a_first_row_that_is_data_stays_data(tmp_path):
    good(tmp_path / "x.png", 30)  # an image whose label happens to be a column-like word
    good(tmp_path / "b.png", 220)
    (tmp_path / "list.csv").write_text("x.png,class\nb.png,other\n")
    splits = load_data(str(tmp_path / "list.csv"), val_fraction=0, test_fraction=0, progress=False)
    assert splits.class_names == ["class", "other"]


def test_source_without_usable_image_is_one_clear_error(tmp_path):
    root = tmp_path / "broken"
    make_bad_files(root / "only")
    with pytest.raises(VitlabError) as info:
        load_data(str(root), progress=False)
    msg = str(info.value)
    assert "no usable image" in msg and "\n" not in msg


def test_folder_without_class_subfolders(tmp_path):
    good(tmp_path / "x.png")
    with pytest.raises(VitlabError, match="no class subfolders"):
        load_data(str(tmp_path), progress=False)


def test_an_unreadable_image_is_called_unreadable_not_corrupt(tmp_path, monkeypatch):
    """chmod 000 (tested through a patched open: root reads anything) was listed as "corrupt image"."""
    from vitlab.data.images import check_image_header, open_image

    path = good(tmp_path / "a.png")
    real_open = Image.open

    def denied(fp, *args, **kwargs):
        if str(fp) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", denied)
    for read in (check_image_header, open_image):
        with pytest.raises(BadImageError) as info:
            read(path)
        assert info.value.reason == "unreadable file (permission denied)"
