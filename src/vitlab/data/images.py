"""Robust image decoding with Pillow: every odd-but-valid image becomes RGB or L, every bad file a VitlabError.

Handles EXIF rotation, CMYK, RGBA/LA/palette transparency (composited on white), 16-bit and float
grey images (rescaled to 8 bit; 16-bit grey with alpha too), 16-bit colour PNGs and TIFFs (from all 16 bits),
truncated files, non-image files and decompression bombs.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from vitlab.errors import VitlabError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")

# The formats a file may hold, by content: those Pillow reads for IMAGE_EXTENSIONS (JPEG, incl. phones'
# multi-picture MPO; PNG; GIF; BMP; TIFF; WebP; PPM/PGM/PBM). A JPEG named .png still opens. Unrestricted, Pillow
# tries all of its ~40 formats whatever the name, EPS among them, which it renders by running Ghostscript on the
# file: an external interpreter on an untrusted input, for a file named .jpg.
IMAGE_FORMATS = ("BMP", "GIF", "JPEG", "PNG", "PPM", "TIFF", "WEBP")  # = Image.registered_extensions() of them

# Pillow's own guard: above this many pixels an image is refused (a "decompression bomb").
MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
# Longer side / shorter side above this is refused: bringing the shorter side to the model's size would
# blow the longer one up (a 20,000,000 x 1 image becomes 5e9 pixels), and a centre crop would keep
# under 1% of it anyway. At 100:1 a 256-pixel shorter side means at most 25,600 x 256 pixels (20 MB).
MAX_ASPECT_RATIO = 100


# One fixed scale per mode, never one read from the pixels: an image's 8-bit values must not depend on
# what else is in it (a 16-bit pixel of 300 may not come out darker than one of 200).
SCALE_16BIT = 255.0 / 65535.0  # "I;16*", and "I": Pillow decodes 16-bit PGM/PNG/TIFF into "I" too
SCALE_FLOAT = 255.0  # "F": float images hold 0..1 (as scikit-image and most float writers assume)
_GREY_BLOCK_PIXELS = 65536  # pixels a deep image is converted in at once (_row_boxes; 512 KiB of float64)


def _row_boxes(w: int, h: int):
    """Crop boxes of a few whole rows (about _GREY_BLOCK_PIXELS pixels) covering a w x h image, top to bottom: deep
    images are converted a block at a time, since whole-image float64 temporaries took 8 bytes a pixel each, four
    at once, and np.asarray of the whole image two more copies (a 600 KB deflated float TIFF of 9000x9000 needed
    2.7 GB); the values are the same."""
    rows = max(1, _GREY_BLOCK_PIXELS // max(1, w))
    for top in range(0, h, rows):
        yield (0, top, w, min(h, top + rows))


def _on_white_16(values: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """16-bit `values` composited on white (65535) by `alpha` in 0..1, still on the 16-bit scale."""
    return values * alpha + 65535.0 * (1.0 - alpha)


def _to_8bit_grey(img: Image.Image) -> Image.Image:
    """16-bit ("I;16*"), 32-bit integer ("I") and float ("F") grey images -> 8-bit L by a fixed scale per mode:
    integers 0..65535 -> 0..255 (32-bit values above 65535 clip to 255), floats 0..1 -> 0..255; values
    outside the range clip, NaN becomes 0."""
    scale = SCALE_FLOAT if img.mode == "F" else SCALE_16BIT
    w, h = img.size
    out = np.empty((h, w), np.uint8)
    for box in _row_boxes(w, h):
        block = np.asarray(img.crop(box)).astype(np.float64)
        block *= scale
        np.nan_to_num(block, copy=False, nan=0.0, posinf=255.0, neginf=0.0)
        np.clip(block, 0, 255, out=block)
        out[box[1]:box[3]] = block.round(out=block)  # whole numbers in 0..255: the uint8 cast is exact
    return Image.fromarray(out)  # a 2-D uint8 array becomes mode L


# Pillow has no 16-bit grey+alpha mode: it opens such a PNG as RGBA and keeps each sample's high byte, so the
# picture came out as colour (3 channels) with 8 of its 16 bits. Its rows are 4 bytes a pixel, as a big-endian
# 32-bit integer's: decoded as mode "I" from raw mode "I;32B" (the PNG filters work on those 4 bytes alike), each
# pixel holds grey << 16 | alpha, every bit kept (_reinterpret_grey_alpha_16, _flatten_grey_alpha_16).
_PNG_GREY_ALPHA_16 = "LA;16B"


def is_grey_alpha_16(img: Image.Image) -> bool:
    """Whether `img` (opened, not yet loaded) is a 16-bit grey+alpha PNG, which Pillow shows as mode RGBA."""
    return (img.format == "PNG" and len(img.tile) == 1 and img.tile[0].args == _PNG_GREY_ALPHA_16
            and img.mode == "RGBA")


def header_mode(img: Image.Image) -> str:
    """The mode an opened image's pixels are (what decides grey or colour storage): Pillow's mode, but "LA" for a
    16-bit grey+alpha PNG, which Pillow calls RGBA."""
    return "LA" if is_grey_alpha_16(img) else img.mode


def _reinterpret_grey_alpha_16(img: Image.Image) -> bool:
    """Make a 16-bit grey+alpha PNG decode into mode "I" holding grey << 16 | alpha (see _PNG_GREY_ALPHA_16);
    False, and `img` as it was, where this Pillow's image has not the attributes that takes."""
    if not hasattr(img, "_mode"):
        return False
    img.tile = [img.tile[0]._replace(args="I;32B")]
    img._mode = "I"
    return True


def _flatten_grey_alpha_16(img: Image.Image) -> Image.Image:
    """Mode "I" of grey << 16 | alpha -> 8-bit L composited on white, computed from the 16-bit values and rounded
    once at the end, by the scale 16-bit grey is read with (SCALE_16BIT)."""
    w, h = img.size
    out = np.empty((h, w), np.uint8)
    for box in _row_boxes(w, h):
        packed = np.asarray(img.crop(box)).view(np.uint32)
        grey = (packed >> 16).astype(np.float64)
        alpha = (packed & 0xFFFF).astype(np.float64) / 65535.0
        out[box[1]:box[3]] = np.clip(_on_white_16(grey, alpha) * SCALE_16BIT, 0, 255).round()
    return Image.fromarray(out)


# Pillow has no 16-bit colour modes either: a 16-bit RGB or RGBA PNG or TIFF opens as 8-bit RGB(A)
# from each sample's high byte (raw mode "RGB;16B": 0xFF00 became 255, where 16-bit grey and PPM are rounded from
# all 16 bits to 254), and a 16-bit tRNS colour was compared with those 8-bit pixels (never matched, or matched
# the wrong ones). The same file decoded a second time through the other byte order's raw mode ("RGB;16L") gives
# each sample's low byte, the filters and strips being undone alike; the two make every 16-bit value whole.
_OTHER_BYTE_ORDER = {f"{mode};16{order}": f"{mode};16{other}" for mode in ("RGB", "RGBA")
                     for order, other in (("B", "L"), ("L", "B"), ("N", "B" if sys.byteorder == "little" else "L"))}
# the decoders whose tiles undo their layout (filters, strips, compression: libtiff's comes out in native order,
# "N") before unpacking
_COLOUR_16_CODECS = {"PNG": ("zip",), "TIFF": ("raw", "libtiff")}


def _tile_raw_mode(tile) -> str | None:
    args = tile.args
    return args if isinstance(args, str) else args[0] if isinstance(args, tuple) and args else None


def is_colour_16(img: Image.Image) -> bool:
    """Whether `img` (opened, not yet loaded) is a 16-bit RGB or RGBA PNG or TIFF, whose samples Pillow cuts to
    their high byte."""
    codecs = _COLOUR_16_CODECS.get(img.format, ())
    return (img.mode in ("RGB", "RGBA") and bool(img.tile)
            and all(t.codec_name in codecs and _tile_raw_mode(t) in _OTHER_BYTE_ORDER
                    and _tile_raw_mode(t).startswith(img.mode + ";") for t in img.tile))


def _swapped_byte_order(tile):
    args, raw = tile.args, _OTHER_BYTE_ORDER[_tile_raw_mode(tile)]
    return tile._replace(args=raw if isinstance(args, str) else (raw, *args[1:]))


def _open_low_bytes(source, start: int | None) -> Image.Image:
    """A 16-bit colour image (is_colour_16) opened a second time and set to decode each sample's low byte:
    `source` a path, or a file object rewound to `start`."""
    if start is not None:
        source.seek(start)
    img = pil_open(source)
    if not is_colour_16(img):  # the file changed between the two reads
        img.close()
        raise ValueError("the image changed while it was read")
    img.tile = [_swapped_byte_order(t) for t in img.tile]
    return img


def _whole_colour_16(high: Image.Image, source, start: int | None) -> None:
    """Put into `high` (a 16-bit colour image as Pillow decodes it: the high bytes) the 8-bit values of its whole
    16-bit samples, the same file (`source` at `start`) decoded again for the low bytes: each value by the scale
    16-bit grey is read with (SCALE_16BIT), rounded once; RGBA composited on white from the 16-bit values (as
    _flatten_grey_alpha_16) and left opaque; a pixel of the tRNS colour (16-bit values) white, and the tRNS
    colour dropped, as it named 16-bit values that the 8-bit pixels do not hold."""
    w, h = high.size
    key = high.info.pop("transparency", None)
    out = np.empty((h, w, len(high.mode)), np.uint8)
    with _open_low_bytes(source, start) as low:
        low.load()
        for box in _row_boxes(w, h):
            full = np.asarray(high.crop(box)).astype(np.float64) * 256 + np.asarray(low.crop(box))
            if high.mode == "RGBA":
                full[..., :3] = _on_white_16(full[..., :3], full[..., 3:] / 65535.0)
                full[..., 3] = 65535.0
            elif isinstance(key, tuple) and len(key) == 3:
                full[(full == np.asarray(key, np.float64)).all(axis=-1)] = 65535.0
            out[box[1]:box[3]] = np.clip(full * SCALE_16BIT, 0, 255).round()
    high.frombytes(out.tobytes())  # in place: the image keeps its EXIF, which turns it next


def _grey_16_transparent_white(img: Image.Image, grey: Image.Image) -> Image.Image:
    """A 16-bit grey PNG's tRNS colour made white in its 8-bit `grey`: matched on the 16-bit values (after
    scaling, 300 and 301 are one level), as 8-bit grey with a transparent colour is flattened on white."""
    key = img.info.get("transparency")
    if not isinstance(key, int):
        return grey
    arr = np.array(grey)
    arr[np.asarray(img) == key] = 255
    return Image.fromarray(arr)


def _flatten_alpha(img: Image.Image) -> Image.Image:
    """Composite a transparent image on a white background (what a viewer shows)."""
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def normalise_mode(img: Image.Image, mode: str | None = None) -> Image.Image:
    """Return `img` as "RGB" or "L". `mode=None` keeps grey images grey and makes the rest RGB."""
    m = img.mode
    if m in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        img = _grey_16_transparent_white(img, _to_8bit_grey(img))
    elif m == "1":
        img = img.convert("L")
    elif m == "P":
        img = _flatten_alpha(img) if "transparency" in img.info else img.convert("RGB")
    elif m in ("RGBA", "LA", "PA", "RGBa", "La") or (m in ("RGB", "L") and "transparency" in img.info):
        # RGB and L too when a PNG's tRNS chunk (or a grey GIF) names a transparent colour: its pixels came out as
        # that colour (black, mostly) while the same picture saved as RGBA or palette came out white
        img = _flatten_alpha(img)
        if m in ("LA", "La", "L"):
            img = img.convert("L")
    elif m == "CMYK":
        img = img.convert("RGB")
    elif m not in ("RGB", "L"):
        img = img.convert("RGB")  # YCbCr, LAB, HSV, RGBX, ...
    if mode is not None and img.mode != mode:
        img = img.convert(mode)
    return img


def pil_open(source) -> Image.Image:
    """`Image.open` (the header only) limited to IMAGE_FORMATS; another format is UnidentifiedImageError."""
    return Image.open(source, formats=IMAGE_FORMATS)


def one_line(text: str) -> str:
    """`text` with control characters (a newline in a file name) escaped, so messages stay one line, and the bytes
    of a file name that is not UTF-8 (which Python hands over as surrogate escapes) written `\\xNN`."""
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte: escaped by repr below
        pass
    return text if text.isprintable() else repr(text)[1:-1]


class BadImageError(VitlabError):
    """An image file that cannot be used; `kind` is a short category for summaries, `path` the file."""

    def __init__(self, kind: str, path: str | os.PathLike, detail: str = "", hint: str = ""):
        self.kind, self.path, self.detail = kind, str(path), detail
        text = f"{kind}{f' ({detail})' if detail else ''}: {one_line(str(path))}"
        super().__init__(f"{text}; {hint}" if hint else text)

    @property
    def reason(self) -> str:
        """The message without the path: what goes next to the path in skipped-file lists."""
        return f"{self.kind}{f' ({self.detail})' if self.detail else ''}"


def check_image_header(path: str | os.PathLike, max_pixels: int | None = None) -> tuple[int, int, str]:
    """Read only the header: (width, height, mode). Catches missing, empty, non-image, oversized and
    extremely elongated files cheaply."""
    path = Path(path)
    _check_file(path)
    try:
        with pil_open(path) as img:  # reads the header only
            w, h = img.size
            mode = header_mode(img)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadImageError("image too large", path, "possible decompression bomb") from None
    except UnidentifiedImageError:
        raise BadImageError("not an image", path, "Pillow cannot identify it") from None
    except PermissionError:  # the file is fine; the user cannot read it (Pillow's own error would say "corrupt")
        raise BadImageError("unreadable file", path, "permission denied") from None
    except Exception as exc:
        raise BadImageError("corrupt image", path, _first_line(exc)) from None
    check_image_size(path, w, h, max_pixels)
    return w, h, mode


def check_image_size(path: str | os.PathLike, w: int, h: int, max_pixels: int | None = None) -> None:
    """Refuse sizes that cannot be decoded and resized in bounded memory (from the header, before decoding)."""
    limit = MAX_IMAGE_PIXELS if max_pixels is None else int(max_pixels)
    if w < 1 or h < 1:
        raise BadImageError("corrupt image", path, f"{w}x{h} pixels")
    if w * h > limit:
        raise BadImageError("image too large", path, f"{w}x{h} pixels > limit {limit}, possible decompression bomb")
    if max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        raise BadImageError("extreme aspect ratio", path,
                            f"{w}x{h} pixels, over {MAX_ASPECT_RATIO}:1; it cannot be resized sanely")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_file(path: Path) -> None:
    try:
        if path.is_dir():
            raise BadImageError("not a file", path, "it is a folder")
        st = path.stat()
    except FileNotFoundError:
        raise BadImageError("missing file", path, hint="check the path") from None
    except OSError as exc:
        raise BadImageError("unreadable file", path, exc.strerror or _first_line(exc)) from None
    except ValueError as exc:  # e.g. a NUL byte in a path from a CSV row
        raise BadImageError("bad file name", path, _first_line(exc)) from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO (which blocks an open) or a device (/dev/zero never ends): never opened
        raise BadImageError("not a regular file", path, "a FIFO, a device or a socket")
    if st.st_size == 0:
        raise BadImageError("empty file", path, "0 bytes")


def open_image(path: str | os.PathLike, mode: str | None = None, max_pixels: int | None = None) -> Image.Image:
    """Open, fully decode and normalise an image file; raise VitlabError (BadImageError) if it cannot be used.

    `mode`: "RGB", "L" or None (grey stays L, colour becomes RGB). The EXIF orientation is applied.
    `max_pixels`: refuse larger images (default: Pillow's decompression-bomb limit); images more
    elongated than MAX_ASPECT_RATIO are refused too (see check_image_size).
    """
    path = Path(path)
    _check_file(path)
    return decode_image(path, path, mode, max_pixels)


def _upright(img: Image.Image) -> Image.Image:
    """The decoded image turned as its EXIF orientation says (`ImageOps.exif_transpose`). EXIF that does not parse
    (a garbled eXIf chunk in a PNG: "not a TIFF file") leaves it as stored, as browsers show such a photo: its
    pixels are whole, and it was skipped as a "corrupt or truncated image"."""
    try:
        return ImageOps.exif_transpose(img) or img
    except Exception:  # noqa: BLE001 - any fault of the metadata parser; the pixels are already decoded
        return img


def decode_image(source, name, mode: str | None = None, max_pixels: int | None = None,
                 draft: tuple[int, int] | None = None) -> Image.Image:
    """Decode `source` (a path or a binary file object, e.g. BytesIO of a tar member or a dataset cell) like
    `open_image`; `name` says which image in errors. Bad data is a BadImageError.

    `draft` (w, h): a JPEG is decoded at the smallest of libjpeg's scales 1/2, 1/4, 1/8 that keeps it at least
    that size (DCT scaling, `Image.draft`): several times faster for photos far larger than the model's input,
    with pixels a little different from a full decode and resize. Other formats ignore it."""
    # No global state is changed here (images are decoded from several threads): the size limit is
    # checked explicitly, and Pillow's default LOAD_TRUNCATED_IMAGES=False makes truncated data an error.
    try:
        start = None if isinstance(source, (str, os.PathLike)) else source.tell()  # where a second read begins
        with pil_open(source) as img:
            if draft is not None and img.format == "JPEG":
                img.draft(None, draft)  # sets the reduced scale (and size) the JPEG will be decoded at
            check_image_size(name, *img.size, max_pixels)  # before any pixel is decoded, at the size decoded
            grey_alpha_16 = is_grey_alpha_16(img)
            packed = grey_alpha_16 and _reinterpret_grey_alpha_16(img)
            colour_16 = is_colour_16(img)
            img.load()
            if colour_16:
                _whole_colour_16(img, source, start)
            img = _upright(img)  # turns the packed pixels whole, as any pixel
            out = normalise_mode(_flatten_grey_alpha_16(img) if packed else img, mode)
            if grey_alpha_16 and mode is None and out.mode == "RGB":  # Pillow's 8-bit RGBA: grey all the same
                out = out.convert("L")
            out.load()
            return out
    except VitlabError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadImageError("image too large", name, "possible decompression bomb") from None
    except UnidentifiedImageError:
        raise BadImageError("not an image", name, "Pillow cannot identify it") from None
    except MemoryError:
        raise BadImageError("image too large", name, "out of memory while decoding") from None
    except PermissionError:
        raise BadImageError("unreadable file", name, "permission denied") from None
    except Exception as exc:  # truncated, corrupt data, broken headers: all mean "skip this image"
        raise BadImageError("corrupt or truncated image", name, _first_line(exc)) from None


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL image (L or RGB) -> uint8 tensor (C, H, W)."""
    arr = np.array(img, dtype=np.uint8)  # a writable copy
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def tensor_to_pil(x: torch.Tensor) -> Image.Image:
    """uint8 tensor (C, H, W) with C in {1, 3} -> PIL image."""
    arr = x.detach().cpu().to(torch.uint8).numpy()
    return Image.fromarray(arr[0]) if arr.shape[0] == 1 else Image.fromarray(arr.transpose(1, 2, 0))


# PIL's filters for vitlab's interpolations: bilinear and bicubic compute what torch's anti-aliased resize of
# `Preprocess` computes (within a level of 255); the others are what `Preprocess` itself calls (`pillow_resize`).
PIL_FILTERS = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST, "box": Image.BOX,
               "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


def resize_shorter_center_crop(img: Image.Image, size: int, resample: int = Image.BILINEAR,
                               squash: bool = False, crop_offset: str = "round",
                               inner_crop: tuple[int, int] | None = None) -> Image.Image:
    """Resize so the shorter side is `size`, then cut the central `size` x `size` square (storage format), placed
    as `crop_offset` says (`preprocess.CROP_OFFSETS`); with `squash`, resize the whole image to the square instead
    (for a model whose own preprocessing is a plain resize: the official ViT pipeline and Hugging Face's
    ViTImageProcessor squash a wide photo, they do not crop it). `inner_crop` (h, w): the model's centre crop, cut
    later from this square; the square is placed so that crop lands where predict's one crop does
    (`preprocess.square_start`)."""
    from vitlab.data.preprocess import shorter_side_size

    w, h = img.size
    if squash and (w, h) != (size, size):
        return img.resize((size, size), resample=resample, reducing_gap=3.0)
    if (w, h) != (size, size):
        # torchvision's Resize(int) + CenterCrop arithmetic, as the evaluation's resize_crop_batch (preprocess.py):
        # the long side truncated, the offsets placed as the model's record places them; rounding in one and
        # flooring in the other put a stored image one pixel off the crop `vitlab predict` takes from the file
        nh, nw = shorter_side_size(h, w, size)
        img = img.resize((nw, nh), resample=resample, reducing_gap=3.0)
        top, left = square_starts((nh, nw), size, crop_offset, inner_crop)
        img = img.crop((left, top, left + size, top + size))
    return img


def square_starts(resized: tuple[int, int], size: int, crop_offset: str,
                  inner_crop: tuple[int, int] | None) -> tuple[int, int]:
    """(top, left) of the stored `size` square in a photo resized to `resized` (h, w) (`preprocess.square_start`)."""
    from vitlab.data.preprocess import square_start

    inner = (None, None) if inner_crop is None else (size - inner_crop[0], size - inner_crop[1])
    return (square_start(resized[0] - size, inner[0], crop_offset),
            square_start(resized[1] - size, inner[1], crop_offset))


@dataclass(frozen=True)
class StoredSquare:
    """How a file image becomes the stored `size` x `size` square of a file dataset (`load_data`'s storage).

    squash: the whole image resized to the square, not its centre square (a model whose preprocessing is a plain
    resize). antialias: False shrinks as TensorFlow's `tf.image.resize` does (no anti-aliasing; the official ViT
    and BiT evaluation, `Preprocess.antialias`), so a stored photo is the official input but for rounding to 8 bits.
    interpolation: the model's filter (`Preprocess.interpolation`): a bicubic model (timm's ViTs, DeiT) evaluated on
    files was given bilinear photos where `vitlab predict` gives it bicubic ones. crop_offset: where the centre
    square starts (`Preprocess.crop_offset`): a Hugging Face model floors where torchvision rounds. inner_crop: the
    model's centre crop (h, w), cut later from the square (set only where the square is stored at the side the
    model crops from): the square is placed so that crop lands where `vitlab predict`'s one crop does.
    """

    squash: bool = False
    antialias: bool = True
    interpolation: str = "bilinear"
    crop_offset: str = "round"
    inner_crop: tuple[int, int] | None = None

    def tensor(self, img: Image.Image, size: int) -> torch.Tensor:
        """The stored uint8 (C, size, size) of a decoded image."""
        from vitlab.data.pillow_resize import PILLOW_FILTERS

        # Pillow's own filters are Pillow's in `Preprocess` too, anti-aliased or not (they always are)
        by_pil = self.interpolation in PILLOW_FILTERS or (self.antialias and self.interpolation in PIL_FILTERS)
        if img.size == (size, size) or by_pil:
            resample = PIL_FILTERS.get(self.interpolation, Image.BILINEAR)
            return pil_to_tensor(resize_shorter_center_crop(img, size, resample, squash=self.squash,
                                                            crop_offset=self.crop_offset, inner_crop=self.inner_crop))
        # torch's resize, as `Preprocess.batch` computes it: TensorFlow's resize without anti-aliasing (PIL always
        # anti-aliases), and torch's area, which averages other windows than PIL's box
        from vitlab.data.preprocess import resize_batch, shorter_side_size

        x = pil_to_tensor(img).float().unsqueeze(0)
        resized = (size, size) if self.squash else shorter_side_size(x.shape[-2], x.shape[-1], size)
        x = resize_batch(x, resized, self.interpolation, self.antialias)
        top, left = square_starts(resized, size, self.crop_offset, self.inner_crop)
        return x[0, :, top:top + size, left:left + size].round().clamp_(0, 255).to(torch.uint8)


def is_image_file(path: str | os.PathLike) -> bool:
    """True when the file name has a known image extension (content is checked only when opened)."""
    return str(path).lower().endswith(IMAGE_EXTENSIONS)
