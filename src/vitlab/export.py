"""Export a model to ONNX for fast inference elsewhere, and check the file against PyTorch."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vitlab.errors import VitlabError


def export_onnx(
    model: nn.Module,
    path: str | Path,
    image_size: tuple[int, int] | None = None,
    opset: int = 18,
    dynamic_batch: bool = True,
    metadata: dict | None = None,
) -> Path:
    """Write `model` as ONNX with input `images` (B, C, H, W) and output `logits` (B, K).

    `metadata` (class names, preprocessing) is stored as JSON in the file's metadata_props.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    h, w = image_size or cfg.image_size
    x = torch.zeros(1, cfg.in_chans, h, w)
    model = model.eval()
    dynamic = {"images": {0: "batch"}, "logits": {0: "batch"}} if dynamic_batch else None
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (x,), str(path), input_names=["images"], output_names=["logits"],
            dynamic_axes=dynamic, opset_version=opset, dynamo=False,
        )
    if metadata:
        import onnx

        proto = onnx.load(str(path))
        entry = proto.metadata_props.add()
        entry.key, entry.value = "vitlab", json.dumps(metadata)
        onnx.save(proto, str(path))
    return path


def check_onnx(model: nn.Module, path: str | Path, batch: int = 2, seed: int = 0) -> float:
    """Max absolute difference between ONNX Runtime's and PyTorch's logits on random input."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise VitlabError("checking an ONNX file needs onnxruntime: pip install onnxruntime") from exc
    cfg = model.config
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()  # the runtime's choice (runtime.py), not one per core
    sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    shape = sess.get_inputs()[0].shape
    h = shape[2] if isinstance(shape[2], int) else cfg.image_size[0]
    w = shape[3] if isinstance(shape[3], int) else cfg.image_size[1]
    x = torch.randn(batch, cfg.in_chans, h, w, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model.eval()(x).numpy()
    out = sess.run(["logits"], {"images": x.numpy()})[0]
    return float(np.abs(out - ref).max())
