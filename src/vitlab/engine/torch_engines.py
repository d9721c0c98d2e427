"""The PyTorch engines: eager (the reference) and `torch.compile` (Inductor, weights frozen for inference)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

from vitlab.models.fast_linear import PackedWeights, packing_fits
from vitlab.models.threads import ONE_THREAD_MAX_FLOPS, one_thread
from vitlab.models.vit import VisionTransformer
from vitlab.models.vit_direct import DirectInference

__all__ = ["ONE_THREAD_MAX_FLOPS", "TorchEngine", "one_thread"]  # the rule's bound and switch live in models/threads.py


class TorchEngine:
    """Eager PyTorch under `inference_mode`: the exact reference every other engine is checked against. On the
    CPU its linear layers read weights packed once into oneDNN's layout (`PackedWeights`: same logits, faster),
    unless that copy would take more than a quarter of the free memory, a ViT's blocks run as direct operator
    calls (`DirectInference`: the same operators and logits, without the module tree's Python), and a ViT call
    with little arithmetic runs on one thread (ONE_THREAD_MAX_FLOPS) unless `small_calls_on_one_thread` is False."""

    name = "torch"
    exact = True
    runs_model = True  # computes with the model's own tensors (engine.release)

    def __init__(self, model: nn.Module, *, small_calls_on_one_thread: bool = True):
        self.model = model.eval()
        # False for callers whose calls follow one another without a pause (a stream of images), where the second
        # thread is awake and one thread only loses (benchmarks/predict_engine_torch.py)
        self.small_calls_on_one_thread = small_calls_on_one_thread
        self.packed = PackedWeights() if packing_fits(model) else None  # else oneDNN reorders on every call
        self.direct = DirectInference(model, self.packed) if isinstance(model, VisionTransformer) else None
        self._free_plain_after_call = False  # keep_packed_only was asked for and waits for a call that packs

    def __call__(self, images: torch.Tensor, **kwargs):
        packs = self.packed.active() if self.packed is not None else contextlib.nullcontext()
        threads = one_thread() if self.small(images) else contextlib.nullcontext()
        with torch.inference_mode(), packs, threads:
            logits = self.direct(images) if self.direct is not None and not kwargs else None
            if logits is None:  # after keep_packed_only the model's guard refuses this in one line
                return self.model(images, **kwargs)
        if self._free_plain_after_call:
            self._free_plain_weights()
        return logits

    def keep_packed_only(self) -> None:
        """From the next call on, keep only the packed copies of the weights (engine.release.release_model): the
        plain ones are a second copy of the weights (340 MB at ViT-B/16) that only the model's own modules read.
        For a caller that owns the model and runs it only through this engine; the first call packs the weights,
        so the freeing waits for it. Afterwards the model refuses every call but the engine's direct route (a call
        that route does not cover included: the call's own arguments, another dtype)."""
        self._free_plain_after_call = self.direct is not None and self.packed is not None

    def _free_plain_weights(self) -> None:
        from vitlab.runtime import return_freed_memory

        # once: where nothing was packed (the plan did not apply) the model keeps its weights, and freed ones stay so
        self._free_plain_after_call = False
        if self.direct.keep_packed_only():
            return_freed_memory()

    def small(self, images: torch.Tensor) -> bool:
        """Whether this call is a CPU ViT call small enough to run on one thread (ONE_THREAD_MAX_FLOPS)."""
        if not (self.small_calls_on_one_thread and isinstance(self.model, VisionTransformer)
                and images.device.type == "cpu" and images.dim() == 4):
            return False
        return self.flops(images) <= ONE_THREAD_MAX_FLOPS  # infinite for a size the model does not take

    def flops(self, images: torch.Tensor) -> float:
        """Forward FLOPs of the ViT on `images` (twice its multiply-accumulates at their size), counted once per
        size and model config as `model(x)` counts them (DirectInference.per_image)."""
        return images.shape[0] * self.direct.per_image(tuple(images.shape[-2:]))[0]


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
    runs_model = True

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
