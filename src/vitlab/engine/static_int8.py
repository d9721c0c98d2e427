"""Static int8: the dynamic int8 graph with every activation scale fixed by calibration on the user's images.

`build_int8_dynamic` quantizes each activation per call (DynamicQuantizeLinear: one pass for the range, one to
quantize). Here the range is measured once on calibration images, so each call only quantizes (QuantizeLinear
with a constant scale), and the int8 products take their scales as constants (MatMulIntegerToFloat, QAttention).
Two things follow: an image's logits no longer depend on the other images in its batch, and the graph keeps the
dynamic graph's fusions (fused attention as QAttention, per-channel weights, fc1's bias in the int8 product).
ORT's own `quantize_static` (QDQ) was 5-10 % slower here: its Q/DQ pairs around the MatMuls were not all fused
(benchmarks/ort_variants.py, docs/benchmarks.md).

The range of each activation is taken as DynamicQuantizeLinear takes it, over all calibration images at once:
[min(0, min x), max(0, max x)] -> uint8. Values outside it at inference saturate at 0 or 255.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from vitlab.errors import VitlabError


def activation_ranges(proto, workdir: Path, calibration: list[np.ndarray]) -> dict[str, tuple[float, float]]:
    """Per activation that the graph `proto` quantizes per call: (min, max) over all calibration batches, 0
    included.

    The graph is run with a ReduceMin and a ReduceMax on each such activation as extra outputs, so only scalars
    come back (the activations themselves would take gigabytes for the largest models). They are added to
    `proto` for the run (saved under `workdir`) and taken out again, so the caller's graph is loaded only once."""
    import onnx
    from onnx import helper

    from vitlab.engine.ort import make_session

    names = list(dict.fromkeys(n.input[0] for n in proto.graph.node if n.op_type == "DynamicQuantizeLinear"))
    if not names:  # nothing is quantized per call (asking ORT for no outputs would return all of them)
        return {}
    wanted = []  # min_0, max_0, min_1, ...
    for i, name in enumerate(names):
        for reduce in ("ReduceMin", "ReduceMax"):
            wanted.append(f"calibration_{reduce}_{i}")
            proto.graph.node.append(helper.make_node(reduce, [name], [wanted[-1]], keepdims=0))
            proto.graph.output.append(helper.make_tensor_value_info(wanted[-1], onnx.TensorProto.FLOAT, []))
    augmented = workdir / "calibrate.onnx"
    try:
        onnx.save(proto, str(augmented))
        session = make_session(augmented, threads=0)
        input_name = session.get_inputs()[0].name
        lows, highs = np.zeros(len(names)), np.zeros(len(names))
        for batch in calibration:
            values = np.array(session.run(wanted, {input_name: np.ascontiguousarray(batch, np.float32)}))
            lows = np.minimum(lows, values[0::2])
            highs = np.maximum(highs, values[1::2])
    finally:
        del proto.graph.node[-len(wanted):]
        del proto.graph.output[-len(wanted):]
        augmented.unlink(missing_ok=True)
    if not np.isfinite(lows).all() or not np.isfinite(highs).all():
        raise VitlabError("static int8: an activation is not finite on the calibration images; "
                          "check them, or use --int8 dynamic")
    return {name: (float(lo), float(hi)) for name, lo, hi in zip(names, lows, highs)}


def uint8_scale(low: float, high: float) -> tuple[float, int]:
    """DynamicQuantizeLinear's scale and zero point for the range [low, high] (which contains 0)."""
    scale = (high - low) / 255.0
    if scale == 0.0:  # an activation that is 0 on every calibration image: any scale represents it
        return 1.0, 0
    return scale, int(np.clip(np.round(-low / scale), 0, 255))


def fix_activation_scales(proto, ranges: dict[str, tuple[float, float]]) -> dict[str, str]:
    """Every DynamicQuantizeLinear -> QuantizeLinear with its calibrated scale and zero point, which become
    constants under the names of its scale and zero-point outputs (so every consumer reads them unchanged).
    Returns {zero point name: scale name}."""
    from onnx import helper, numpy_helper

    scales, nodes = {}, []
    for node in proto.graph.node:
        if node.op_type != "DynamicQuantizeLinear":
            nodes.append(node)
            continue
        quantized, scale_name, zero_name = node.output
        scales[zero_name] = scale_name
        scale, zero = uint8_scale(*ranges[node.input[0]])
        proto.graph.initializer.append(numpy_helper.from_array(np.array(scale, np.float32), scale_name))
        proto.graph.initializer.append(numpy_helper.from_array(np.array(zero, np.uint8), zero_name))
        nodes.append(helper.make_node("QuantizeLinear", [node.input[0], scale_name, zero_name], [quantized],
                                      name=f"{node.name}_static"))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return scales


def fuse_int_products(proto, activation_scales: dict[str, str]) -> int:
    """MatMulInteger -> Cast -> Mul(a_scale * b_scale) [-> Add(bias)] -> one MatMulIntegerToFloat.

    ORT fuses this chain into DynamicQuantizeMatMul only behind a DynamicQuantizeLinear; with constant scales it
    would leave four kernels and three passes over the output. A chain of another shape is left as it is (it
    computes the same, only slower). `activation_scales`: {zero point name: scale name} of the quantized
    activations (`fix_activation_scales`)."""
    from onnx import helper

    graph = proto.graph
    constants = {i.name: tuple(i.dims) for i in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    users = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            users[name].append(node)
    replaced, dropped = {}, set()
    for node in graph.node:
        chain = _int_product_chain(node, users, producer, constants, activation_scales)
        if chain is None:
            continue
        inputs, output, absorbed = chain
        replaced[id(node)] = helper.make_node("MatMulIntegerToFloat", inputs, [output], name=f"{node.name}_float",
                                              domain="com.microsoft")
        dropped.update(id(n) for n in absorbed)
    nodes = [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
    return len(replaced)


def _int_product_chain(node, users, producer, constants, activation_scales):
    """(MatMulIntegerToFloat inputs, its output, the nodes it absorbs) for a MatMulInteger whose scales and zero
    points are constants, else None."""
    if node.op_type != "MatMulInteger" or len(node.input) != 4 or not all(i in constants for i in node.input[1:]):
        return None
    cast = _only_user(node.output[0], users, "Cast")
    mul = cast and _only_user(cast.output[0], users, "Mul")
    if mul is None:
        return None
    product = producer.get(next((i for i in mul.input if i != cast.output[0]), ""))
    if product is None or product.op_type != "Mul" or len(users[product.output[0]]) != 1:
        return None
    a_scale = activation_scales.get(node.input[2])
    if a_scale not in product.input or not all(i in constants for i in product.input):
        return None
    b_scale = product.input[1] if product.input[0] == a_scale else product.input[0]
    inputs = [node.input[0], node.input[1], a_scale, b_scale, node.input[2], node.input[3]]
    output, absorbed = mul.output[0], [cast, mul, product]
    add = _only_user(output, users, "Add")
    width = constants[node.input[1]][-1]  # the weight is (K, N); a bias inside the product must be (N,)
    bias = add and next((i for i in add.input if i != output and constants.get(i) == (width,)), None)
    if bias:
        inputs.append(bias)
        output = add.output[0]
        absorbed.append(add)
    return inputs, output, absorbed


def _only_user(name: str, users, op_type: str):
    found = users.get(name, [])
    return found[0] if len(found) == 1 and found[0].op_type == op_type else None


def build_int8_static(fp32_path: Path, out: Path, calibration: list[np.ndarray]) -> Path:
    """Static int8 of the fused fp32 graph, activation ranges calibrated on `calibration` (batches of
    preprocessed images): uint8 activations x int8 per-channel weights; the classifier stays fp32."""
    import onnx

    from vitlab.engine.ort import build_int8_dynamic

    if not calibration:
        raise VitlabError("static int8 needs calibration images (--calibration DATA); or use --int8 dynamic")
    if not all(np.isfinite(batch).all() for batch in calibration):
        raise VitlabError("static int8: a calibration image has NaN or infinite values; check the images, "
                          "or use --int8 dynamic")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".static-int8-") as work:
        staged = build_int8_dynamic(fp32_path, Path(work) / "dynamic.onnx")
        proto = onnx.load(str(staged))
        ranges = activation_ranges(proto, Path(work), calibration)
    fuse_int_products(proto, fix_activation_scales(proto, ranges))
    onnx.save(proto, str(out))
    return out
