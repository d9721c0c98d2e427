"""Weights in and out: one `load(...)` that detects the format and returns a ready model.

Formats in: official Google `.npz` (ViT, hybrids, big_vision layout), timm state dicts, Hugging Face
folders, torchvision state dicts, the native vitlab folder. Formats out: native, Hugging Face, timm.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitlab.errors import VitlabError
from vitlab.weights import peer_names

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

# torch is imported where a model is built, so that `vitlab.weights.pretrained` / `vitlab models --pretrained`
# (and the resolution of names) start without it.
__all__ = [
    "adapt", "detect_format", "load", "load_state_dict_strict", "load_with_meta", "read_checkpoint",
    "resolve_model", "resolve_weights", "save_native", "save_hf", "save_timm",
]


def __getattr__(name: str) -> Any:
    if name in ("save_native", "default_preprocess"):
        from vitlab.weights import native

        return getattr(native, name)
    raise AttributeError(f"module 'vitlab.weights' has no attribute {name!r}")


def _first(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" ... ({len(items)} in all)" if len(items) > n else "")


def load_state_dict_strict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str = "checkpoint",
                           assign: bool = False) -> None:
    """Load with one clear error naming the first missing/unexpected keys and shape mismatches, and
    refusing integer tensors for float parameters and NaN/inf weights (such a model only prints nan).

    `assign`: for a model from `registry.build_unfilled` (on the meta device), whose tensors are replaced by
    copies of the file's in the model's dtypes, instead of copied into."""
    import torch

    from vitlab.weights.limits import shape_problems

    expected = model.state_dict()
    problems = shape_problems({k: tuple(v.shape) for k, v in expected.items()},
                              {k: tuple(v.shape) for k, v in state_dict.items()})
    if problems:
        raise VitlabError(f"{source} does not fit the model: " + "; ".join(problems))
    for k, want in expected.items():  # a cheap dtype pass first, then the value pass
        found = state_dict[k]
        if want.is_floating_point() and not found.is_floating_point():
            raise VitlabError(f"{source}: tensor {k!r} is {found.dtype}, not floating point like the model's parameter "
                              "(integer weights load as rounded values and give constant outputs); export the weights "
                              "as floats")
    held_dict = {}
    for k, want in expected.items():
        found = state_dict[k]
        # checked as the model will hold it: load_state_dict casts, and a float64 value beyond float32's range
        # (1e300) would become inf there without a word. With `assign` the model holds copies, so that no
        # parameter shares memory with the reader's (a memory-mapped file, a transposed array a converter made) or
        # with another parameter, and each is contiguous as a model's own would be.
        if assign:  # on torch's default device, where the model would have been built (set_default_device)
            device = want.device if not want.is_meta else torch.get_default_device()
            held = found.detach().to(device=device, dtype=want.dtype, memory_format=torch.contiguous_format,
                                     copy=True)
            held_dict[k] = held
        else:
            held = found if found.dtype == want.dtype else found.to(want.dtype)
        if want.is_floating_point() and not all_finite(held):
            beyond = all_finite(found)
            raise VitlabError(f"{source}: tensor {k!r} holds "
                              + (f"values beyond the range of {str(want.dtype).replace('torch.', '')} (they would "
                                 "load as infinite)" if beyond else "NaN or infinite values")
                              + " (the first such tensor); the checkpoint is damaged or was saved after training "
                              "diverged: use an earlier checkpoint")
    model.load_state_dict(held_dict if assign else state_dict, strict=True, assign=assign)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in `t`. A finite sum proves it (an infinity or NaN anywhere makes the sum one) and reads
    the tensor once without writing a mask as large as it, as `isfinite(t).all()` does. A sum that overflows on
    finite values falls back to the exact test."""
    import torch

    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def detect_format(path: str | Path) -> str:
    """'native', 'hf', 'timm_folder', 'official', or 'state_dict' (timm / torchvision / HF keys, told apart by the keys)."""
    from vitlab.weights import hf, native, timm
    from vitlab.weights.io import STATE_DICT_SUFFIXES

    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():  # a config that does not parse is said as such, not as "no known folder"
            from vitlab.weights.io import read_json

            read_json(p / "config.json", "config.json")
        if native.is_native(p):
            return "native"
        if hf.is_hf_folder(p):
            return "hf"
        if timm.is_timm_folder(p):
            return "timm_folder"
        raise VitlabError(
            f"{p} is a folder but not a vitlab folder (config.json with format 'vitlab'), a Hugging Face "
            "folder (config.json with model_type 'vit' or 'resnet' + model.safetensors or pytorch_model.bin) or a timm Hub "
            "folder (config.json with 'architecture' + model.safetensors)"
        )
    if not p.exists():
        raise VitlabError(f"no such file or folder: {p}")
    from vitlab.weights.io import is_npz, not_regular_file, sniff_format

    if not p.is_file():  # a FIFO blocks the first open forever; /dev/zero is read by zipfile until memory runs out
        raise not_regular_file(p)

    # read by what the file is, not its name: an .npz named .pth is read as one, a state dict named .npz too
    if is_npz(p) or (p.suffix == ".npz" and sniff_format(p) == "unknown"):
        if not is_npz(p):
            raise VitlabError(f"{p} is not an .npz (a zip of numpy arrays) nor any other weights file vitlab "
                              "knows: it is damaged or not weights; re-download it")
        from vitlab.weights import big_transfer

        return "big_transfer" if big_transfer.is_big_transfer_file(p) else "official"
    if p.suffix == ".npz":  # a safetensors or torch file named .npz
        import zipfile

        try:
            zipfile.ZipFile(p).close()
        except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError) as exc:
            with open(p, "rb") as fh:
                cut_off_zip = fh.read(2) == b"PK"  # a cut-off .npz: not a torch file to report as one
            if cut_off_zip:
                raise VitlabError(f"{p} is a damaged zip archive ({type(exc).__name__}: {exc}); is the file "
                                  "complete? re-download it") from exc
        return "state_dict"
    if p.name == "config.json" and (native.is_native(p.parent) or hf.is_hf_folder(p.parent)):
        return "native" if native.is_native(p.parent) else "hf"
    if p.suffix in STATE_DICT_SUFFIXES:
        # A weights file inside a native or Hugging Face folder: load the whole folder.
        if native.is_native(p.parent):
            return "native"
        if hf.is_hf_folder(p.parent):
            return "hf"
        if timm.is_timm_folder(p.parent):
            return "timm_folder"
        return "state_dict"
    if p.suffix.lower() in (".onnx", ".xml"):
        raise VitlabError(f"{p} is an exported model (ONNX / OpenVINO): vitlab writes such files but does not load "
                          "them as weights; pass the weights it was exported from (with --engine onnxruntime or "
                          "openvino to run them in that runtime), or run the file in the runtime itself "
                          "(docs/serving.md, \"Exported files\")")
    from vitlab.data.images import is_image_file

    if is_image_file(p):
        raise VitlabError(f"{p} is an image, not weights: expected a weights file, model folder or run folder")
    raise VitlabError(
        f"unknown checkpoint format: {p} (expected an official .npz, a .safetensors/.pth/.bin state dict, "
        "a Hugging Face folder or a vitlab folder)"
    )


def run_model_folder(path: str | Path) -> str | Path:
    """A training run folder stands for the model it saved (`RUN/model`); anything else is returned as is.
    A run folder without `model/` (unfinished, or `save_model: false`) fails in one line saying what to do."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / "config.json").is_file():
        return path
    if (p / "model" / "config.json").is_file():
        return p / "model"
    if (p / "config.yaml").is_file() and ((p / "checkpoints").is_dir() or (p / "metrics.jsonl").is_file()):
        ckpts = sorted((p / "checkpoints").glob("*.pt")) if (p / "checkpoints").is_dir() else []
        last = f" (its last checkpoint: {ckpts[-1].name})" if ckpts else ""
        raise VitlabError(f"run folder {p} has no model/ yet{last}: the run did not finish or was started with "
                          f"save_model false; finish it with `vitlab train --resume {p}`, then pass {p} (or {p}/model)")
    return path


def _registry_name(spec: str) -> str | None:
    """The registry name `spec` builds (overrides as in `custom(dim=32)` allowed), or None."""
    from vitlab.models.registry import get_config

    name = spec.partition("(")[0].strip()
    if not name:
        return None
    try:
        get_config(name)
    except VitlabError:
        return None
    return name


def resolve_model(spec: str | Path) -> Path | None:
    """The one rule every command uses for what a user names as a model. In order: an existing weights file,
    model folder or run folder (-> RUN/model); a pretrained name (`vit-b/16.augreg-in21k-ft-in1k-224`),
    `hf:ORG/NAME`, an official bucket name or URL (downloaded into the cache); None for a registry name
    (`vit-b/16`, `custom(dim=32)`: random initialisation). Anything else fails in one line."""
    from vitlab.weights import hub

    text = str(spec)
    if not text.strip():
        raise VitlabError("no model given; pass a weights file or folder, a run folder, a pretrained name "
                          "(`vitlab models --pretrained`) or a model name (`vitlab models`)")
    p = Path(text).expanduser()
    if p.exists():
        return Path(run_model_folder(p))
    resolved = hub.resolve(text)
    if str(resolved) != text:
        return Path(run_model_folder(resolved))
    if _registry_name(text) is not None:
        return None
    raise VitlabError(_not_found(text))


def _not_found(text: str) -> str:
    from vitlab.weights.pretrained import names

    hint = ""
    parent = Path(text).expanduser().parent
    if parent.name == "model" and (parent.parent / "config.yaml").is_file():
        hint = f"; {parent.parent} is a run folder: pass it itself"
    model = text.partition(".")[0]
    if "." in text and (tags := names(model.lower())):
        hint = f"; {model} has these checkpoints: {', '.join(tags[:4])}{' ...' if len(tags) > 4 else ''}"
    elif close := _close_model_name(text):  # vit-b/61: a typo of a model name, before the Hub guess below
        hint = f"; did you mean {close}?"
    elif peer_names.looks_like_hf_repo(text):  # ORG/NAME starts with a letter or digit: ./x, /x, ~/x never do
        hint = f"; if you meant the Hugging Face Hub repo, write hf:{text.strip()}"
    return (f"no such file or folder: {text} (it does not exist: no weights file, model folder or run folder "
            f"there, and it is not a pretrained checkpoint or model name{hint}); check the path, or see "
            "`vitlab models --pretrained` / `vitlab models`")


def _close_model_name(text: str) -> str | None:
    """The registry or pretrained name `text` most likely misspells, if one is close."""
    import difflib

    from vitlab.models.registry import model_names
    from vitlab.weights.pretrained import PRETRAINED

    close = difflib.get_close_matches(text.strip().lower(), [*model_names(), *PRETRAINED], n=1, cutoff=0.8)
    return close[0] if close else None


def resolve_weights(spec: str | Path) -> Path:
    """Like `resolve_model`, for callers that need weights: a bare registry name fails with its checkpoints."""
    path = resolve_model(spec)
    if path is None:
        from vitlab.models.registry import normalize_name
        from vitlab.weights.pretrained import PRETRAINED, names

        text = str(spec)
        size = peer_names.image_size_of(text)  # timm's vit_base_patch16_384: offer a checkpoint at 384
        tags = [n for n in names(normalize_name(text.partition("(")[0]))
                if size is None or PRETRAINED[n].image_size == size]
        offer = f"a pretrained checkpoint such as {tags[0]}" if tags else "a weights file or folder"
        raise VitlabError(f"{text!r} is a model name (random weights), not weights: pass {offer} "
                          "(`vitlab models --pretrained` lists them) or a weights file, model folder or run folder")
    return path


def read_checkpoint(path: str | Path, size_hint: Any = None, **overrides: Any) -> tuple[Any, dict[str, torch.Tensor], dict]:
    """(model config, vitlab state dict, meta) of any supported checkpoint, without building a model.

    `overrides` set config fields the file cannot determine (e.g. `heads=` for timm/torchvision
    files of an unusual width, `classifier='token'` for a timm file with a class token, `image_size=`
    for a non-square timm/torchvision grid or big_vision files with fixed sin-cos embeddings).
    `size_hint`: the image size the caller will use; a timm/torchvision file whose position table has
    exactly that grid's slots is read at that size (how non-square files load with `load(..., image_size=)`).
    """
    path = resolve_weights(path)
    fmt = detect_format(path)
    overrides = _checked_overrides(overrides)
    try:
        return _read_format(Path(path), fmt, size_hint, overrides)
    except (TypeError, KeyError, AttributeError, IndexError, ValueError, ArithmeticError, NotImplementedError) as exc:
        # The readers check every field they know of; a file malformed in a way none of them foresaw
        # (fuzzing finds these) still ends in one line naming the file instead of a raw traceback.
        raise VitlabError(f"{path}: malformed {fmt} checkpoint ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160] if str(exc) else 'no detail'}); "
                          "re-download or re-save the weights") from exc


def _checked_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """The caller's overrides under vitlab's field names, an unknown one refused here: inside a reader it would
    end as a TypeError and be reported as a malformed file. ResNet fields (`stem`, `ws_eps`, ...) are the ResNet
    readers' own (torchvision, timm_bit)."""
    import dataclasses

    from vitlab.models.config import ResNetConfig, ViTConfig, canonical_fields, check_fields

    overrides = canonical_fields(overrides)
    check_fields(ViTConfig, set(overrides) - {f.name for f in dataclasses.fields(ResNetConfig)})
    return overrides


def _read_format(p: Path, fmt: str, size_hint: Any, overrides: dict) -> tuple[Any, dict[str, torch.Tensor], dict]:
    if fmt == "native":
        from vitlab.weights import native

        config, sd, meta = native.read_native(p if p.is_dir() else p.parent)
        if overrides:
            config = config.replace(**overrides)
    elif fmt == "hf":
        from vitlab.weights import hf

        config, sd, meta = hf.read_hf_folder(p if p.is_dir() else p.parent, **overrides)
    elif fmt == "timm_folder":
        from vitlab.weights import timm

        config, sd, meta = timm.read_timm_folder(p if p.is_dir() else p.parent, size_hint, **overrides)
    elif fmt == "official":
        from vitlab.weights import official

        config, sd, meta = official.read_official(p, size_hint, **overrides)
    elif fmt == "big_transfer":
        from vitlab.weights import big_transfer

        config, sd, meta = big_transfer.read_big_transfer(p, **overrides)
    else:
        from vitlab.weights import run_checkpoint, timm
        from vitlab.weights.io import load_tensor_file, unwrap_state_dict

        loaded = load_tensor_file(p)
        if run_checkpoint.is_run_checkpoint(loaded):  # RUN/checkpoints/best.pt: the config is in it (or beside it)
            config, sd, meta = run_checkpoint.read_run_checkpoint(loaded, p)
            return _finish_meta(config.replace(**overrides) if overrides else config, sd, meta, "checkpoint", p)
        sd = unwrap_state_dict(loaded, str(p))
        # vitlab's timm export records what the keys cannot tell (heads, GELU, pooling, ..., class names,
        # preprocessing) in the safetensors header or a `NAME.vitlab.json` sidecar; what the caller passes wins.
        record = timm.stored_record(p, sd)
        overrides = {**timm.hints_from(record, sd), **overrides}
        config, sd, meta = convert_state_dict(sd, str(p), size_hint, **overrides)
        meta = {**meta, **timm.meta_from(record, config)}
    return _finish_meta(config, sd, meta, fmt, p)


def _finish_meta(config: Any, sd: dict, meta: dict, fmt: str, p: Path) -> tuple[Any, dict[str, torch.Tensor], dict]:
    meta = dict(meta)
    meta["format"] = meta.get("format", fmt)
    meta["source"] = str(p)
    if meta.get("preprocess") is None:
        from vitlab.weights.native import default_preprocess

        meta["preprocess"] = default_preprocess(config)
    return config, sd, meta


def convert_state_dict(sd: dict[str, torch.Tensor], source: str = "state dict", size_hint: Any = None, **overrides: Any):
    """Tell timm, torchvision and Hugging Face state dicts apart by their keys and convert them
    (`size_hint`: see `read_checkpoint`; used by the ViT readers whose files may not say their grid)."""
    from vitlab.weights import hf, timm, torchvision

    if torchvision.is_torchvision_resnet(sd):  # torchvision and timm `resnet*` share the keys
        return torchvision.read_torchvision_resnet(sd, source, **overrides)
    if torchvision.is_torchvision(sd):
        return torchvision.read_torchvision(sd, size_hint, **overrides)
    if hf.is_hf_state_dict(sd):
        return hf.read_hf_state_dict(sd, None, **overrides)
    from vitlab.weights import timm_bit  # before timm: its ResNet reader takes post-activation files only

    if timm_bit.is_timm_bit(sd):
        return timm_bit.read_timm_bit(sd, **overrides)
    if timm.is_timm(sd):
        return timm.read_timm(sd, size_hint, **overrides)
    raise VitlabError(
        f"{source}: unknown state-dict layout (first keys: {_first(sorted(sd), 4)}); expected timm "
        "('patch_embed.proj.weight'), torchvision ('conv_proj.weight'; ResNets 'conv1.weight' + 'layer1.0...') or "
        "Hugging Face ('embeddings.patch_embeddings.projection.weight', 'resnet.embedder...') names"
    )


def _preprocess_object(d: dict | None) -> Any:
    """A `vitlab.data.preprocess.Preprocess` when the data package provides it, else the plain dict."""
    if d is None:
        return None
    try:
        from vitlab.data.preprocess import Preprocess
    except ImportError:
        return d
    try:
        return Preprocess.from_dict(d)
    except (TypeError, ValueError, VitlabError):  # e.g. a 4-channel model: keep the plain dict rather than fail the load
        return d


def drop_fixed_position_table(model: nn.Module, sd: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """timm and Hugging Face store a fixed sin-cos table as a parameter; vitlab computes it. Where the file's
    record says the model's is fixed (posemb 'sincos2d'), the stored table must be that table: a copy trained
    elsewhere is another model, refused rather than silently replaced."""
    config = getattr(model, "config", None)
    if getattr(config, "posemb", "learn") != "sincos2d" or "pos_embed" not in sd:
        return sd
    import torch

    stored, fixed = sd["pos_embed"], model.pos_embed
    # compared at the stored precision: a float16 export holds the table rounded to float16 (5e-4 apart from the
    # float32 one), and a float64 model's table is float64
    if stored.shape != fixed.shape or not torch.allclose(stored.double(), fixed.to(stored.dtype).double(),
                                                         rtol=0, atol=1e-6):
        raise VitlabError(f"{source}: its record says fixed sin-cos position embeddings, but the stored table is not "
                          "that table (trained elsewhere?); load it as a learned table with posemb=learn "
                          "(--model-args posemb=learn)")
    return {k: v for k, v in sd.items() if k != "pos_embed"}


def load_with_meta(
    path: str | Path,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    keep_representation: bool = False,
    *,
    keep_dtype: bool = False,
    checkpoint: tuple | None = None,
    **overrides: Any,
) -> tuple[nn.Module, dict]:
    """Like `load`, also returning meta: `class_names` (list or None), `preprocess` (a `Preprocess`),
    `format` ('native', 'hf', 'official', 'timm', 'torchvision', 'big_vision'), `source` and `dtype` (the file's
    float dtype, e.g. 'float16'; the widest one where it mixes several).

    `keep_dtype=True` (what `vitlab convert` uses) returns the model in the file's dtype, loaded without rounding
    (a float64 file is loaded into float64), so that saving it writes the same values in the same dtype; by
    default the model computes in float32, as every command runs it.

    `checkpoint`: what `read_checkpoint(path, size_hint=image_size, **overrides)` already returned, so a caller that
    had to look into the file first (fine-tuning reads the checkpoint's size before the data) does not read a
    large file twice."""
    import torch

    from vitlab.models.config import size_to_run_at

    # timm's img_size is the size to run at (`image_size` here), not the file's own size (an `image_size` override)
    image_size, overrides = size_to_run_at(image_size, overrides)
    config, sd, meta = checkpoint or read_checkpoint(path, size_hint=image_size, **overrides)
    from vitlab.weights.limits import validate_preprocess

    # every format's stored preprocessing (timm folders too) must fit the model before anything runs on it
    validate_preprocess(meta.get("preprocess"), config, str(meta["source"]))
    from vitlab.models.registry import build_unfilled

    model = build_unfilled(config)  # every stored tensor comes from the file: no random initialisation first
    dtype = file_dtype(sd)
    if keep_dtype and dtype == torch.float64:
        model = model.double()  # float32 parameters would round the file's values as they load
    sd = drop_fixed_position_table(model, sd, str(meta["source"]))
    load_state_dict_strict(model, sd, str(meta["source"]), assign=True)
    old_head = getattr(model, "head", None)
    model = adapt(model, num_classes, image_size, keep_representation)
    if keep_dtype:
        # float16/bfloat16 values widened to float32 on load narrow back exactly; a new head or a resampled
        # table is made in float32 and then stored in the file's dtype like the rest
        model = model.to(dtype)
    meta = dict(meta)
    meta["dtype"] = str(dtype).replace("torch.", "")
    if getattr(model, "head", None) is not old_head:  # a new (zero) head: the old class names no longer apply
        meta["class_names"] = None
        meta["zero_head"] = False
        meta["replaced_head_classes"] = config.num_classes  # what the file's head had (fine-tuning says so)
    pre = dict(meta["preprocess"]) if meta.get("preprocess") is not None else None
    if image_size is not None and pre is not None:
        from vitlab.models.surface import update_preprocess_size

        # the shorter side before the crop keeps its margin (timm's 248 for 224 -> 425 for 384); kept as it was, it
        # fell below the new crop and the record no longer made a preprocessing (a record without a size: none)
        new = model.config.image_size
        pre = update_preprocess_size(pre, pre.get("image_size") or new, new)
    meta["preprocess"] = _preprocess_object(pre)
    meta["config"] = model.config
    # the model carries what the file said about its input and outputs: `model.pretrained_cfg` (timm's transforms)
    # reads it, and `vitlab.save(model, ...)` writes it back instead of the default preprocessing
    model.preprocess, model.class_names = meta["preprocess"], meta.get("class_names")
    return model, meta


def file_dtype(sd: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype that holds every float tensor of `sd` exactly: their common dtype, or the promotion of several
    (float16 with bfloat16 is float32); float32 when there is none."""
    import torch

    found = {v.dtype for v in sd.values() if v.is_floating_point()}
    if not found:
        return torch.float32
    dtype = found.pop()
    for other in found:
        dtype = torch.promote_types(dtype, other)
    return dtype


def load(
    path: str | Path,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    keep_representation: bool = False,
    **overrides: Any,
) -> nn.Module:
    """Load a checkpoint of any supported format into a ready model (eval mode), config read off the file.

    `num_classes` (when given) drops the head (and the representation layer unless
    `keep_representation`) and adds a zero-initialised head (paper B.1.1); `image_size` resamples
    the position embeddings to the new grid (paper 3.2), and is the size a non-square timm/torchvision
    file is read at when its grid has exactly the file's position slots. `overrides` set config fields
    the file cannot tell (`heads=`, `classifier='token'`, `gelu=`; docs/weights.md lists when they are needed).
    """
    return load_with_meta(path, num_classes, image_size, keep_representation, **overrides)[0]


def adapt(
    model: nn.Module,
    num_classes: int | None = None,
    image_size: int | tuple[int, int] | None = None,
    keep_representation: bool = False,
) -> nn.Module:
    """Fine-tuning surgery: new zero-initialised head for `num_classes`, position embeddings for `image_size`."""
    cfg = model.config
    if num_classes is not None and (
        num_classes != cfg.num_classes or (cfg.representation_size and not keep_representation)
    ):
        model.reset_classifier(num_classes, keep_representation=keep_representation)
    if image_size is not None:
        model.set_image_size(image_size)
    return model.eval()


def model_record(model: nn.Module, class_names: list[str] | None, preprocess: Any) -> tuple[Any, Any]:
    """(class names, preprocessing) to write with `model`: the ones given, else those `vitlab.load` read from the
    model's file (`model.class_names`, `model.preprocess`), so that loading and saving again keeps them."""
    from vitlab.weights.native import unwrapped

    model = unwrapped(model)
    if class_names is None:
        class_names = getattr(model, "class_names", None)
    if preprocess is None:
        preprocess = getattr(model, "preprocess", None)
    return class_names, preprocess


def save_hf(model: nn.Module, folder: str | Path, class_names: list[str] | None = None, preprocess: Any = None) -> Path:
    """Write a Hugging Face folder that `transformers.ViTForImageClassification.from_pretrained` loads
    (`ResNetForImageClassification` for a standard BatchNorm ResNet)."""
    from vitlab.weights import hf

    return hf.save_hf(model, folder, *model_record(model, class_names, preprocess))


def save_timm(model: nn.Module, path: str | Path, class_names: list[str] | None = None, preprocess: Any = None) -> Path:
    """Write a timm-named state dict (`.safetensors`, or `.pth`/`.pt`/`.bin` by suffix) with the config fields
    timm's keys cannot carry beside it (safetensors header, or `NAME.vitlab.json`), so vitlab reads back the
    same model (and class names, preprocessing); a standard ResNet's keys are torchvision's = timm's `resnet*`
    (loads strictly into both)."""
    from vitlab.weights import timm

    return timm.save_timm(model, path, *model_record(model, class_names, preprocess))
