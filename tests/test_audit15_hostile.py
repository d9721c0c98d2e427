"""Audit 15, hostile input files: each case below was found by crafting the file by hand (docs/weights.md and
docs/data.md, "Limits" and "Rules for folders and bad files"): a load or one VitlabError line, in bounded memory."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from vitlab.data import load_data
from vitlab.errors import VitlabError

FIX = Path("/work/shared/fixtures/official")
FIXTURE = FIX / "tiny_token_prelinen.npz"
needs_fixture = pytest.mark.skipif(not FIXTURE.is_file(), reason="official fixtures not available")


def _png(path: Path, seed: int) -> Path:
    rs = np.random.RandomState(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((rs.rand(20, 20, 3) * 255).astype("uint8")).save(path)
    return path


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {name: z.read(name) for name in z.namelist()}


# ------------------------------------------------------------------------------------------ data sources
def test_csv_naming_one_file_under_thousands_of_labels_stays_linear(tmp_path):
    """Was: every skip record of the file repeated the list of all its classes: 200,000 rows of one image (3.4 MB
    of CSV) took 5.7 GB and ended in a raw MemoryError after 16 s (quadratic in the rows)."""
    _png(tmp_path / "x.png", 0)
    _png(tmp_path / "y.png", 1)
    n = 3000
    (tmp_path / "d.csv").write_text("path,label\n" + "".join(f"x.png,c{i}\n" for i in range(n)) + "y.png,b\n")
    splits = load_data(str(tmp_path / "d.csv"), val_fraction=0, test_fraction=0, progress=False)
    same = [why for path, why in splits.skipped if why.startswith("same file in several classes")]
    assert len(same) == n  # each row still listed, with the places it was given
    assert f"({n} in all)" in same[0] and "train/c0" in same[0]
    assert sum(len(why) for _, why in splits.skipped) < 2_000_000  # was n * 30 KB = 90 MB here


def test_hugging_face_set_with_no_usable_row_is_one_line(tmp_path, monkeypatch):
    """Was: `AttributeError: 'NoneType' object has no attribute 'labels'` when every row of the train split was
    skipped (string paths that are no images, or every label null), raised while carving the val split."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    not_image = tmp_path / "notes.txt"
    not_image.write_text("not an image")
    png = _png(tmp_path / "0.png", 0).read_bytes()
    tables = {
        "paths": pa.table({"image": [str(not_image), str(not_image)], "label": [0, 1]}),
        "nolabel": pa.table({"image": [{"bytes": png, "path": None}] * 2, "label": pa.array([None, None], pa.int64())}),
    }
    for name, table in tables.items():
        (tmp_path / name).mkdir()
        pq.write_table(table, tmp_path / name / "train-00000.parquet")
        with pytest.raises(VitlabError, match="no usable image in hf:parquet:.* for training: 2 files skipped"):
            load_data(f"hf:parquet:{tmp_path / name}", progress=False)


# ------------------------------------------------------------------------------------------ weights
def test_stored_preprocessing_for_other_channels_than_the_model_is_refused_at_load(tmp_path):
    """Was: a config.json whose preprocessing said channels 1 for a 3-channel model loaded, and predict then failed
    with "expected images of shape (B, 3, H, W), got (1, 1, 16, 16)", naming neither the file nor the cause."""
    model = vitlab.create_model("vit-ti/16", image_size=16, patch_size=8, dim=32, depth=1, heads=2, mlp_dim=64,
                                num_classes=2)
    folder = tmp_path / "m"
    vitlab.save(model, folder)
    meta = json.loads((folder / "config.json").read_text())
    meta["preprocess"]["channels"] = 1
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(VitlabError, match=r"config\.json: stored preprocessing channels 1 does not match the "
                                          r"model's in_chans 3"):
        vitlab.weights.load_with_meta(folder)


@needs_fixture
def test_npz_holding_a_member_twice_is_refused(tmp_path):
    """Was: a zip with two `embedding/kernel.npy` members loaded silently with the last one (other zip tools take
    the first): the model depended on the reader."""
    members = _members(FIXTURE)
    bad = io.BytesIO()
    np.save(bad, np.full(np.load(FIXTURE)["embedding/kernel"].shape, 7.0, np.float32))
    path = tmp_path / "dup.npz"
    with zipfile.ZipFile(path, "w") as z, pytest.warns(UserWarning, match="Duplicate name"):
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("embedding/kernel.npy", bad.getvalue())
    with pytest.raises(VitlabError, match=r"dup\.npz holds the member embedding/kernel\.npy more than once"):
        vitlab.load(path)


@needs_fixture
def test_big_endian_npz_loads_the_same_model(tmp_path):
    """Was: a valid .npz of big-endian float32 arrays (numpy and JAX read it) was refused as "malformed official
    checkpoint (ValueError: given numpy array has byte order different from the native byte order ...)"."""
    with np.load(FIXTURE) as f:
        arrays = {k: f[k].astype(f[k].dtype.newbyteorder(">")) for k in f.files}
    np.savez(tmp_path / "be.npz", **arrays)
    ours, ref = vitlab.load(tmp_path / "be.npz"), vitlab.load(FIXTURE)
    x = torch.randn(2, 3, *ref.config.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


@needs_fixture
def test_cut_off_npz_is_called_a_damaged_zip_not_a_torch_file(tmp_path):
    """Was: "cannot read x.npz as a PyTorch state dict (RuntimeError: PytorchStreamReader failed ...)" for an .npz
    cut short (an interrupted copy), which sent the user looking at torch."""
    data = FIXTURE.read_bytes()
    for cut in (len(data) // 2, len(data) - 10):
        path = tmp_path / f"cut{cut}.npz"
        path.write_bytes(data[:cut])
        with pytest.raises(VitlabError) as info:
            vitlab.load(path)
        message = str(info.value)
        assert "is a damaged zip archive" in message and "re-download" in message and "PyTorch" not in message
