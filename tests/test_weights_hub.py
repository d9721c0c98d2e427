"""Downloads without a network: the message says what to download and where to put it; cached files are used."""

import urllib.error
import urllib.request

import numpy as np
import pytest

import vitlab
from vitlab.errors import VitlabError
from vitlab.weights import hub


def test_official_name_offline_says_where(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path / "cache"))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(VitlabError) as err:
        vitlab.load("ViT-B_16")
    msg = str(err.value)
    assert "https://storage.googleapis.com/vit_models/imagenet21k/ViT-B_16.npz" in msg
    assert str(tmp_path / "cache" / "official" / "imagenet21k" / "ViT-B_16.npz") in msg
    with pytest.raises(VitlabError, match="imagenet21k\\+imagenet2012/ViT-L_16-224.npz"):
        vitlab.load("ViT-L_16-224")


def test_cached_official_file_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("VITLAB_CACHE", str(tmp_path))
    target = tmp_path / "official" / "imagenet21k" / "ViT-B_16.npz"
    target.parent.mkdir(parents=True)
    np.savez(target, foo=np.zeros(2))
    assert hub.resolve("ViT-B_16") == target
    assert hub.resolve("gs://vit_models/imagenet21k/ViT-B_16.npz") == target


def test_hf_offline_says_what_to_download(monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(VitlabError, match="https://huggingface.co/google/vit-base-patch16-224"):
        vitlab.load("hf:google/vit-base-patch16-224")
    with pytest.raises(VitlabError, match="not a Hugging Face repo id"):
        vitlab.load("hf:bad id!")
