"""Downloads: pretrained names (`vit-b/16.augreg-in21k-ft-in1k-224`, `vitlab.weights.pretrained`), `hf:ORG/NAME`
through huggingface_hub, official `.npz` names and URLs of Google's public buckets (`vitlab.weights.download`).

Without a network (or with VITLAB_OFFLINE=1) the error says what to download and where to put it.
"""

from __future__ import annotations

import re
from pathlib import Path

from vitlab.errors import VitlabError
from vitlab.weights.download import cache_dir, fetch
from vitlab.weights.pretrained import BIT_BUCKET, VIT_BUCKET, bucket_url, lookup

__all__ = ["cache_dir", "fetch_hf", "fetch_official", "fetch_pretrained", "resolve"]
BUCKET = VIT_BUCKET
# Official file names: ViT-B_16, R50+ViT-B_16, ViT-L_16-224, AugReg "B_16-i21k-300ep-...".
_OFFICIAL_RE = re.compile(r"^(imagenet21k(\+imagenet2012)?/|augreg/|sam/|gsam/)?[A-Za-z0-9_+.=\-]+(\.npz)?$")
_BARE_NAME_RE = re.compile(r"^(R\d*\+)?ViT-[A-Za-z]+_\d+(-224)?(\.npz)?$")
_BUCKET_FOLDERS = ("imagenet21k/", "imagenet21k+imagenet2012/", "augreg/", "sam/", "gsam/")


def resolve(source: str | Path) -> str | Path:
    """A local path for `source`: existing paths pass through; pretrained names, `hf:ORG/NAME`, official bucket
    names (ViT-B_16, imagenet21k/..., gs://vit_models/...) and bucket URLs are fetched into the cache."""
    s = str(source)
    if Path(s).expanduser().exists():
        return source
    if lookup(s) is not None:
        return fetch_pretrained(s)
    if s.startswith("hf:"):
        return fetch_hf(s[3:])
    for prefix in ("gs://vit_models/", BUCKET + "/", bucket_url("vit-bucket") + "/"):
        if s.startswith(prefix):
            return fetch_official(s[len(prefix):])
    for prefix in ("gs://bit_models/", BIT_BUCKET + "/", bucket_url("bit-bucket") + "/"):
        if s.startswith(prefix):
            return _fetch_bucket("bit-bucket", s[len(prefix):])
    if _BARE_NAME_RE.match(s) or s.startswith(_BUCKET_FOLDERS):
        return fetch_official(s)
    return source


def fetch_pretrained(name: str) -> Path:
    """The local file or folder of a pretrained checkpoint name, downloaded into the cache when missing."""
    from vitlab.weights.pretrained import get

    entry = get(name)
    if entry.source == "hf":
        return fetch_hf(entry.path)
    return _fetch_bucket(entry.source, entry.path, entry.size, entry.sha256)


def _fetch_bucket(source: str, rel: str, size: int | None = None, sha256: str | None = None) -> Path:
    """A file of the ViT or BiT bucket, cached as CACHE/official/REL or CACHE/bit/REL."""
    if ".." in Path(rel).parts or rel.startswith("/"):
        raise VitlabError(f"{rel!r} is not a file name of the {source}")
    folder = "bit" if source == "bit-bucket" else "official"
    return fetch(f"{bucket_url(source)}/{rel}", cache_dir() / folder / rel, size=size, sha256=sha256)


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
    from vitlab.weights.download import offline

    try:  # VITLAB_OFFLINE=1 means the Hub's own cache only, like HF_HUB_OFFLINE=1
        return Path(snapshot_download(
            repo_id, allow_patterns=["config.json", "model.safetensors", "pytorch_model.bin", "preprocessor_config.json"],
            **({"local_files_only": True} if offline() else {}),
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
    return _fetch_bucket("vit-bucket", rel)
