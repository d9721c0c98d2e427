"""Large batches run in smaller sub-batches where that is faster on the machine at hand.

A ViT's activations grow with the batch: at ViT-B/16, batch 32, one hidden state takes 19 MB and the MLP's inner
one 77 MB, more than a 32 MB L3 cache, so every layer streams them from main memory. Cut into sub-batches of 16, 8
or 4, the same products run on activations that stay in the caches: 1.03-1.18x on the 2-core AMD VM of
docs/benchmarks.md (section "Sub-batches"), depending on model and engine. Where it pays depends on the caches, so
`--engine auto` and `--int8` time the chosen engine at the command's batch and its halvings once per machine and
shape, keep the choice with the engine's (`choose._Choices`), and say what they picked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# int8 ran fastest in sub-batches of 4 at ViT-Ti/16, S/16 and B/16, fp32 in 8 or 16 (benchmarks/sub_batch.py);
# below 4 each call's fixed costs win (batch 1 is slower than 4 in every engine measured)
MIN_SUB_BATCH = 4


def sub_batch_sizes(batch: int) -> list[int]:
    """The halvings of `batch` down to MIN_SUB_BATCH: the sub-batch sizes worth timing (32 -> [16, 8, 4])."""
    sizes, size = [], batch // 2
    while size >= MIN_SUB_BATCH:
        sizes.append(size)
        size //= 2
    return sizes


class SubBatched:
    """`engine` run on at most `size` images per call, the outputs concatenated in order. An exact engine gives
    each image the same logits as in one call (measured identical in fp32), and so does static int8 (its scales
    are fixed); dynamic int8 quantizes each call's activations with one scale, so there an image's logits depend a
    little on the images that share its call."""

    def __init__(self, engine: Callable[[torch.Tensor], torch.Tensor], size: int):
        if size < 1:
            raise ValueError(f"sub-batch size must be at least 1, got {size}")
        self.engine, self.size = engine, size
        self.name = getattr(engine, "name", type(engine).__name__)
        self.exact = getattr(engine, "exact", True)

    def __getattr__(self, attr: str):
        # what callers read off an engine (the ONNX path, the session) is the wrapped engine's
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(attr)
        return getattr(engine, attr)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[0] <= self.size:
            return self.engine(images)
        return torch.cat([self.engine(part) for part in images.split(self.size)])
