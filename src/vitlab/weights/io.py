"""Reading tensor files safely: safetensors, or torch files with `weights_only=True` (no pickled code)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vitlab.errors import VitlabError

STATE_DICT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a `.safetensors` or torch file as a flat name -> tensor dict (on the CPU).

    Torch files are read with `weights_only=True`; common wrappers (`{"model": ...}`,
    `{"state_dict": ...}`, a DDP `module.` prefix) are unwrapped.
    """
    p = Path(path)
    if not p.is_file():
        raise VitlabError(f"no such file: {p}")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p), device="cpu")
        except Exception as exc:  # SafetensorsError (truncated header/data), OSError
            raise VitlabError(f"cannot read {p} as safetensors ({exc}); is the file complete?") from exc
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, pickle with code, not a torch file at all
        raise VitlabError(
            f"cannot read {p} as a PyTorch state dict ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "only complete files holding plain tensors are accepted (weights_only=True)"
        ) from exc
    return unwrap_state_dict(obj, str(p))


def unwrap_state_dict(obj: object, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Find the state dict inside a loaded checkpoint object."""
    for key in ("model", "state_dict", "model_state", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj:
        raise VitlabError(f"{source} holds no state dict (expected a dict of tensors)")
    out = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not out:
        raise VitlabError(f"{source} holds no tensors")
    for prefix in ("module.", "_orig_mod."):  # DistributedDataParallel, torch.compile
        if all(k.startswith(prefix) for k in out):
            out = {k[len(prefix):]: v for k, v in out.items()}
    return out


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata of a `.safetensors` header ({} for other files or none)."""
    p = Path(path)
    if p.suffix != ".safetensors":
        return {}
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # unreadable headers are reported by read_tensors
        return {}


def folder_config(folder: Path) -> dict | None:
    """The folder's `config.json` as a dict, or None when it is absent or not a JSON object
    (used to tell vitlab, Hugging Face and timm folders apart)."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return None
    try:
        data = json.loads(cfg.read_text())
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
