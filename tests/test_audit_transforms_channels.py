"""Audit: channel handling gives the same numbers whatever the entry point.

`vitlab predict` and `vitlab serve` turn a colour file into a grey model's input with Pillow
(`normalise_mode(image, "L")`, i.e. `Image.convert("L")`), while `vitlab evaluate`, training and the batched
`Preprocess.batch` convert uint8 RGB batches with `match_channels`. Pillow's ITU-R 601 luma is fixed point,
`(19595 R + 38470 G + 7471 B + 32768) >> 16`; the float `round(0.299 R + 0.587 G + 0.114 B)` used before
disagreed by one level on 8,638 of the 16,777,216 colours, so the same image gave different inputs.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from vitlab.data.images import normalise_mode, pil_to_tensor
from vitlab.data.preprocess import Preprocess, match_channels


def all_colours() -> np.ndarray:
    v = np.arange(256, dtype=np.uint8)
    r, g, b = np.meshgrid(v, v, v, indexing="ij")
    return np.stack([r, g, b], -1).reshape(4096, 4096, 3)


def test_uint8_rgb_to_grey_is_pillows_luma_for_every_colour():
    arr = all_colours()
    pil = np.asarray(Image.fromarray(arr).convert("L"))
    ours = match_channels(torch.from_numpy(arr).permute(2, 0, 1)[None], 1)[0, 0].numpy()
    assert ours.dtype == np.uint8
    assert np.array_equal(ours, pil), f"{int((ours != pil).sum())} colours differ"


def test_predict_and_batched_paths_agree_on_a_colour_image_for_a_grey_model():
    arr = all_colours()[::16, ::16].copy()  # 256 x 256 of the colours
    img = Image.fromarray(arr)
    pre = Preprocess.for_model(64, channels=1)
    single = pre(img)  # predict / serve: Pillow converts the image
    batched = pre.batch(pil_to_tensor(img)[None])[0]  # evaluate: the stored RGB batch is converted in torch
    assert torch.equal(single, batched)
    assert torch.equal(pil_to_tensor(normalise_mode(img, "L")), match_channels(pil_to_tensor(img), 1))


def test_float_and_grey_to_rgb_conversions_unchanged():
    x = torch.rand(2, 3, 4, 5) * 255
    w = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
    assert torch.allclose(match_channels(x, 1), (x * w).sum(1, keepdim=True))
    g = torch.randint(0, 256, (2, 1, 4, 5), dtype=torch.uint8)
    assert torch.equal(match_channels(g, 3), g.expand(2, 3, 4, 5))
