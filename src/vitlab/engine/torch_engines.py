"""The PyTorch engines: eager (the reference) and `torch.compile` (Inductor, weights frozen for inference)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

from vitlab.models.fast_linear import PackedWeights, packing_fits
from vitlab.models.vit import VisionTransformer
from vitlab.models.vit_direct import DirectInference


class TorchEngine:
    """Eager PyTorch under `inference_mode`: the exact reference every other engine is checked against. On the
    CPU its linear layers read weights packed once into oneDNN's layout (`PackedWeights`: same logits, faster),
    unless that copy would take more than a quarter of the free memory, and a ViT's blocks run as direct operator
    calls (`DirectInference`: the same operators and logits, without the module tree's Python)."""

    name = "torch"
    exact = True

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        self.packed = PackedWeights() if packing_fits(model) else None  # else oneDNN reorders on every call
        self.direct = DirectInference(model, self.packed) if isinstance(model, VisionTransformer) else None

    def __call__(self, images: torch.Tensor, **kwargs):
        packs = self.packed.active() if self.packed is not None else contextlib.nullcontext()
        with torch.inference_mode(), packs:
            if self.direct is not None and not kwargs:
                logits = self.direct(images)
                if logits is not None:
                    return logits
            return self.model(images, **kwargs)


@contextlib.contextmanager
def inductor_settings(cache_dir: Path | None) -> Iterator[None]:
    """Inductor with frozen weights (folded and prepacked for oneDNN), and with `cache_dir` its kernel cache, for
    this engine's calls only: other `torch.compile` users in the process keep their own settings and cache."""
    import torch._inductor.config as inductor_config

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(freezing=True))
        if cache_dir is not None:
            # Inductor's own switch: sets TORCHINDUCTOR_CACHE_DIR and clears its cached paths, then restores both
            from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

            stack.enter_context(temporary_cache_dir(str(cache_dir)))
        yield


class CompiledEngine:
    """`torch.compile` of the model (Inductor with frozen weights); its kernels cache in `cache_dir`."""

    name = "compiled"
    exact = True

    def __init__(self, model: nn.Module, cache_dir: str | Path | None = None):
        self.cache_dir = None if cache_dir is None else Path(cache_dir) / "inductor"
        self.model = model.eval()
        self.compiled = torch.compile(self.model, dynamic=False)
        self.batch: int | None = None

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        # One static shape: a smaller (last) batch is padded rather than compiled again.
        n = images.shape[0]
        self.batch = self.batch or n
        if n < self.batch:
            pad = images.new_zeros((self.batch - n, *images.shape[1:]))
            images = torch.cat([images, pad])
        elif n > self.batch:
            return torch.cat([self(chunk) for chunk in images.split(self.batch)])
        # The first call compiles (one static shape, so the only compile): only it needs the kernel cache switched
        cache, self.cache_dir = self.cache_dir, None
        with torch.no_grad(), inductor_settings(cache):
            return self.compiled(images)[:n]
