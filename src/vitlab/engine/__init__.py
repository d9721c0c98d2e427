"""Inference engines: the same model run by eager PyTorch, `torch.compile`, ONNX Runtime (fp32 with the
transformer fusions, or int8) or OpenVINO (fp32, or static int8; optional), and `auto`, which times the candidates
once per machine and model shape.

    from vitlab.engine import prepare_engine
    engine = prepare_engine(model, "auto", batch_size=32)      # prints what it picked
    logits = engine(images)                                    # (B, C, H, W) float tensor -> (B, K) logits

Homes: `onnx_graph.py` (the fusable ONNX export), `ort.py` (sessions, fp32 and int8 builds), `openvino.py` (the
OpenVINO models, fp32 and static int8), `torch_engines.py`
(eager, compiled), `choose.py` (timing, the cached choice, the artefact folder), `sub_batch.py` (large batches
cut into the sub-batches that timed faster).
"""

from __future__ import annotations

ENGINES = ("auto", "torch", "onnxruntime", "compiled", "openvino")
INT8_MODES = ("auto", "static", "dynamic")


def prepare_engine(*args, **kwargs):
    """See `vitlab.engine.choose.prepare_engine`."""
    from vitlab.engine.choose import prepare_engine as _prepare

    return _prepare(*args, **kwargs)


__all__ = ["ENGINES", "INT8_MODES", "prepare_engine"]
