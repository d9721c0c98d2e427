"""ONNX Runtime engines: the fp32 graph with the transformer fusions, and dynamic int8 (static int8, calibrated on
the user's images, builds on it: engine/static_int8.py). Facts behind the choices:
../shared/reference/fast-inference.md, sections 1-2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vitlab.engine.vit_fusion import _quiet_tools
from vitlab.errors import VitlabError


def require_onnxruntime():
    try:
        import onnx  # noqa: F401  (the fusions and quantizers read and write ONNX protos)
        import onnxruntime
    except ImportError as exc:
        raise VitlabError("this engine needs onnxruntime and onnx: pip install 'vitlab[onnx]'") from exc
    return onnxruntime


def make_session(path: str | Path, threads: int):
    """A CPU session with `threads` intra-op threads (the runtime's choice, not one per core). ORT's default
    spinning after a run is kept (it serves back-to-back calls); timing pauses between calls instead
    (`choose.PAUSE_S`), so the spinning never slows the next candidate."""
    ort = require_onnxruntime()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3  # ORT's own warnings (e.g. about optimized-graph portability) are not for users
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


# A call with up to this much arithmetic (forward FLOPs of all its images) runs in a session of one thread. Its
# operators are small, and a second thread costs more in hand-overs than it saves. On the 2-core Intel VM of
# docs/benchmarks.md, in four runs of `python benchmarks/ort_threads.py` (docs/results/ort_threads_intel.txt), the
# Fashion-MNIST ViT's fused graph at batch 1 (24 MFLOP) ran 1.17-1.88x faster on one thread back to back (0.85-1.10x
# after a 50 ms pause); at batch 2 (47 MFLOP) one thread was level back to back (0.90-1.15x) and 1.02-1.14x after the
# pause; at batch 4 (94 MFLOP) 0.76-0.78x back to back, at ViT-Ti/16 batch 1 (2.5 GFLOP) 0.63-0.65x. The int8 graphs
# alike, and the logits the same to the bit. So the bound is the torch engine's (models/threads.ONE_THREAD_MAX_FLOPS),
# measured apart. By shape alone, as every route choice here.
ONE_THREAD_MAX_FLOPS = 64e6


def flops_per_image(model: nn.Module, image_size: tuple[int, int]) -> float | None:
    """A ViT's forward FLOPs for one image of this size (registry.forward_flops, as the torch engine counts them);
    None for other models, whose engines keep all their threads."""
    if not is_vit(model):
        return None
    from vitlab.models.registry import forward_flops

    return forward_flops(model.config, image_size)


class OrtEngine:
    """An ONNX file run by ONNX Runtime; takes and returns torch tensors like the other engines. Given the model's
    `flops_per_image`, a call with little arithmetic runs in a second session of one thread (ONE_THREAD_MAX_FLOPS),
    opened with the engine where one image is such a call (a server's first request would otherwise wait for it)."""

    exact = True
    runs_model = False  # the session holds its own copy of the weights (engine.release)

    def __init__(self, path: str | Path, threads: int, name: str = "onnxruntime", exact: bool = True,
                 flops_per_image: float | None = None):
        self.path, self.name, self.exact = Path(path), name, exact
        self.threads, self.flops_per_image = threads, flops_per_image
        self.session = make_session(self.path, threads)
        self.one_thread_session = make_session(self.path, 1) if self.small(1) else None
        self.input_name = self.session.get_inputs()[0].name

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = np.ascontiguousarray(images.detach().cpu().float().numpy())
        return torch.from_numpy(self.session_for(x.shape[0]).run(None, {self.input_name: x})[0])

    def small(self, images: int) -> bool:
        """Whether a call of `images` images runs on one thread (ONE_THREAD_MAX_FLOPS)."""
        return (self.flops_per_image is not None and self.threads != 1
                and images * self.flops_per_image <= ONE_THREAD_MAX_FLOPS)

    def session_for(self, images: int):
        """The session a call of `images` images runs in."""
        if not self.small(images):
            return self.session
        if self.one_thread_session is None:  # not small at one image when opened (a changed bound): opened now
            self.one_thread_session = make_session(self.path, 1)
        return self.one_thread_session


def is_vit(model: nn.Module) -> bool:
    from vitlab.models.vit import VisionTransformer

    return isinstance(model, VisionTransformer)


def build_fp32(model: nn.Module, folder: Path, image_size: tuple[int, int]) -> Path:
    """`folder/fp32.onnx`: the model exported in the fusable form, then fused by ORT's transformer optimizer
    (Attention, SkipLayerNormalization, FastGelu/BiasGelu) for a ViT; exported as it is otherwise (`build_graph`)."""
    require_onnxruntime()
    from vitlab.engine.onnx_graph import export_fusable

    return build_graph(model, folder / "fp32.onnx", lambda work: export_fusable(model, work / "raw.onnx", image_size))


def build_graph(model: nn.Module, out: Path, export: Callable[[Path], Path]) -> Path:
    """The graph at `out` from `export(work)`, which writes the raw graph into a private folder (over 2 GB torch
    writes one file per weight beside it): ORT's fusions for a ViT, as exported otherwise. A model over protobuf's
    2 GB (ViT-H) keeps its weights in OUT.data beside it (`graph_files`); a build short of memory is refused first."""
    from vitlab.runtime import return_freed_memory

    refuse_without_build_memory(model)
    with private_folder(out.parent) as work:
        raw = export(work)
        # the exporter's copies of the weights are garbage now; vitlab's heap would keep them (tune_cpu_allocator)
        # through the fusion, whose own process needs that memory (ViT-L/16: 1.6 GiB)
        return_freed_memory()
        external = over_protobuf_limit(model)  # as `graph_files` expects the files
        if is_vit(model):
            return optimize_vit_graph(raw, out, model.config, external=external,
                                      separate=weight_bytes(model) >= SEPARATE_FUSION_MIN_BYTES)
        return resave(raw, out, external)


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


# What building the fused graph takes at its peak beyond the model already loaded, the command's process and the
# fusion's together (`python benchmarks/build_memory.py`, docs/results/build_memory.txt: the whole `vitlab export
# --engine onnxruntime`, at most 3.7x the weights beyond the loaded model at ViT-L/16 and 2.2x at ViT-H/14, where
# it was 8.5x at ViT-H/14 while ORT's optimizer ran in the command's process with all the weights loaded). A build
# that ran out of memory was killed by the OS without a word, so one short of this is refused in one line (a
# machine right at the edge can still run out).
BUILD_MEMORY_FACTOR = 4
BUILD_MEMORY_BASE = 2**30  # the fusion's own process: Python, onnx and ONNX Runtime's libraries


def build_memory_need(model: nn.Module) -> int:
    """Bytes of free memory a build of ONNX Runtime's graph of `model` needs (BUILD_MEMORY_FACTOR)."""
    return BUILD_MEMORY_FACTOR * weight_bytes(model) + BUILD_MEMORY_BASE


def refuse_without_build_memory(model: nn.Module) -> None:
    """Refuse to build ONNX Runtime's graph where the free memory (Linux's MemAvailable) is short of what the build
    takes at its peak (`build_memory_need`): under `--engine auto` the candidate is left out with this reason, and
    eager PyTorch runs."""
    from vitlab.models.fast_linear import available_memory_bytes

    need, free = build_memory_need(model), available_memory_bytes()
    if free is not None and need > free:
        raise VitlabError(f"building ONNX Runtime's graph of this model takes about {need / 2**30:.0f} GiB of memory "
                          f"at its peak and {free / 2**30:.0f} GiB are free: use --engine torch (or openvino), or free "
                          "memory")


def over_protobuf_limit(model: nn.Module) -> bool:
    """Whether the model's fp32 graph is too large for one protobuf file (2 GB: ViT-H, BiT-R152x4), so that its
    weights go to a file of their own beside it."""
    from vitlab.export import fits_one_protobuf

    return not fits_one_protobuf(weight_bytes(model))


def graph_files(path: Path, model: nn.Module) -> list[Path]:
    """The files of the fp32 graph at `path`: the graph, and for a model over 2 GB its weights file
    (`export.external_data_path`), which is checked and rebuilt with it (`engine/trusted.py`)."""
    from vitlab.export import external_data_path

    return [path, external_data_path(path)] if over_protobuf_limit(model) else [path]


@contextlib.contextmanager
def private_folder(folder: Path) -> Iterator[Path]:
    """A temporary folder inside `folder`, removed afterwards with whatever the build left in it. Builds run under
    the folder's lock (`choose.kept_or_built`), so another one found there is a killed build's (gigabytes of
    per-weight files for ViT-H): removed first."""
    import shutil
    import tempfile

    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".build-*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(dir=folder, prefix=".build-"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def resave(raw: Path, out: Path, external: bool) -> Path:
    """`raw` as the graph at `out`: moved, or with `external` (a model over 2 GB) written again with its weights in
    one file beside `out` (torch's exporter leaves one file per weight beside `raw`)."""
    import onnx

    from vitlab.export import external_data_path, save_graph

    if not external:
        raw.replace(out)
        external_data_path(out).unlink(missing_ok=True)
        return out
    return save_graph(onnx.load(str(raw)), out, external=True)


def refuse_int8_over_protobuf_limit(model: nn.Module) -> None:
    """The int8 graphs are one protobuf file (ORT's quantizers write them so): at about a quarter of the fp32
    weights, every model of the paper fits (ViT-H/14: 0.6 GB); a model whose int8 weights would not is refused in
    one line before anything is built."""
    from vitlab.export import fits_one_protobuf

    size = weight_bytes(model)
    if not fits_one_protobuf(size // 4):
        raise VitlabError(f"ONNX Runtime's int8 graphs are one ONNX file of at most 2 GB, and this model's int8 "
                          f"weights would take about {size / 4 / 2**30:.1f} GiB: drop --int8, or use --engine "
                          "openvino")


# From this size of weights ORT's transformer optimizer runs in a process of its own that reads the weights only
# where a fusion needs them (`vit_fusion.fuse_reading_lazily`): in this process it held several copies of them at
# once, and the graph it writes is the same to the byte. `vitlab export --engine onnxruntime` peaked at 1.8 GiB
# instead of 4.2 at ViT-B/16 and 5.3 instead of 14.1 at ViT-L/16 (`python benchmarks/build_memory.py`,
# docs/results/build_memory.txt). Below it the optimizer's copies are small and a process's start (about 0.5 s
# with its imports) is not worth it.
SEPARATE_FUSION_MIN_BYTES = 128 * 2**20


def optimize_vit_graph(raw: Path, out: Path, cfg, external: bool = False, separate: bool = False) -> Path:
    """ORT's transformer optimizer on an exported ViT graph (Attention, FastGelu/BiasGelu, LayerNorm fusions), then
    SkipLayerNormalization put back (`vit_fusion.unfuse_skip_layernorm`); writes `out` (`external`: its weights in
    `out.data`, for a graph over 2 GB) and removes `raw`. `separate`: in a process of its own that reads the
    weights lazily (SEPARATE_FUSION_MIN_BYTES), else here."""
    from vitlab.engine import vit_fusion

    if separate:
        vit_fusion.fuse_in_separate_process(raw, out, cfg.heads, cfg.dim, external)
    else:
        vit_fusion.fuse(raw, out, cfg.heads, cfg.dim, external)
    if external:
        from vitlab.export import readable_as_graph

        readable_as_graph(out)
    raw.unlink()
    return out


def fused_operator_counts(path: str | Path) -> dict[str, int]:
    """How many nodes of each fused kind a graph has (what the optimizer managed to fuse)."""
    import onnx

    kinds = ("Attention", "QAttention", "SkipLayerNormalization", "FastGelu", "BiasGelu", "Gelu", "LayerNormalization",
             "MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul", "ConvInteger")
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type in kinds:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _head_nodes(path: Path) -> list[str]:
    """The classifier's MatMul/Gemm (the last one in the graph): kept in fp32, where one layer's rounding
    goes straight into the logits and costs almost nothing to avoid."""
    import onnx

    nodes = onnx.load(str(path), load_external_data=False).graph.node
    heads = [n for n in nodes if n.op_type in ("MatMul", "Gemm")][-1:]
    # ORT's quantizers first rewrite a Gemm into MatMul + Add under the name NAME_MatMul, and exclude by the
    # names they see then: without that name the classifier was quantized after all (until 2026-11-25)
    return [name for n in heads for name in ([n.name, f"{n.name}_MatMul"] if n.op_type == "Gemm" else [n.name])]


# The patch embedding stays fp32: ORT's ConvInteger took 9.5 % of int8 ViT-S/16's time for 1 % of its FLOPs, and
# quantizing it made the whole model 7 % slower (batch 32, 2 threads; benchmarks/ort_variants.py).
INT8_OPS = ["MatMul", "Attention"]


def split_gelu_bias(proto) -> int:
    """FastGelu(h, bias) -> FastGelu(h + bias), in place; returns how many.

    In fp32 the optimizer's BiasGelu fusion saves a pass, but an int8 MatMul carries its bias in the same kernel
    (ORT fuses MatMulInteger + scale + bias Add into DynamicQuantizeMatMul), while FastGelu's own bias add is a
    separate slow loop: split out, the bias rides with fc1's int8 product (benchmarks/ort_variants.py)."""
    from onnx import helper

    count, nodes = 0, []
    for node in proto.graph.node:
        if node.op_type != "FastGelu" or len(node.input) < 2 or not node.input[1]:
            nodes.append(node)
            continue
        count += 1
        biased = f"{node.name}_biased"
        nodes.append(helper.make_node("Add", [node.input[0], node.input[1]], [biased], name=f"{node.name}_bias"))
        nodes.append(helper.make_node("FastGelu", [biased], list(node.output), name=node.name, domain="com.microsoft"))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return count


def _int8_source(fp32_path: Path, out: Path) -> Path:
    """The fp32 graph as the int8 quantizers should see it (`split_gelu_bias`), beside `out`."""
    import onnx

    from vitlab.export import save_graph

    proto = onnx.load(str(fp32_path))
    split_gelu_bias(proto)
    # beside `out` (the quantizer writes there); over 2 GB with its weights in SOURCE.data (`save_graph`)
    return save_graph(proto, out.with_name(out.stem + ".src.onnx"))


def build_int8_dynamic(fp32_path: Path, out: Path) -> Path:
    """Weights int8 offline, activations quantized per call; fused Attention becomes QAttention."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from vitlab.export import external_data_path

    source = _int8_source(fp32_path, out)
    with _quiet_tools():
        # per-channel weight scales: the same speed within noise (benchmarks/ort_variants.py: ViT-S/16 49.7 vs 49.99,
        # B/16 16.3 vs 16.5 images/s per-channel vs per-tensor), a scale per output channel for accuracy
        quantize_dynamic(str(source), str(out), weight_type=QuantType.QInt8, op_types_to_quantize=INT8_OPS,
                         per_channel=True, nodes_to_exclude=_head_nodes(source),
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    source.unlink()
    external_data_path(source).unlink(missing_ok=True)
    return out
