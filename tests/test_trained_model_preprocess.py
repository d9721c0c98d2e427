"""A model trained here learnt from stored squares (the centre square of every file), so `predict`, `serve` and the
ONNX export must take the same square of a file: the record said plain resize, which squashed a non-square photo
(a new user's shapes model scored 98.6 % in `evaluate` and 91.7 % in `predict` on the same files)."""

import numpy as np
import torch
from PIL import Image

from vitlab.data import load_data
from vitlab.data.transforms import TransformConfig


def test_a_trained_models_record_takes_the_stored_square_of_a_file(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for i in range(4):
            # wide images whose left and right thirds differ from the middle: a squash keeps them, a crop drops them
            arr = np.full((60, 150, 3), 128, np.uint8)
            arr[:, :45], arr[:, 105:] = 0, 255
            arr[20:40, 60:90] = rng.integers(0, 256, 3)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.png")
    data = load_data(str(tmp_path), val_fraction=0, test_fraction=0, progress=False, report=False)
    pre = TransformConfig(image_size=48, channels=3).preprocess()  # what a run records next to its weights
    assert pre.effective_resize == 48
    for i, path in enumerate(data.train.paths):
        stored, _ = data.train[i]
        from_file = pre(Image.open(path).convert("RGB"))
        from_store = pre.batch(stored.unsqueeze(0))[0]
        assert float((from_file - from_store).abs().mean()) < 0.03, path  # interpolation only, not a squash
    # a square image is the same input either way
    square = Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))
    plain = TransformConfig(image_size=48, channels=3, eval_resize=None)
    assert torch.equal(plain.preprocess()(square), pre(square))
