"""Audit of `vitlab predict` and static int8's `--calibration` (serving area): hidden files in folders are left out
as the data loader leaves them out; the grey-model note names the first colour image in order; a calibration folder
is taken as images when it holds images, else as any --data source (an IDX folder)."""

import gzip
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data.preprocess import Preprocess
from vitlab.engine.calibration import calibration_from_source
from vitlab.models.registry import create_model
from vitlab.predict import collect_images
from vitlab.weights import save_native


def picture(path, seed=0, size=(16, 16), colour=True):
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3) if colour else (size[1], size[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)
    return path


@pytest.fixture()
def grey_model(tmp_path):
    model = create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=16, in_chans=1,
                         num_classes=3, seed=0).eval()
    save_native(model, tmp_path / "grey", class_names=["a", "b", "c"],
                preprocess=Preprocess(image_size=(16, 16), mean=(0.5,), std=(0.5,), channels=1))
    return tmp_path / "grey"


def test_hidden_files_and_folders_are_not_classified(tmp_path, grey_model, capsys):
    """macOS leaves `._name.jpg` files (AppleDouble metadata, not images) beside every copied photo, and Jupyter a
    `.ipynb_checkpoints/` copy of images: predict read them as images and stopped on the first ("not an image ...;
    add --skip-bad"), or classified duplicates; the data loader (data/files.py) has always left hidden entries out."""
    photos = tmp_path / "photos"
    picture(photos / "a.png", 1)
    picture(photos / "sub" / "b.png", 2)
    (photos / "._a.png").write_bytes(b"\x00\x05\x16\x07AppleDouble metadata")
    picture(photos / ".ipynb_checkpoints" / "a-checkpoint.png", 3)
    files, _ = collect_images([photos])
    assert [f.relative_to(photos).as_posix() for f in files] == ["a.png", "sub/b.png"]
    assert main(["predict", str(grey_model), str(photos), "--engine", "torch", "--format", "csv", "--top-k", "1", "--quiet"]) == 0
    assert capsys.readouterr().out.count("\n") == 3  # a header and two images, no hidden ones
    hidden = picture(tmp_path / ".named" / "c.png", 4)  # named on the command line: classified, as asked
    assert collect_images([hidden])[0] == [hidden]


def test_the_grey_model_note_names_the_first_colour_image_in_order(tmp_path, grey_model, capsys):
    """The note's example was whichever image a reading thread finished first: here the small second one."""
    folder = tmp_path / "imgs"
    picture(folder / "a-large.png", 1, size=(1500, 1500))
    picture(folder / "b-small.png", 2)
    assert main(["predict", str(grey_model), str(folder), "--engine", "torch", "--quiet"]) == 0
    assert "2 colour images (a-large.png, ...) converted to grey" in capsys.readouterr().err


def idx_header(shape) -> bytes:
    return bytes([0, 0, 0x08, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)


def test_calibration_from_an_idx_folder_and_a_folder_with_hidden_entries(tmp_path):
    pre = Preprocess(image_size=(16, 16), mean=(0.5,), std=(0.5,), channels=1)
    idx = tmp_path / "fashion-mnist"  # the layout of /usr/share/datasets/fashion-mnist (Debian's package)
    idx.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 40), ("t10k", 20)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        (idx / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_header(x.shape) + x.tobytes()))
        (idx / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_header(y.shape) + y.tobytes()))
    batches = calibration_from_source(str(idx), pre)  # was "no image files in ..."
    assert sum(len(b) for b in batches) > 16 and batches[0].shape[1:] == (1, 16, 16)

    flat = tmp_path / "calibration"
    for i in range(20):
        picture(flat / f"{i}.png", i)
    picture(flat / ".thumbnails" / "0.png", 0)  # was taken for a class folder: "has 20 images but no class subfolders"
    batches = calibration_from_source(str(flat), pre)
    assert sum(len(b) for b in batches) == 20
    expected = pre(Image.open(flat / "0.png"))
    assert torch.allclose(torch.from_numpy(batches[0][0]), expected)


def test_fifos_in_a_folder_are_listed_and_a_fifo_named_is_one_line(tmp_path):
    """A FIFO in a folder was dropped without a word (the data loader lists it), and one named on the command line
    was "no such image file or folder", though it exists."""
    import os

    from vitlab.errors import VitlabError

    picture(tmp_path / "imgs" / "a.png")
    os.mkfifo(tmp_path / "imgs" / "b.png")
    files, skipped = collect_images([tmp_path / "imgs"])
    assert [f.name for f in files] == ["a.png"]
    assert skipped == [(str(tmp_path / "imgs" / "b.png"), "not a regular file (a FIFO, a device or a socket)")]
    with pytest.raises(VitlabError, match="is not a regular file"):
        collect_images([tmp_path / "imgs" / "b.png"])
