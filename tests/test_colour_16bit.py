"""16-bit colour images: Pillow opens a 16-bit RGB or RGBA PNG or TIFF as 8-bit from each sample's high byte
(0xFF00 became 255), where 16-bit grey, and Pillow's own 16-bit PPM, are rounded from all 16 bits (254), and a
16-bit transparent colour (tRNS) was compared with the 8-bit pixels. vitlab reads every bit. Each test but the
writers' own fails on the code before it."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from test_audit19_data import on_white_8bit, png16  # a 16-bit PNG written by hand; the on-white reference
from vitlab.data.images import check_image_header, decode_image, open_image


def _samples(seed: int, channels: int, shape=(9, 13)) -> np.ndarray:
    """Random 16-bit samples, with values whose high byte and rounded 8-bit value differ (0xFF00: 255 / 254)."""
    s = np.random.default_rng(seed).integers(0, 65536, (*shape, channels), dtype=np.uint16)
    s[0, 0, :3] = 0xFF00
    return s


def rounded_8bit(samples: np.ndarray) -> np.ndarray:
    """0..65535 -> 0..255 by the fixed scale of 16-bit grey, rounded once (what Pillow does for a 16-bit PPM)."""
    return np.round(samples.astype(np.float64) * 255 / 65535).astype(np.uint8)


def tiff16(samples: np.ndarray, big_endian: bool = False, rows_per_strip: int = 4, deflate: bool = False) -> bytes:
    """A 16-bit RGB (or RGBA, unassociated alpha) TIFF in strips, uncompressed or deflated (which Pillow decodes
    through libtiff), written by hand: Pillow cannot."""
    h, w, c = samples.shape
    e = ">" if big_endian else "<"
    strips = [samples[top:top + rows_per_strip].astype(e + "u2").tobytes() for top in range(0, h, rows_per_strip)]
    if deflate:
        strips = [zlib.compress(strip) for strip in strips]
    n_tags = 11 if c == 4 else 10
    bits_at = 8 + 2 + 12 * n_tags + 4
    offsets_at = bits_at + 2 * c
    counts_at = offsets_at + 4 * len(strips)
    data_at = counts_at + 4 * len(strips)
    offsets = np.cumsum([data_at] + [len(s) for s in strips[:-1]])

    def tag(code, kind, count, value):  # kind 3 SHORT (value left-aligned in its 4 bytes), 4 LONG
        packed = struct.pack(e + "HI", value, 0)[:4] if kind == 3 and count == 1 else struct.pack(e + "I", value)
        return struct.pack(e + "HHI", code, kind, count) + packed

    tags = [tag(256, 4, 1, w), tag(257, 4, 1, h), tag(258, 3, c, bits_at), tag(259, 3, 1, 8 if deflate else 1), tag(262, 3, 1, 2),
            tag(273, 4, len(strips), offsets_at if len(strips) > 1 else data_at), tag(277, 3, 1, c),
            tag(278, 4, 1, rows_per_strip),
            tag(279, 4, len(strips), counts_at if len(strips) > 1 else len(strips[0])), tag(284, 3, 1, 1)]
    if c == 4:
        tags.append(tag(338, 3, 1, 2))  # ExtraSamples: unassociated alpha
    head = (b"MM\x00*" if big_endian else b"II*\x00") + struct.pack(e + "I", 8)
    ifd = struct.pack(e + "H", n_tags) + b"".join(tags) + struct.pack(e + "I", 0)
    tables = (struct.pack(e + "H" * c, *[16] * c) + struct.pack(e + "I" * len(strips), *offsets)
              + struct.pack(e + "I" * len(strips), *[len(s) for s in strips]))
    return head + ifd + tables + b"".join(strips)


def _decoded(data: bytes) -> np.ndarray:
    return np.asarray(decode_image(io.BytesIO(data), "x.png"))


@pytest.mark.parametrize("interlace", [False, True])
def test_16bit_rgb_png_is_read_from_all_16_bits(interlace):
    s = _samples(0, 3)
    out = _decoded(png16(s, 2, interlace=interlace))
    assert out.shape == (9, 13, 3)
    assert out[0, 0].tolist() == [254, 254, 254]  # the high byte alone was 255
    assert np.array_equal(out, rounded_8bit(s))


@pytest.mark.parametrize("interlace", [False, True])
def test_16bit_rgba_png_is_composited_on_white_from_all_16_bits(interlace):
    s = _samples(1, 4)
    out = _decoded(png16(s, 6, interlace=interlace))
    assert out.shape == (9, 13, 3)
    expected = np.stack([on_white_8bit(s[..., c], s[..., 3]) for c in range(3)], axis=-1)
    assert np.array_equal(out, expected)


def test_16bit_rgb_png_agrees_with_pillows_16bit_ppm_and_with_16bit_grey():
    """Three files of one picture: Pillow rounds a 16-bit PPM from all 16 bits itself, and vitlab 16-bit grey."""
    s = _samples(2, 3)
    ppm = b"P6\n13 9\n65535\n" + s.astype(">u2").tobytes()
    assert np.array_equal(_decoded(png16(s, 2)), np.asarray(Image.open(io.BytesIO(ppm)).convert("RGB")))
    grey = s[..., :1].repeat(3, axis=-1)
    assert np.array_equal(_decoded(png16(grey, 2))[..., 0], _decoded(png16(grey[..., 0], 0)))


def test_16bit_rgb_transparent_colour_is_white_matched_on_16_bits():
    s = _samples(3, 3)
    s[1, 1] = (1000, 2000, 3000)  # the tRNS colour
    s[2, 2] = (1000, 2000, 3001)  # one level off in 16 bits, the same 8-bit pixel: stays
    out = _decoded(png16(s, 2, trns=struct.pack(">HHH", 1000, 2000, 3000)))
    assert out[1, 1].tolist() == [255, 255, 255]
    assert out[2, 2].tolist() == rounded_8bit(s[2, 2]).tolist()
    assert np.array_equal(np.delete(out.reshape(-1, 3), 1 * 13 + 1, 0),
                          np.delete(rounded_8bit(s).reshape(-1, 3), 1 * 13 + 1, 0))
    # a key of small 16-bit values whitens its own 16-bit colour, not the pixels whose high bytes equal it
    s[4, 4] = (0, 0, 1)
    s[5, 5] = (0, 0, 300)  # high bytes (0, 0, 1): the key, read as 8 bits
    out = _decoded(png16(s, 2, trns=struct.pack(">HHH", 0, 0, 1)))
    assert out[4, 4].tolist() == [255, 255, 255] and out[5, 5].tolist() == [0, 0, 1]


@pytest.mark.parametrize("deflate", [False, True])
@pytest.mark.parametrize("big_endian", [False, True])
@pytest.mark.parametrize("channels", [3, 4])
def test_16bit_colour_tiff_in_strips_is_read_from_all_16_bits(big_endian, channels, deflate):
    s = _samples(4 + channels, channels, shape=(11, 7))
    data = tiff16(s, big_endian=big_endian, rows_per_strip=3, deflate=deflate)
    out = _decoded(data)
    if channels == 3:
        expected = rounded_8bit(s)
    else:
        expected = np.stack([on_white_8bit(s[..., c], s[..., 3]) for c in range(3)], axis=-1)
    assert np.array_equal(out, expected)


def test_the_tiff_writer_here_is_right():
    """Pillow reads the hand-written TIFF's high bytes where vitlab is not involved (its own behaviour)."""
    s = _samples(9, 3, shape=(11, 7))
    for big_endian in (False, True):
        for deflate, strips in ((False, 4), (True, 1)):  # libtiff reads a compressed file as one tile
            img = Image.open(io.BytesIO(tiff16(s, big_endian=big_endian, rows_per_strip=3, deflate=deflate)))
            assert img.mode == "RGB" and len(img.tile) == strips
            assert img.tile[0].codec_name == ("libtiff" if deflate else "raw")
            assert np.array_equal(np.asarray(img), (s >> 8).astype(np.uint8))
        one_strip = Image.open(io.BytesIO(tiff16(s, big_endian=big_endian, rows_per_strip=11)))
        assert np.array_equal(np.asarray(one_strip), (s >> 8).astype(np.uint8))


def test_16bit_colour_from_a_path_and_from_a_stream_read_to_its_end(tmp_path):
    """The low bytes come from a second read of the same file: a path opens again, a stream (a shard's cell) is
    rewound, wherever the first read left it."""
    s = _samples(10, 3)
    data = png16(s, 2)
    path = tmp_path / "deep.png"
    path.write_bytes(data)
    assert check_image_header(path)[2] == "RGB"
    assert np.array_equal(np.asarray(open_image(path)), rounded_8bit(s))
    stream = io.BytesIO(data)
    assert np.array_equal(np.asarray(decode_image(stream, "member.png")), rounded_8bit(s))


def test_8bit_colour_and_16bit_grey_are_as_before():
    rgb = np.random.default_rng(11).integers(0, 256, (5, 6, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    assert np.array_equal(_decoded(buf.getvalue()), rgb)
    grey = _samples(12, 1)[..., 0]
    assert np.array_equal(_decoded(png16(grey, 0)), rounded_8bit(grey))
