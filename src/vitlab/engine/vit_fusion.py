"""ONNX Runtime's transformer fusions of an exported ViT graph (Attention, FastGelu/BiasGelu, LayerNorm), in this
process or in one of its own. Imports no torch: the separate process starts in about 0.5 s.

ORT's optimizer (onnxruntime.transformers.optimizer) copies the whole graph, weights included, several times on the
way (its symbolic shape inference serializes and parses the graph, among others). Given the graph with its weights
in a file beside it and not loaded (`onnx.load(..., load_external_data=False)`), the same fusions read only the
weights they need (the attention's q, k and v, which become one) and write the same graph to the byte. The whole
`vitlab export --engine onnxruntime` of ViT-L/16 peaked at 5.3 GiB instead of 14.1 and took 39 s instead of 59
(`python benchmarks/build_memory.py`, docs/results/build_memory.txt). onnx reads such weights relative to the
working directory only, so that runs in a process of its own (`fuse_in_separate_process`), never in the user's,
where another thread's relative paths would point elsewhere meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

# The exporter writes a graph's weights into it below protobuf's 2 GB, as files beside it above. A graph file up to
# this size is read as it is (weights beside it, or in it and small); a larger one holds its weights and is written
# again with them beside it first (`_with_weights_beside`)
_GRAPH_ALONE_MAX_BYTES = 64 * 2**20


@contextlib.contextmanager
def _quiet_tools() -> Iterator[None]:
    """ORT's quantizer and optimizer talk through warnings and the root logger; users see vitlab's one line."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def fuse(raw: Path, out: Path, heads: int, dim: int, external: bool) -> None:
    """The fused graph of the exported ViT graph `raw`, written to `out` (`external`: its weights in `out.data`),
    with the whole graph in memory."""
    _write(_optimized(str(raw), heads, dim), out, external)


def fuse_reading_lazily(raw: Path, out: Path, heads: int, dim: int, external: bool) -> None:
    """`fuse` with the weights read where a fusion needs them (module docstring). Changes the working directory:
    for a process of its own (`fuse_in_separate_process`)."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    lazy = _with_weights_beside(raw.resolve())
    out = out.resolve()
    os.chdir(lazy.parent)
    fused = _optimized(onnx.load(str(lazy), load_external_data=False), heads, dim)
    load_external_data_for_model(fused.model, str(lazy.parent))  # the weights no fusion read, as they were
    for tensor in _tensors(fused.model.graph):  # as an in-memory tensor that never had a location: the same bytes
        tensor.ClearField("data_location")
    _write(fused, out, external)


def _optimized(graph, heads: int, dim: int):
    """ORT's transformer optimizer on `graph` (a path or a ModelProto), as both fusion paths run it."""
    from onnxruntime.transformers.optimizer import optimize_model

    with _quiet_tools():
        return optimize_model(graph, model_type="vit", num_heads=heads, hidden_size=dim, opt_level=0)


def _tensors(graph) -> Iterator:
    """The graph's initializers and the tensors of its nodes' attributes (Constant values)."""
    yield from graph.initializer
    for node in graph.node:
        yield from (attribute.t for attribute in node.attribute if attribute.HasField("t"))


def _write(fused, out: Path, external: bool) -> None:
    unfuse_skip_layernorm(fused.model)
    fused.save_model_to_file(str(out), use_external_data_format=external, all_tensors_to_one_file=True)


def _with_weights_beside(raw: Path) -> Path:
    """`raw` with its weights in a file beside it: as it is where the exporter put them there (over 2 GB) or where
    it is small, else written once more so (RAW.lazy.onnx and RAW.lazy.onnx.data, beside it)."""
    import onnx

    if raw.stat().st_size <= _GRAPH_ALONE_MAX_BYTES:
        return raw
    proto = onnx.load(str(raw))
    lazy = raw.with_name(raw.stem + ".lazy.onnx")
    onnx.save_model(proto, str(lazy), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=lazy.name + ".data", size_threshold=1024)
    return lazy


def fuse_in_separate_process(raw: Path, out: Path, heads: int, dim: int, external: bool) -> None:
    """`fuse_reading_lazily` in a new Python process (the same interpreter and vitlab); its failure is raised here
    as one line."""
    package_root = Path(__file__).resolve().parents[2]  # the folder that holds the vitlab package
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from vitlab.engine.vit_fusion import main; "
            "main(sys.argv[2:])")
    done = subprocess.run([sys.executable, "-c", code, str(package_root), str(raw), str(out), str(heads), str(dim),
                           "1" if external else "0"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode < 0:
        signal = -done.returncode
        raise RuntimeError(f"ONNX Runtime's graph optimizer was killed by signal {signal}"
                           + (" (out of memory?)" if signal == 9 else ""))
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RuntimeError(f"ONNX Runtime's graph optimizer failed: {last}")


def main(argv: list[str]) -> None:
    raw, out, heads, dim, external = argv
    fuse_reading_lazily(Path(raw), Path(out), int(heads), int(dim), external == "1")


def unfuse_skip_layernorm(proto) -> int:
    """SkipLayerNormalization -> Add (+ bias Add) + LayerNormalization, in place; returns how many.

    ORT's attention fusion only matches once the residual adds are fused into SkipLayerNormalization, but ORT's
    CPU kernel for that op is slow: 19 % of int8 ViT-S/16's time against 3 % for the plain LayerNormalization
    (batch 32, `benchmarks/ort_variants.py`). So the optimizer fuses, then the LayerNorms are put back as they were.
    """
    from onnx import helper

    graph, count = proto.graph, 0
    nodes = []
    for node in graph.node:
        if node.op_type != "SkipLayerNormalization":
            nodes.append(node)
            continue
        count += 1
        ins = list(node.input) + [""] * (5 - len(node.input))
        inp, skip, gamma, beta, bias = ins[:5]
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-12)
        total = node.output[3] if len(node.output) > 3 and node.output[3] else f"{node.name}_sum"
        if bias:
            nodes.append(helper.make_node("Add", [inp, bias], [f"{node.name}_biased"], name=f"{node.name}_bias"))
            inp = f"{node.name}_biased"
        nodes.append(helper.make_node("Add", [inp, skip], [total], name=f"{node.name}_add"))
        nodes.append(helper.make_node("LayerNormalization", [total, gamma] + ([beta] if beta else []),
                                      [node.output[0]], name=f"{node.name}_ln", axis=-1, epsilon=eps))
    del graph.node[:]
    graph.node.extend(nodes)
    return count
