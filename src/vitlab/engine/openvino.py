"""OpenVINO engines (optional: `pip install 'vitlab[openvino]'`): fp32, exact like ONNX Runtime's, and static int8
calibrated on the user's images.

Why a second runtime: on the 2-core AMD EPYC VM of docs/benchmarks.md (AVX-512 VNNI and BF16), OpenVINO's CPU
plugin runs the int8 matrix products as ORT does, but everything left in floating point (the attention core,
softmax, LayerNorm, GELU) in bf16 where the CPU has it: static int8 ran 1.19x (ViT-B/16) to 1.28x (S/16) ONNX
Runtime's static int8 there (`benchmarks/peers.py --openvino all`, docs/benchmarks.md "OpenVINO: int8 with the rest
in bf16"). Where bf16 is slow (Intel CPUs without AMX run bf16 products at about 0.6x fp32) the same graph runs
with the rest in fp32; `--int8` times both and ORT's graphs, and keeps the fastest.

The int8 graph is vitlab's, not a tool's: the portable ONNX export read into OpenVINO, with a FakeQuantize (the
operator OpenVINO lowers to int8 kernels) on
- each input of a block's linear layer (qkv, proj, fc1, fc2): 256 levels over [min(0, lo), max(0, hi)] of that
  activation on the calibration images, as static int8 in ONNX Runtime takes it (engine/static_int8.py);
- each of their weights: 255 levels, symmetric, one scale per output channel.
The patch embedding and the classifier stay fp32 (as in ORT's int8 graphs: little time, much accuracy), and so
does the attention core: quantizing its probabilities cost accuracy (max logit error 0.15 against 0.04 of the
largest on ViT-S/16) and speed (`benchmarks/int8_attempts.py openvino`).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vitlab.errors import VitlabError

FP32_IR = "openvino-fp32.xml"


def require_openvino():
    try:
        import onnx  # noqa: F401  (the model reaches OpenVINO through the portable ONNX export)
        import openvino
    except ImportError as exc:
        raise VitlabError("this engine needs OpenVINO and onnx: pip install 'vitlab[openvino]'") from exc
    return openvino


@functools.cache
def core():
    """The process's one OpenVINO Core (OpenVINO's advice: a Core loads the device plugins, and every model read or
    compiled here shares them)."""
    return require_openvino().Core()


def openvino_version() -> str:
    """The installed OpenVINO's version, read from its metadata: every cached engine choice is keyed by it, and
    importing OpenVINO (0.2 s here) only to ask would cost every command that never runs it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("openvino")
    except PackageNotFoundError:
        return "none"


def bf16_supported() -> bool:
    """Whether OpenVINO's CPU plugin computes in bf16 on this CPU (AVX-512 BF16 or AMX); without it a bf16 hint
    would only repeat the fp32 candidate."""
    return "BF16" in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def ir_files(xml: Path) -> list[Path]:
    """An OpenVINO model on disk: its graph (.xml) and its weights (.bin)."""
    return [xml, xml.with_suffix(".bin")]


def _save(model, xml: Path) -> Path:
    """Write `model` to `xml` and its .bin, whole or not at all (a killed build leaves no half model behind)."""
    ov = require_openvino()
    tmp = xml.with_name(xml.stem + ".partial.xml")
    # fp32 weights as they are: OpenVINO's default halves them to fp16, which would change the model
    ov.save_model(model, str(tmp), compress_to_fp16=False)
    tmp.with_suffix(".bin").replace(xml.with_suffix(".bin"))
    tmp.replace(xml)
    return xml


def build_fp32_ir(model: nn.Module, folder: Path, image_size: tuple[int, int]) -> Path:
    """`folder/openvino-fp32.xml`: the portable ONNX export as OpenVINO reads it (its own fusions happen when it
    compiles the model)."""
    from vitlab.export import export_onnx, external_data_path

    require_openvino()  # before the export: without OpenVINO or onnx, one line instead of an exporter error
    folder.mkdir(parents=True, exist_ok=True)
    raw = export_onnx(model, folder / "openvino-raw.onnx", image_size=image_size)
    try:
        return _save(core().read_model(str(raw)), folder / FP32_IR)
    finally:
        raw.unlink(missing_ok=True)
        external_data_path(raw).unlink(missing_ok=True)  # a model over 2 GB has its weights there


# ---------------------------------------------------------------------------------------------------- int8
def _constant(port):
    """The Constant behind a MatMul input (through Convert nodes), or None for an activation."""
    node = port.get_node()
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    return node if node.get_type_name() == "Constant" else None


def linear_layers(model) -> list:
    """The MatMuls with a constant 2-D weight, less the classifier (the last one): the layers made int8."""
    layers = [op for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"
              and _constant(op.input_value(1)) is not None and len(op.input_value(1).get_partial_shape()) == 2]
    return layers[:-1]


def _source_key(port) -> tuple[str, int]:
    return port.get_node().get_friendly_name(), port.get_index()


def activation_ranges(model, layers, calibration: list[np.ndarray], threads: int) -> dict[tuple[str, int], tuple]:
    """(min, max) of each distinct input activation of `layers` over all calibration batches, 0 included. Only
    the two scalars per activation come back (a ReduceMin and a ReduceMax appended as extra outputs)."""
    ov = require_openvino()
    import openvino.opset13 as ops

    sources = {}
    for op in layers:
        port = op.input_value(0)
        sources.setdefault(_source_key(port), port)
    outputs = []
    for port in sources.values():
        axes = ops.constant(np.arange(len(port.get_partial_shape()), dtype=np.int64))
        outputs += [ops.reduce_min(port, axes, False).output(0), ops.reduce_max(port, axes, False).output(0)]
    probe = ov.Model(outputs, model.get_parameters(), "vitlab-calibration")
    compiled = core().compile_model(probe, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                   "INFERENCE_PRECISION_HINT": "f32"})
    lows, highs = np.zeros(len(sources)), np.zeros(len(sources))
    for batch in calibration:
        values = compiled(np.ascontiguousarray(batch, np.float32))
        found = np.array([float(values[i]) for i in range(len(outputs))])
        lows, highs = np.minimum(lows, found[0::2]), np.maximum(highs, found[1::2])
    return {key: (lo, hi) for key, lo, hi in zip(sources, lows, highs)}


def _fake_quantize(port, low, high, levels: int):
    import openvino.opset13 as ops

    low, high = ops.constant(np.asarray(low, np.float32)), ops.constant(np.asarray(high, np.float32))
    return ops.fake_quantize(port, low, high, low, high, levels).output(0)


def _weight_limits(op) -> np.ndarray:
    """max |w| per output channel of a MatMul's constant weight, shaped to broadcast against it."""
    weight = _constant(op.input_value(1)).get_data().astype(np.float32)
    channel_axis = 0 if op.get_attributes().get("transpose_b") else 1
    limits = np.abs(weight).max(axis=1 - channel_axis, keepdims=True)
    return np.maximum(limits, np.finfo(np.float32).tiny)  # an all-zero channel still gets a valid range


def quantize(model, calibration: list[np.ndarray], threads: int):
    """`model` (an fp32 ViT read by OpenVINO) with FakeQuantize on its linear layers' inputs and weights, in place
    (see the module docstring); returns it."""
    if not calibration:
        raise VitlabError("static int8 needs calibration images")
    layers = linear_layers(model)
    if not layers:
        raise VitlabError("this model has no linear layers that int8 could cover")
    ranges = activation_ranges(model, layers, calibration, threads)
    quantized = {}
    for op in layers:
        key = _source_key(op.input_value(0))
        if key not in quantized:
            lo, hi = ranges[key]
            quantized[key] = _fake_quantize(op.input_value(0), min(lo, 0.0), max(hi, 0.0), 256)
        op.input(0).replace_source_output(quantized[key])
        limits = _weight_limits(op)
        op.input(1).replace_source_output(_fake_quantize(op.input_value(1), -limits, limits, 255))
    model.validate_nodes_and_infer_types()
    return model


def int8_inputs(model) -> int:
    """How many MatMuls of an OpenVINO model read both their inputs through FakeQuantize (run in int8)."""
    return sum(1 for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"
               and all(op.input_value(i).get_node().get_type_name() == "FakeQuantize" for i in (0, 1)))


def build_int8_ir(fp32_xml: Path, out: Path, calibration: list[np.ndarray], threads: int) -> Path:
    """`out` (.xml and .bin): the fp32 model with static int8 linear layers calibrated on `calibration`."""
    return _save(quantize(core().read_model(str(fp32_xml)), calibration, threads), out)


# --------------------------------------------------------------------------------------------------- engine
class OvEngine:
    """An OpenVINO model compiled for this CPU; takes and returns torch tensors like the other engines.

    `precision` is OpenVINO's INFERENCE_PRECISION_HINT for what runs in floating point: "f32" keeps the model's
    numbers (the exact engine), "bf16" runs the layers that int8 leaves in floating point in bf16, None leaves
    OpenVINO's own default for this CPU (bf16 where the CPU has it: what a user of OpenVINO gets unasked)."""

    runs_model = False  # the compiled model holds its own copy of the weights (engine.release)

    def __init__(self, path: str | Path, threads: int, name: str = "openvino", exact: bool = True,
                 precision: str | None = "f32"):
        self.path, self.name, self.exact = Path(path), name, exact
        config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        if precision is not None:
            config["INFERENCE_PRECISION_HINT"] = precision
        self.compiled = core().compile_model(str(self.path), "CPU", config)
        self.request = self.compiled.create_infer_request()
        self._lock = threading.Lock()  # one infer request: calls from several threads take turns

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = np.ascontiguousarray(images.detach().cpu().float().numpy())
        with self._lock:
            out = self.request.infer({0: x})[0]
            return torch.from_numpy(np.array(out, copy=True))  # the request's buffer is reused by the next call
