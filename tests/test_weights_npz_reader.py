"""The .npz reader (weights/io.py NpzArchive): uncompressed members are read in one call with the zip's CRC-32
checked; they must give exactly numpy's arrays, and damage must still be refused in one line."""

import zipfile

import numpy as np
import pytest

from vitlab.errors import VitlabError
from vitlab.weights.io import NpzArchive

ARRAYS = {
    "c": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    "f": np.arange(24, dtype=np.float32).reshape(4, 6).T,  # saved column-major
    "f3": np.arange(24, dtype=np.float64).reshape(2, 3, 4).T,
    "scalar": np.float32(3.5),
    "empty": np.zeros((0, 3), np.float32),
    "big_endian": np.arange(5, dtype=">f4"),
    "half": np.linspace(-2, 2, 7).astype(np.float16),
}


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_arrays_are_numpys(tmp_path, save, monkeypatch):
    path = tmp_path / "a.npz"
    save(path, **ARRAYS)
    through_numpy = []
    real = np.lib.npyio.NpzFile.__getitem__
    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", lambda self, k: through_numpy.append(k) or real(self, k))
    with NpzArchive(path) as archive:
        for key, want in ARRAYS.items():
            got = archive.read(key)
            assert got.shape == np.shape(want) and got.dtype == want.dtype.newbyteorder("="), key
            assert got.dtype.isnative and np.array_equal(got, want), key
    # stored members are read directly; compressed ones through numpy
    assert through_numpy == ([] if save is np.savez else list(ARRAYS))


def _data_offsets(path):
    """Where each member's bytes begin in the file."""
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    raw = path.read_bytes()
    starts = {}
    for info in infos:
        name_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little")
        extra_len = int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
        starts[info.filename[:-4]] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return starts


@pytest.mark.parametrize("where", [128, 4000 // 2, 128 + 4000 - 1])  # the first, a middle and the last data byte
def test_a_flipped_byte_is_refused_by_the_crc(tmp_path, where):
    path = tmp_path / "a.npz"
    np.savez(path, w=np.arange(1000, dtype=np.float32))  # a 128-byte .npy header, then 4000 bytes
    start, size = _data_offsets(path)["w"]
    assert size == 128 + 4000
    raw = bytearray(path.read_bytes())
    raw[start + where] ^= 0x01
    path.write_bytes(bytes(raw))
    with NpzArchive(path) as archive, pytest.raises(VitlabError, match="Bad CRC-32.*is the file complete"):
        archive.read("w")
