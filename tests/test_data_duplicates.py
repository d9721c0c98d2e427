"""Copies of training images in the val or test split are said at load time: their scores count images the model
trained on, and paths cannot show it (the copies are different files)."""

import numpy as np
from PIL import Image

from vitlab.data import load_data
from vitlab.data.duplicates import copies_of_training_images


def _folder(root, copies: int):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
    originals = []
    for k in range(6):
        arr = rng.integers(0, 256, (12, 12), dtype=np.uint8)
        path = root / "train" / "ab"[k % 2] / f"{k}.png"
        Image.fromarray(arr).save(path)
        originals.append((arr, "ab"[k % 2]))
    for k in range(4):
        arr, cls = originals[k] if k < copies else (rng.integers(0, 256, (12, 12), dtype=np.uint8), "ab"[k % 2])
        Image.fromarray(arr).save(root / "test" / cls / f"t{k}.bmp")  # another format: another file, same pixels
    return str(root)


def test_copies_in_the_test_split_are_counted_and_named(tmp_path, capsys):
    d = load_data(_folder(tmp_path, copies=2), val_fraction=0, progress=False, report=True)
    pairs = copies_of_training_images(d.train, d.test)
    assert len(pairs) == 2
    for j, i in pairs:
        assert np.array_equal(d.test.images[j].numpy(), d.train.images[i].numpy())
    [note] = [n for n in d.notes if "same pixels as a training image" in n]
    assert note.startswith("2 of the test split's 4 images") and "t0.bmp" in note and "0.png" in note
    assert "same pixels as a training image" in capsys.readouterr().err


def test_no_note_without_copies_and_none_for_the_bundled_data(tmp_path):
    d = load_data(_folder(tmp_path, copies=0), val_fraction=0, progress=False, report=False)
    assert not any("same pixels" in n for n in d.notes)
    d = load_data("bundled", progress=False, report=False)
    assert not any("same pixels" in n for n in d.notes)
