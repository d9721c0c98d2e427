"""Downloads: `hf:ORG/NAME` through huggingface_hub, official `.npz` names from Google's public bucket.

Without a network (or without huggingface_hub) the error says what to download and where to put it.
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from pathlib import Path

from vitlab.errors import VitlabError

BUCKET = "https://storage.googleapis.com/vit_models"
# Official file names: ViT-B_16, R50+ViT-B_16, ViT-L_16-224, AugReg "B_16-i21k-300ep-...".
_OFFICIAL_RE = re.compile(r"^(imagenet21k(\+imagenet2012)?/|augreg/|sam/|gsam/)?[A-Za-z0-9_+.=\-]+(\.npz)?$")
_BARE_NAME_RE = re.compile(r"^(R\d*\+)?ViT-[A-Za-z]+_\d+(-224)?(\.npz)?$")
_BUCKET_FOLDERS = ("imagenet21k/", "imagenet21k+imagenet2012/", "augreg/", "sam/", "gsam/")


def cache_dir() -> Path:
    """Where downloads go: $VITLAB_CACHE, else ~/.cache/vitlab."""
    return Path(os.environ.get("VITLAB_CACHE", Path.home() / ".cache" / "vitlab"))


def resolve(source: str | Path) -> str | Path:
    """A local path for `source`: downloads `hf:ORG/NAME` and official bucket names; paths pass through."""
    s = str(source)
    if s.startswith("hf:"):
        return fetch_hf(s[3:])
    if s.startswith("gs://vit_models/"):
        return fetch_official(s[len("gs://vit_models/"):])
    if s.startswith(BUCKET + "/"):
        return fetch_official(s[len(BUCKET) + 1:])
    if not Path(s).exists() and (_BARE_NAME_RE.match(s) or s.startswith(_BUCKET_FOLDERS)):
        return fetch_official(s)
    return source


def fetch_hf(repo_id: str) -> Path:
    """Download a Hugging Face model repo (config + weights) and return its local folder."""
    if not re.match(r"^[\w.\-]+(/[\w.\-]+)?$", repo_id):
        raise VitlabError(f"'hf:{repo_id}' is not a Hugging Face repo id; use hf:ORG/NAME, e.g. hf:google/vit-base-patch16-224")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise VitlabError(
            f"hf:{repo_id} needs huggingface_hub (pip install 'vitlab[hub]'); or download "
            f"https://huggingface.co/{repo_id} (config.json + model.safetensors) into a folder and pass that folder"
        ) from exc
    try:
        return Path(snapshot_download(
            repo_id, allow_patterns=["config.json", "model.safetensors", "pytorch_model.bin", "preprocessor_config.json"],
        ))
    except Exception as exc:  # offline, unknown repo, gated repo
        raise VitlabError(
            f"cannot fetch hf:{repo_id} ({type(exc).__name__}); without a network download "
            f"https://huggingface.co/{repo_id}/tree/main (config.json, model.safetensors, preprocessor_config.json) "
            "into a folder and pass that folder"
        ) from exc


def fetch_official(name: str) -> Path:
    """Download an official checkpoint, e.g. 'ViT-B_16' (i21k) or 'imagenet21k+imagenet2012/ViT-B_16.npz'."""
    if not _OFFICIAL_RE.match(name):
        raise VitlabError(f"{name!r} is neither a local file nor an official checkpoint name (e.g. ViT-B_16)")
    rel = name if name.endswith(".npz") else name + ".npz"
    if "/" not in rel:  # "-224" files exist only fine-tuned; the bare names default to the i21k pre-training
        rel = ("imagenet21k+imagenet2012/" if rel.endswith("-224.npz") else "imagenet21k/") + rel
    url = f"{BUCKET}/{rel}"
    target = cache_dir() / "official" / rel
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".npz.part")
    try:
        _download(url, partial)
    except (urllib.error.URLError, OSError) as exc:
        partial.unlink(missing_ok=True)
        raise VitlabError(
            f"cannot download {url} ({getattr(exc, 'reason', exc)}); without a network download it elsewhere "
            f"and put it at {target} (or pass the file's path)"
        ) from exc
    partial.rename(target)
    return target


def _download(url: str, dest: Path) -> None:
    from tqdm import tqdm

    with urllib.request.urlopen(url, timeout=30) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name.removesuffix(".part")) as bar:
            while chunk := response.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
