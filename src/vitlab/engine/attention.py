"""Engines for `vitlab inspect`, which needs every layer's attention probabilities besides the logits.

The ONNX graph returns them as outputs (`logits`, `attention_0` ... `attention_{L-1}`); ORT still fuses the
LayerNorms and GELUs, but not the attention itself, whose probabilities are now outputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vitlab.engine.choose import (
    _Choices,
    _speeds_text,
    announce,
    artefact_folder,
    check_exact,
    keep_fastest,
    kept_or_built,
    machine_key,
    open_or_rebuild,
    reason,
)
from vitlab.engine.torch_engines import TorchEngine
from vitlab.errors import VitlabError
from vitlab.runtime import timing_input

AttentionResult = tuple[torch.Tensor, list[torch.Tensor]]


class _WithAttention(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor):
        logits, attentions = self.model(x, return_attention=True)
        return (logits, *attentions)


class TorchAttentionEngine(TorchEngine):
    def __call__(self, x: torch.Tensor) -> AttentionResult:
        return super().__call__(x, return_attention=True)


class OrtAttentionEngine:
    name = "onnxruntime"
    runs_model = False

    def __init__(self, path: Path, threads: int):
        from vitlab.engine.ort import make_session

        self.session = make_session(path, threads)

    def __call__(self, x: torch.Tensor) -> AttentionResult:
        outs = self.session.run(None, {"images": np.ascontiguousarray(x.detach().cpu().float().numpy())})
        return torch.from_numpy(outs[0]), [torch.from_numpy(a) for a in outs[1:]]


def build_with_attention(model: nn.Module, folder: Path, image_size: tuple[int, int]) -> Path:
    """`folder/fp32-attention.onnx`: logits and every layer's attention, LayerNorm/GELU fused by ORT."""
    from vitlab.engine.onnx_graph import trace_to_onnx
    from vitlab.engine.ort import build_graph, graph_files, require_onnxruntime

    require_onnxruntime()
    out = folder / "fp32-attention.onnx"
    names = ["logits"] + [f"attention_{i}" for i in range(len(model.blocks))]

    def build() -> None:
        build_graph(model, out, lambda work: trace_to_onnx(
            _WithAttention(model), torch.zeros(1, model.config.in_chans, *image_size), work / "attention-raw.onnx",
            output_names=names))

    # reused only if this user's vitlab wrote it and it is unchanged, as every other engine file: any graph found
    # there ran, and `auto`'s cached pick runs it unchecked (another model's graph gave that model's logits and maps)
    kept_or_built(folder, graph_files(out, model), build)
    return out


def _open_attention_graph(model: nn.Module, folder: Path, size: tuple[int, int], threads: int) -> OrtAttentionEngine:
    """The cached graph, or built again once when ORT cannot load it (a build killed half-way)."""
    from vitlab.engine.ort import graph_files

    return open_or_rebuild(lambda: OrtAttentionEngine(build_with_attention(model, folder, size), threads),
                           graph_files(folder / "fp32-attention.onnx", model), lambda what: None)


def _max_diff(a: AttentionResult, b: AttentionResult) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip([a[0], *a[1]], [b[0], *b[1]]))


def prepare_attention_engine(model: nn.Module, engine: str = "auto", *, batch_size: int = 32,
                             image_size: tuple[int, int] | None = None, source=None, command: str = "inspect",
                             quiet: bool = False):
    """A callable x -> (logits, attentions) for `engine` (auto|torch|onnxruntime|compiled); `auto` times torch
    and ONNX Runtime once per machine and shape and caches the choice beside the model."""
    from vitlab.engine import ENGINES

    if engine not in ENGINES:
        raise VitlabError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    reference = TorchAttentionEngine(model)
    if engine == "torch":
        return announce(reference, command, ["torch (as asked)"], quiet)
    if engine in ("compiled", "openvino"):
        raise VitlabError(f"--engine {engine} is not offered for inspect (attention outputs change every layer's "
                          "graph); use auto, torch or onnxruntime")
    size = tuple(image_size or model.config.image_size)
    folder = artefact_folder(model, source)
    threads = torch.get_num_threads()
    key = f"{machine_key(threads)}|batch {batch_size}|{size[0]}x{size[1]}|fp32+attention"
    choices = _Choices(folder)
    cached = choices.get(key) if engine == "auto" else None
    if cached:
        note = (f"{cached['picked']} (auto: chosen before on this machine: {_speeds_text(cached['images_per_s'])}; "
                f"cached in {folder})")
        chosen = reference if cached["picked"] == "torch" else _open_attention_graph(model, folder, size, threads)
        return announce(chosen, command, [note], quiet)
    try:
        ort_engine = _open_attention_graph(model, folder, size, threads)
        check_exact(ort_engine, reference, model.config.in_chans, size, max_diff=_max_diff)
    except Exception as exc:  # auto never fails where eager PyTorch works; asked-for onnxruntime says why
        why = reason(exc)
        if engine == "onnxruntime":
            raise VitlabError(f"engine onnxruntime cannot run this model ({why}); use --engine torch") from exc
        return announce(reference, command, [f"torch (auto: onnxruntime left out: {why})"], quiet)
    if engine == "onnxruntime":
        return announce(ort_engine, command, ["onnxruntime (as asked)"], quiet)
    batch = timing_input(batch_size, model.config.in_chans, *size)
    picked, speeds = keep_fastest(choices, key, {"torch": reference, "onnxruntime": ort_engine}, batch, rounds=3)
    note = f"{picked} (auto: measured {_speeds_text(speeds)} at batch {batch_size}; cached in {folder})"
    return announce(reference if picked == "torch" else ort_engine, command, [note], quiet)
