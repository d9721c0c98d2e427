"""Hugging Face `datasets` as --data: save_to_disk folders, Parquet files and imagefolders made with the
library itself; columns and ClassLabel names detected, bad rows skipped and counted, streamed with workers."""

import sys

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.data import load_data, make_loader
from vitlab.data.hf_datasets import HFImageDataset
from vitlab.errors import VitlabError

datasets = pytest.importorskip("datasets")

NAMES = ["cat", "dog", "emu"]


@pytest.fixture(autouse=True)
def _local_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # never the user's cache


def _images(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)) for _ in range(n)]


def _dataset(n=12, seed=0):
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES),
                               "caption": datasets.Value("string")})
    imgs = _images(n, seed)
    return datasets.Dataset.from_dict({"image": imgs, "label": [i % 3 for i in range(n)],
                                       "caption": [f"c{i}" for i in range(n)]}, features=feats), imgs


def test_save_to_disk_and_parquet(tmp_path):
    train, imgs = _dataset(12)
    test, _ = _dataset(6, seed=1)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "disk"))
    train.to_parquet(str(tmp_path / "pq" / "train-00000-of-00001.parquet"))
    test.to_parquet(str(tmp_path / "pq" / "test-00000-of-00001.parquet"))
    expected = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1)[:, 1:11] for im in imgs])  # 10x10 crop
    for spec in (f"hf:{tmp_path / 'disk'}", str(tmp_path / "disk"), f"hf:{tmp_path / 'pq'}",
                 f"hf:parquet:{tmp_path / 'pq' / '*.parquet'}"):
        s = load_data(spec, val_fraction=0, progress=False)
        assert s.class_names == NAMES and s.channels == 3, spec
        assert len(s.train) == 12 and len(s.test) == 6, spec
        assert s.train.labels.tolist() == [i % 3 for i in range(12)]
        assert torch.equal(s.train.images, expected), spec  # decoded into memory, in row order
    one = load_data(str(tmp_path / "pq" / "train-00000-of-00001.parquet"), val_fraction=0, test_fraction=0,
                    progress=False)
    assert len(one.train) == 12
    # a plain binary column of encoded images works too; a column of numbers is one clear line
    png = [train.cast_column("image", datasets.Image(decode=False))[i]["image"]["bytes"] for i in range(4)]
    datasets.Dataset.from_dict({"image": png, "label": [0, 1, 0, 1]}).to_parquet(str(tmp_path / "bin.parquet"))
    b = load_data(str(tmp_path / "bin.parquet"), val_fraction=0, test_fraction=0, progress=False)
    assert torch.equal(b.train.images, expected[:4])
    datasets.Dataset.from_dict({"image": [1, 2], "label": [0, 1]}).save_to_disk(str(tmp_path / "ints"))
    with pytest.raises(VitlabError, match="does not hold images"):
        load_data(str(tmp_path / "ints"), progress=False)


def test_imagefolder_with_a_bad_file_and_rows_without_labels(tmp_path):
    for split in ("train", "test"):
        for c in ("ant", "bee"):
            (tmp_path / "imf" / split / c).mkdir(parents=True)
            for i, im in enumerate(_images(3, seed=len(c))):
                im.save(tmp_path / "imf" / split / c / f"{i}.png")
    (tmp_path / "imf" / "train" / "bee" / "bad.png").write_bytes(b"not a png")
    s = load_data(f"hf:imagefolder:{tmp_path / 'imf'}", val_fraction=0, progress=False)
    assert s.class_names == ["ant", "bee"] and len(s.train) == 6 and len(s.test) == 6
    assert [r for _, r in s.skipped] == ["not an image (Pillow cannot identify it)"]
    # string labels without a ClassLabel: sorted names; a row without a label is skipped and listed
    d = datasets.Dataset.from_dict({"img": _images(4), "class": ["y", "x", None, "y"]})
    d.save_to_disk(str(tmp_path / "strs"))
    s = load_data(str(tmp_path / "strs"), val_fraction=0, test_fraction=0, progress=False)
    assert s.class_names == ["x", "y"] and s.train.labels.tolist() == [1, 0, 1]
    assert s.skipped[0][1].startswith("missing label")


def test_streamed_with_workers_and_ranks(tmp_path):
    train, _ = _dataset(20)
    train.save_to_disk(str(tmp_path / "d"))
    s = load_data(str(tmp_path / "d"), val_fraction=0, test_fraction=0, in_memory=False, progress=False)
    assert isinstance(s.train, HFImageDataset)
    whole = load_data(str(tmp_path / "d"), val_fraction=0, test_fraction=0, progress=False).train
    seen = []
    for rank in range(2):
        for x, y in make_loader(s.train, 4, shuffle=True, seed=0, rank=rank, world_size=2, num_workers=2):
            for img, label in zip(x, y.tolist()):
                i = next(k for k in range(len(whole)) if torch.equal(whole.images[k], img))
                assert label == int(whole.labels[i])
                seen.append(i)
    assert sorted(seen) == list(range(20))  # 20 rows over 2 ranks: each once


def test_shard_command_reads_hf_and_missing_library_is_one_line(tmp_path, monkeypatch, capsys):
    train, _ = _dataset(7)
    train.save_to_disk(str(tmp_path / "d"))
    assert main(["data", "shard", f"hf:{tmp_path / 'd'}", str(tmp_path / "shards"), "--shard-size", "4", "--quiet"]) == 0
    assert "train 7 images in 2 shards" in capsys.readouterr().out
    a = load_data(f"hf:{tmp_path / 'd'}", val_fraction=0, test_fraction=0, progress=False)
    b = load_data(str(tmp_path / "shards"), val_fraction=0, test_fraction=0, progress=False)
    assert torch.equal(a.train.images, b.train.images) and b.class_names == NAMES
    with pytest.raises(VitlabError, match="no .parquet files"):
        load_data(f"hf:{tmp_path / 'nothing.parquet'}", progress=False)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(VitlabError, match=r"pip install 'vitlab\[hf\]'"):
        load_data(f"hf:{tmp_path / 'd'}", progress=False)


def test_class_numbers_float_huge_and_sparse(tmp_path, capsys):
    """Class numbers without names: a float column (pandas' integers with a missing value) reads as numbers, not
    as names sorted as text; one huge number is refused in one line instead of making billions of classes; classes
    with no image are named on the load's line."""
    pd = pytest.importorskip("pandas")
    png = [datasets.Image().encode_example(im)["bytes"] for im in _images(48)]
    labels = [float(i % 12) for i in range(47)] + [float("nan")]
    (tmp_path / "pq").mkdir()
    pd.DataFrame({"image": [{"bytes": b, "path": None} for b in png], "label": labels}).to_parquet(
        tmp_path / "pq" / "train-00000.parquet")
    s = load_data(f"hf:{tmp_path / 'pq'}", val_fraction=0, test_fraction=0, progress=False)
    assert s.class_names == [str(i) for i in range(12)] and len(s.train) == 47
    expected = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1)[:, 1:11] for im in _images(48)[:47]])
    assert s.train.labels.tolist() == [i % 12 for i in range(47)] and torch.equal(s.train.images, expected)
    assert s.skipped == [("hf:pq/train[47]", "missing label (none, or not one of the classes)")]

    feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    huge = datasets.Dataset.from_dict({"image": _images(4), "label": [0, 1, 99_999_999_999, -1]}, features=feats)
    huge.save_to_disk(str(tmp_path / "huge"))
    with pytest.raises(VitlabError, match="label 99999999999 would make 100,000,000,000 classes"):
        load_data(f"hf:{tmp_path / 'huge'}", progress=False)
    with pytest.raises(VitlabError, match="is not a whole number"):
        pd.DataFrame({"image": [{"bytes": b, "path": None} for b in png[:2]], "label": [0.5, 1.0]}).to_parquet(
            tmp_path / "half.parquet")
        load_data(str(tmp_path / "half.parquet"), progress=False)

    sparse = datasets.Dataset.from_dict({"image": _images(20), "label": [0, 1000] * 10}, features=feats)
    sparse.save_to_disk(str(tmp_path / "sparse"))
    s = load_data(f"hf:{tmp_path / 'sparse'}", val_fraction=0, test_fraction=0, progress=True)
    assert s.num_classes == 1001  # numbers are indices: a 1000-class head still lines up
    assert "999 of the 1001 classes numbered 0..1000 have no image (1, 2, 3" in capsys.readouterr().err
