"""The PyTorch engines: eager (the reference) and `torch.compile` (Inductor, weights frozen for inference)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn


class TorchEngine:
    """Eager PyTorch under `inference_mode`: the exact reference every other engine is checked against."""

    name = "torch"
    exact = True

    def __init__(self, model: nn.Module):
        self.model = model.eval()

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(images)


class CompiledEngine:
    """`torch.compile` of the model (Inductor with frozen weights); its kernels cache in `cache_dir`."""

    name = "compiled"
    exact = True

    def __init__(self, model: nn.Module, cache_dir: str | Path | None = None):
        if cache_dir is not None:  # Inductor reads this when it first compiles: keep the kernels beside the model
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir) / "inductor"))
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights become constants: folded and prepacked for oneDNN
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
        with torch.no_grad():
            return self.compiled(images)[:n]
