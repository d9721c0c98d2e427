"""Export a model to ONNX for fast inference elsewhere, and check the file against PyTorch."""

from __future__ import annotations

import json
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
    import shutil
    import tempfile

    from vitlab.engine.onnx_graph import trace_to_onnx

    cfg = model.config
    h, w = image_size or cfg.image_size
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Over protobuf's 2 GB (ViT-H, BiT-R152x4) torch writes every weight as its own file beside the graph, which
    # then could not be loaded and saved again with the metadata. So the trace goes to a private folder, and one
    # graph (with its weights in OUT.onnx.data when too large for one file) is written from it.
    work = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        traced = trace_to_onnx(model, torch.zeros(1, cfg.in_chans, h, w), work / "graph.onnx", opset=opset,
                               dynamic_batch=dynamic_batch)
        import onnx  # after the trace, which says in one line when it is not installed

        proto = onnx.load(str(traced))
        if metadata:
            _set_metadata(proto, metadata)
        save_graph(proto, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def _graph_bytes(proto) -> int:
    """About what one serialized file of `proto` takes: its weights and nodes (the rest is a few bytes). Summed part
    by part, a weight by the length of its bytes: protobuf cannot measure a message over 2 GB (ByteSize raises
    EncodeError), and one weight can be that large (a 1M-class head)."""
    graph = proto.graph
    return sum(len(t.raw_data) or t.ByteSize() for t in graph.initializer) + sum(n.ByteSize() for n in graph.node)


def fits_one_protobuf(nbytes: int) -> bool:
    """Whether a graph of about `nbytes` (its weights and nodes) can be one ONNX file: protobuf's 2 GB limit, less
    1 MiB for everything else the file holds."""
    import onnx

    return nbytes + (1 << 20) <= onnx.checker.MAXIMUM_PROTOBUF


def external_data_path(path: Path) -> Path:
    """Where the weights of a graph too large for one protobuf file go: OUT.onnx.data beside OUT.onnx."""
    return path.with_name(path.name + ".data")


def save_graph(proto, path: str | Path, external: bool | None = None) -> Path:
    """Write `proto` to `path`: one file, or over protobuf's 2 GB limit (or with `external`) the graph in `path` and
    every weight in `external_data_path(path)` (ONNX's external data, which ONNX Runtime reads from beside the
    graph)."""
    import onnx

    path = Path(path)
    data = external_data_path(path)
    data.unlink(missing_ok=True)  # onnx appends to an existing data file: an earlier export's would be kept
    one_file = fits_one_protobuf(_graph_bytes(proto)) if external is None else not external
    if one_file:
        onnx.save(proto, str(path))
    else:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
        readable_as_graph(path)
    return path


def readable_as_graph(path: Path) -> None:
    """Give the weights file beside the graph at `path` the graph's permissions: onnx creates it readable by its
    owner alone, so a graph shared with others came without its weights."""
    data = external_data_path(path)
    if data.exists():
        data.chmod(path.stat().st_mode & 0o777)


def check_onnx(model: nn.Module, path: str | Path, batch: int = 2, seed: int = 0) -> float:
    """Max absolute difference between ONNX Runtime's and PyTorch's logits on random input."""
    return onnx_difference(model, path, batch, seed)[0]


def matches_pytorch(difference: float, scale: float) -> bool:
    """Whether an export's logits are PyTorch's up to fp32 summation order (the engines' rule, `exact_enough`)."""
    from vitlab.engine.choose import exact_enough

    return exact_enough(difference, scale)


def onnx_difference(model: nn.Module, path: str | Path, batch: int = 2, seed: int = 0) -> tuple[float, float]:
    """(max absolute difference between ONNX Runtime's and PyTorch's logits, the largest PyTorch logit) on random
    input."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise VitlabError("checking an ONNX file needs onnxruntime: pip install onnxruntime") from exc
    cfg = model.config
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()  # the runtime's choice (runtime.py), not one per core
    sess = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    shape = sess.get_inputs()[0].shape
    batch = shape[0] if isinstance(shape[0], int) else batch  # a --static-batch graph takes its own batch only
    h = shape[2] if isinstance(shape[2], int) else cfg.image_size[0]
    w = shape[3] if isinstance(shape[3], int) else cfg.image_size[1]
    x = torch.randn(batch, cfg.in_chans, h, w, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model.eval()(x).numpy()
    out = sess.run(["logits"], {"images": x.numpy()})[0]
    return float(np.abs(out - ref).max()), float(np.abs(ref).max())


def _set_metadata(proto, metadata: dict) -> None:
    entry = proto.metadata_props.add()
    entry.key, entry.value = "vitlab", json.dumps(metadata)


PORTABLE = "portable ONNX (standard operators)"
FUSED = "onnxruntime fp32 (fused)"


def check_export_engine(engine: str, path: str | Path | None = None) -> None:
    """The engines export can write a file for; refused in one line (the command calls this before loading)."""
    from vitlab.engine import ENGINES

    if engine not in ENGINES:
        raise VitlabError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "compiled":
        raise VitlabError("--engine compiled is torch.compile at run time, not a file; export writes ONNX: "
                          "use --engine onnxruntime (fused for ORT), torch (portable), openvino or auto")
    if path is not None and Path(path).suffix.lower() in (".pt", ".pth", ".bin", ".safetensors", ".npz", ".ckpt"):
        raise VitlabError(f"export writes an ONNX model (OpenVINO's .xml with --engine openvino), and "
                          f"{Path(path).name} names a weights file: call it OUT.onnx, or write weights in another "
                          "format with `vitlab convert`")
    if engine == "openvino" and path is not None and Path(path).suffix != ".xml":
        raise VitlabError(f"--engine openvino writes an OpenVINO model: name it OUT.xml (its weights go to OUT.bin "
                          f"beside it), not {Path(path).name}")
    if engine != "openvino" and path is not None and Path(path).suffix.lower() != ".onnx":
        # `vitlab export MODEL out/` wrote a file named `out`: a folder meant, or a name no tool takes for ONNX
        if Path(path).suffix.lower() == ".xml":  # an OpenVINO name without the engine that writes it
            raise VitlabError(f"{Path(path).name} names an OpenVINO model: add --engine openvino, or name it OUT.onnx "
                              "for ONNX")
        raise VitlabError(f"export writes one ONNX model file: name it OUT.onnx, not {Path(path).name or path}"
                          + (" (a folder)" if str(path).endswith(("/", "\\")) or Path(path).is_dir() else ""))


def _copy_openvino(built, path: Path, metadata: dict | None) -> tuple[Path, str]:
    """The OpenVINO model an engine runs, as `path` (.xml) and its .bin, with vitlab's metadata in its rt_info."""
    import openvino as ov

    from vitlab.engine.openvino import core

    kind = "openvino int8 static" if built.name.startswith("openvino-int8") else "openvino fp32"
    if built.name.endswith("-bf16"):  # a run-time setting, not part of the file: said, and kept in the metadata
        kind += " (timed fastest with INFERENCE_PRECISION_HINT bf16)"
    model = core().read_model(str(built.path))
    if metadata:
        model.set_rt_info(json.dumps({**metadata, "engine": kind}), ["vitlab"])
    ov.save_model(model, str(path), compress_to_fp16=False)
    return path, kind


def _copy_built(built: Path, path: Path, metadata: dict | None, kind: str) -> tuple[Path, str]:
    """The graph an engine runs, as `path`, with vitlab's metadata: written anew from the built graph (a graph over
    2 GB names its weights file, `external_data_path`, so its weights go to PATH.data), or copied as it is where
    there is neither metadata to add nor a weights file."""
    import shutil

    data = external_data_path(built)
    if not data.exists():
        shutil.copyfile(built, path)
        external_data_path(path).unlink(missing_ok=True)  # an earlier export's weights file, which this one is not
        if metadata:
            _append_metadata(path, {**metadata, "engine": kind})
        return path, kind
    import onnx

    # the graph alone (its weights stay in their file, which is copied beside `path` under the name it gets there)
    proto = onnx.load(str(built), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = external_data_path(path).name
    if metadata:
        _set_metadata(proto, {**metadata, "engine": kind})
    onnx.save(proto, str(path))
    shutil.copyfile(data, external_data_path(path))
    readable_as_graph(path)
    return path, kind


def _append_metadata(path: Path, metadata: dict) -> None:
    """Add vitlab's metadata to the ONNX file at `path` without reading it: a protobuf message written after
    another in one file reads as the two merged, its repeated fields appended (protobuf's encoding rules), so the
    file gains one metadata entry. Loading and saving the graph instead held its weights twice (1.1 GiB each at
    ViT-L/16). The engines' built graphs carry no metadata of their own to clash with."""
    import onnx

    extra = onnx.ModelProto()
    _set_metadata(extra, metadata)
    with open(path, "ab") as f:
        f.write(extra.SerializeToString())


def export_for_engine(
    model: nn.Module,
    path: str | Path,
    engine: str = "torch",
    *,
    int8: str | None = None,
    calibration: list | None = None,
    source: str | Path | None = None,
    metadata: dict | None = None,
    quiet: bool = False,
) -> tuple[Path, str]:
    """Write the ONNX file (or for "openvino" the OpenVINO model, .xml and .bin) an engine runs; returns (path, what
    was written).

    engine "torch": the portable graph (standard ONNX operators, any runtime; `export_onnx`).
    "onnxruntime": the fp32 graph with ORT's transformer fusions (contrib operators: ONNX Runtime only).
    "auto": whichever of the two ONNX Runtime runs faster on this machine (timed). `int8` (auto|static|dynamic):
    the quantized graph `--int8` runs, static calibrated on `calibration` (ORT's, or OpenVINO's with engine
    "openvino"). "openvino": the model OpenVINO runs, fp32 or int8. The built files are kept beside the
    model like every engine's (`vitlab.engine.choose.artefact_folder`).
    """
    from vitlab.engine.choose import prepare_engine

    check_export_engine(engine, path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if engine == "openvino":
        built = prepare_engine(model, "openvino", int8=int8, calibration=calibration, source=source,
                               command="export", quiet=quiet, sub_batches=False)
        return _copy_openvino(built, path, metadata)
    if int8 is not None:
        built = prepare_engine(model, "onnxruntime", int8=int8, calibration=calibration, source=source,
                               command="export", quiet=quiet, sub_batches=False)  # a file is written, not run
        return _copy_built(built.path, path, metadata, built.name)
    if engine == "torch":
        return export_onnx(model, path, metadata=metadata), PORTABLE
    built = prepare_engine(model, "onnxruntime", source=source, command="export", quiet=True)
    if engine == "onnxruntime":
        return _copy_built(built.path, path, metadata, FUSED)
    return _faster_of_fused_and_portable(model, built, path, metadata)


def _faster_of_fused_and_portable(model: nn.Module, built, path: Path, metadata: dict | None) -> tuple[Path, str]:
    """export --engine auto: the fused graph (`built`, checked against PyTorch when it was built) or the portable
    one, whichever ONNX Runtime runs faster here. The portable graph is written in a private folder (it went to
    OUT.portable.onnx beside the output, overwriting and then deleting a user's file of that name) and checked
    against PyTorch as `--engine torch` checks it before it may be kept (it was kept unchecked)."""
    import shutil
    import tempfile

    from vitlab.engine.choose import interleaved_speeds
    from vitlab.engine.ort import OrtEngine
    from vitlab.runtime import timing_input

    work = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        portable = export_onnx(model, work / path.name, metadata=metadata)
        problem = _portable_problem(model, portable)
        if problem:
            return _copy_built(built.path, path, metadata, f"{FUSED} (auto: the portable graph {problem}, not kept)")
        x = timing_input(8, model.config.in_chans, *model.config.image_size)
        # the portable graph runs as the fused one does (small calls on one thread where they qualify)
        twin = OrtEngine(portable, torch.get_num_threads(), flops_per_image=built.flops_per_image)
        speeds = interleaved_speeds({FUSED: built, PORTABLE: twin}, x)
        timing = f" (auto: ONNX Runtime fused {speeds[FUSED]:.1f} vs portable {speeds[PORTABLE]:.1f} images/s)"
        if speeds[PORTABLE] < speeds[FUSED]:
            return _copy_built(built.path, path, metadata, FUSED + timing)
        data = external_data_path(portable)  # the graph names it by this file name: it moves beside the output
        external_data_path(path).unlink(missing_ok=True)
        if data.exists():
            data.replace(external_data_path(path))
        portable.replace(path)
        return path, PORTABLE + timing
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _portable_problem(model: nn.Module, portable: Path) -> str | None:
    """Why the portable graph may not be kept (it does not run in ONNX Runtime, or gives other logits than
    PyTorch), or None."""
    try:
        diff, scale = onnx_difference(model, portable)
    except Exception as exc:  # any failure to run it: it is not kept
        return f"did not run in ONNX Runtime ({type(exc).__name__})"
    if not matches_pytorch(diff, scale):
        return f"differed from PyTorch by {diff:.2e} (largest logit {scale:.3g})"
    return None
