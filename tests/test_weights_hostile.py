"""Broken or hostile checkpoint files end in one VitlabError line, fast and without allocating what
they claim: every reader bounds the config and checks it against the file before building anything
(docs/weights.md, Limits). The first test replays the outside probe's cases in a child process
under a memory cap; the others check each guard in-process (tracemalloc where numpy allocates)."""

import json
import os
import pickle
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import vitlab
from vitlab.errors import VitlabError
from vitlab.weights import load_with_meta, read_checkpoint, save_hf, save_native

MB = 2**20
BOMB_BYTES = 200 * MB  # ~1 MB on disk at deflate level 1: quick to write, far above the 100 MB bound


# ------------------------------------------------------------------------------------------ files
def official_arrays(dim=8, depth=1, heads=2, mlp=16, patch=4, grid=2, classes=3, seed=0):
    """A tiny official (Flax Linen) ViT checkpoint as a dict of float32 arrays."""
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return rng.normal(0, 0.2, shape).astype(np.float32)

    a = {"embedding/kernel": arr(patch, patch, 3, dim), "embedding/bias": arr(dim), "cls": arr(1, 1, dim),
         "Transformer/posembed_input/pos_embedding": arr(1, grid * grid + 1, dim)}
    for i in range(depth):
        p = f"Transformer/encoderblock_{i}/"
        for ln in ("LayerNorm_0", "LayerNorm_1"):
            a[f"{p}{ln}/scale"], a[f"{p}{ln}/bias"] = 1 + arr(dim), arr(dim)
        m = p + "MultiHeadDotProductAttention_0/"
        for n in ("query", "key", "value"):
            a[f"{m}{n}/kernel"], a[f"{m}{n}/bias"] = arr(dim, heads, dim // heads), arr(heads, dim // heads)
        a[m + "out/kernel"], a[m + "out/bias"] = arr(heads, dim // heads, dim), arr(dim)
        a[p + "MlpBlock_0/Dense_0/kernel"], a[p + "MlpBlock_0/Dense_0/bias"] = arr(dim, mlp), arr(mlp)
        a[p + "MlpBlock_0/Dense_1/kernel"], a[p + "MlpBlock_0/Dense_1/bias"] = arr(mlp, dim), arr(dim)
    a["Transformer/encoder_norm/scale"], a["Transformer/encoder_norm/bias"] = 1 + arr(dim), arr(dim)
    a["head/kernel"], a["head/bias"] = arr(dim, classes), arr(classes)
    return a


def write_member(zf, name, shape, zeros=0, dtype="<f4"):
    """An .npy member with the given header followed by `zeros` zero bytes (streamed: little memory)."""
    with zf.open(name + ".npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": tuple(shape)})
        chunk = bytes(4 * MB)
        for _ in range(zeros // len(chunk)):
            f.write(chunk)


def npz_with_bomb(path, arrays, bomb_name, bomb_shape, bomb_bytes=BOMB_BYTES):
    """`arrays` stored as np.savez does, plus one deflated member of `bomb_bytes` zeros."""
    np.savez(path, **arrays)
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        write_member(zf, bomb_name, bomb_shape, zeros=bomb_bytes)
    return path


def stacked_npz(path, leading):
    """big_vision's scan-stacked layout with one stacked array of shape (leading, 0)."""
    a = official_arrays()
    stacked = {}
    for k in [k for k in a if k.startswith("Transformer/encoderblock_0/")]:
        stacked["Transformer/encoderblock/" + k.split("/", 2)[2]] = a.pop(k)[None]
    first = sorted(stacked)[0]
    stacked[first] = np.zeros((leading, 0), np.float32)
    np.savez(path, **a, **stacked)
    return path


def tiny_model(**kw):
    args = dict(dim=32, depth=2, heads=4, mlp_dim=64, patch_size=4, image_size=16, num_classes=3, seed=0)
    args.update(kw)
    return vitlab.create_model("custom", **args).eval()


def native_folder(path, edit=None):
    """A native folder of a tiny 16-px ViT; `edit(meta)` changes its config.json."""
    save_native(tiny_model(), path, class_names=["a", "b", "c"])
    if edit is not None:
        meta = json.loads((path / "config.json").read_text())
        edit(meta)
        (path / "config.json").write_text(json.dumps(meta))
    return path


def hf_folder(path, edit_pre=None, edit_cfg=None):
    """A Hugging Face folder (vitlab's own export) of a tiny 16-px ViT with edits to its JSON files."""
    save_hf(tiny_model(), path)
    for name, edit in (("preprocessor_config.json", edit_pre), ("config.json", edit_cfg)):
        if edit is not None:
            data = json.loads((path / name).read_text())
            edit(data)
            (path / name).write_text(json.dumps(data))
    return path


def _one_line_error(exc_info):
    message = str(exc_info.value)
    assert "\n" not in message and message
    return message


def traced_peak(fn):
    """(result or exception, peak bytes numpy/Python allocated while fn ran)."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except VitlabError as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------- the probe's cases under a cap
CHILD = r"""
import json, resource, sys, time
import torch, vitlab.weights, vitlab.models  # before the cap: vitlab.weights imports torch only when loading
status = open("/proc/self/status").read()
size = int(status.split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 500 * 2**20, resource.RLIM_INFINITY))
out = []
for path in sys.argv[1:]:
    start = time.perf_counter()
    try:
        vitlab.weights.load_with_meta(path)
        result = "ok"
    except vitlab.VitlabError as exc:
        result = "VitlabError: " + str(exc)
    except BaseException as exc:
        result = type(exc).__name__ + ": " + str(exc)[:300]
    out.append({"path": path, "result": result, "seconds": time.perf_counter() - start})
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and RLIMIT_AS")
def test_probe_cases_end_in_one_line_under_a_500_mb_cap(tmp_path):
    """Each file the outside probe measured (9.8 GB, 8.4 GB, 3.3 GB, a 65k-token hang) is refused
    (or, the bomb, loaded without touching its unused member) in a process that may allocate at
    most 500 MB more than its imports."""
    cases = {
        "depth": native_folder(tmp_path / "deep", lambda m: m["model"].update(depth=200000)),
        "stacked": stacked_npz(tmp_path / "stacked.npz", 30_000_000),
        "bomb": npz_with_bomb(tmp_path / "bomb.npz", official_arrays(), "opt/state/unused", (BOMB_BYTES // 4,)),
        "native 2048 px": native_folder(tmp_path / "big-pre", lambda m: m["preprocess"].update(image_size=[2048, 2048])),
        "hf 2048 px": hf_folder(tmp_path / "hf-big-pre", edit_pre=lambda p: p.update(size={"height": 2048, "width": 2048})),
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, cases.values())], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["path"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    for label, path in cases.items():
        r = results[str(path)]
        assert r["seconds"] < 20, (label, r)  # generous: 2 s measured; the CPU is shared with other work
        if label == "bomb":
            assert r["result"] == "ok", (label, r)
        else:
            assert r["result"].startswith("VitlabError: ") and "\n" not in r["result"], (label, r)
    assert "depth" in results[str(cases["depth"])]["result"]
    assert "scan-stacked" in results[str(cases["stacked"])]["result"]
    for label in ("native 2048 px", "hf 2048 px"):
        assert "[2048, 2048]" in results[str(cases[label])]["result"]


# ------------------------------------------------------------------------------------ .npz files
def test_unused_zip_bomb_member_is_never_decompressed(tmp_path, monkeypatch):
    path = npz_with_bomb(tmp_path / "bomb.npz", official_arrays(), "opt/state/unused", (BOMB_BYTES // 4,))
    with zipfile.ZipFile(path) as zf:
        assert zf.getinfo("opt/state/unused.npy").file_size > BOMB_BYTES  # declared, as the probe's file
    assert path.stat().st_size < 4 * MB
    opened = []
    real_open = zipfile.ZipFile.open

    def spy(self, name, *args, **kwargs):
        opened.append(getattr(name, "filename", name))
        return real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    model, peak = traced_peak(lambda: vitlab.load(path))
    assert isinstance(model, torch.nn.Module) and peak < 100 * MB
    assert "opt/state/unused.npy" not in opened
    assert "embedding/kernel.npy" in opened  # the spy sees the reads that do happen
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 8, 8))).all()


def test_big_transfer_file_with_a_bomb_member_is_refused_without_decompressing(tmp_path):
    from vitlab.weights import big_transfer

    model = vitlab.create_model("bit-r26x1-small", num_classes=2, image_size=8, layers=(1,), seed=0)
    arrays = big_transfer.to_big_transfer_arrays(model)
    path = npz_with_bomb(tmp_path / "bit.npz", arrays, "resnet/extra/bomb", (BOMB_BYTES // 4,))
    err, peak = traced_peak(lambda: vitlab.load(path))
    assert isinstance(err, VitlabError) and "unexpected arrays resnet/extra/bomb" in str(err)
    assert peak < 100 * MB


def test_needed_member_declaring_more_bytes_than_its_header_is_refused_before_decompression(tmp_path):
    arrays = official_arrays()
    arrays.pop("head/kernel")
    path = npz_with_bomb(tmp_path / "lying.npz", arrays, "head/kernel", (8, 3))  # header: 96 bytes of data
    err, peak = traced_peak(lambda: vitlab.load(path))
    assert isinstance(err, VitlabError) and "declares" in str(err) and "head/kernel" in str(err)
    assert peak < 100 * MB


def test_scan_stacked_leading_axis_is_bounded(tmp_path):
    err, peak = traced_peak(lambda: vitlab.load(stacked_npz(tmp_path / "stacked.npz", 30_000_000)))
    assert isinstance(err, VitlabError) and "scan-stacked" in str(err) and "256" in str(err)
    assert peak < 50 * MB


@pytest.mark.parametrize("name,shape,field", [
    ("embedding/kernel", (4, 4, 3, 10**6), "dim"),  # a width far above the limit
    ("head/kernel", (8, 5_000_000), "num_classes"),
    ("Transformer/posembed_input/pos_embedding", (1, 1 + 4096**2, 8), "image_size"),  # a 16384-px model
])
def test_official_shapes_out_of_bounds_are_refused_from_the_headers(tmp_path, name, shape, field):
    arrays = official_arrays()
    arrays.pop(name)
    path = tmp_path / "big.npz"
    np.savez(path, **arrays)
    with zipfile.ZipFile(path, "a") as zf:
        write_member(zf, name, shape)  # a header only: the data would be gigabytes
    err, peak = traced_peak(lambda: vitlab.load(path))
    assert isinstance(err, VitlabError) and field in str(err) and str(path) in str(err)
    assert peak < 50 * MB


def test_official_array_of_the_wrong_shape_or_dtype_is_named(tmp_path):
    arrays = official_arrays()
    arrays["Transformer/encoderblock_0/MlpBlock_0/Dense_1/bias"] = np.zeros(9, np.float32)
    with pytest.raises(VitlabError, match=r"Dense_1/bias \(expected \(8,\), found \(9,\)\)") as info:
        vitlab.load(_save(tmp_path / "shape.npz", arrays))
    _one_line_error(info)
    arrays = official_arrays()
    arrays["head/kernel"] = np.ones((8, 3), np.int32)
    with pytest.raises(VitlabError, match="head/kernel.*not floating point"):
        vitlab.load(_save(tmp_path / "int.npz", arrays))


def _save(path, arrays):
    np.savez(path, **arrays)
    return path


def test_official_hostile_reads_the_needed_arrays_only_once(tmp_path, monkeypatch):
    """A well-formed file still loads: every needed member decompressed once, nothing else."""
    arrays = official_arrays(depth=2)
    arrays["opt/state/momentum"] = np.zeros(10, np.float32)
    path = _save(tmp_path / "ok.npz", arrays)
    from vitlab.weights.io import NpzArchive

    reads = []
    real = NpzArchive.read

    def spy(self, key):
        reads.append(key)
        return real(self, key)

    monkeypatch.setattr(NpzArchive, "read", spy)
    model = vitlab.load(path)
    assert model.config.depth == 2 and "opt/state/momentum" not in reads
    assert sorted(reads) == sorted(k for k in arrays if k != "opt/state/momentum")


# ------------------------------------------------------------------------------- native folders
@pytest.mark.parametrize("edit,words", [
    (lambda m: m["model"].update(depth=200000), "depth"),
    (lambda m: m["model"].update(heads=0), "heads"),
    (lambda m: m["model"].update(heads=5), "divisible"),
    (lambda m: m["model"].update(image_size=[0, 16]), "image_size"),
    (lambda m: m["model"].update(num_classes=-1), "num_classes"),
    (lambda m: m["model"].update(dim="768"), "dim"),
    (lambda m: m["model"].update(drop_path=float("nan")), "drop_path"),
    (lambda m: m["model"].update(resnet={"layers": [1], "widht": 2}), "unknown ResNet config fields"),
    (lambda m: m.update(model=[1, 2]), "no 'model' section"),
    (lambda m: m["model"].update(depth=3), "does not fit the model its config describes: missing keys blocks.2"),
    (lambda m: m["model"].update(mlp_dim=128), "shape mismatch blocks.0.mlp.fc1.weight"),
    (lambda m: m.update(class_names=["a"]), "1 class names for a model with 3 outputs"),
    (lambda m: m["preprocess"].update(image_size=[2048, 2048]), "[2048, 2048] does not match the model's input size [16, 16]"),
    (lambda m: m["preprocess"].update(std=[0.5, 0, 0.5]), "std"),
    (lambda m: m["preprocess"].update(mean=[float("nan")] * 3), "mean"),
    (lambda m: m["preprocess"].update(crop_fraction=1e-9), "crop_fraction"),
    (lambda m: m["preprocess"].update(resize=10**9), "resize"),
])
def test_native_config_is_bounded_and_checked_against_the_weights(tmp_path, edit, words):
    folder = native_folder(tmp_path / "m", edit)
    with pytest.raises(VitlabError) as info:
        read_checkpoint(folder)  # the reader alone: nothing is built before these checks
    message = _one_line_error(info)
    assert words in message, message


def test_native_config_json_size_is_bounded(tmp_path):
    folder = native_folder(tmp_path / "m")
    with open(folder / "config.json", "r+b") as f:
        f.truncate(17 * MB)  # sparse: cheap to make, refused from its size before reading
    with pytest.raises(VitlabError, match="17 MB") as info:
        vitlab.load(folder)
    _one_line_error(info)


def _edit_weights(folder, change):
    path = folder / "model.safetensors"
    sd = load_file(str(path))
    change(sd)
    save_file(sd, str(path))


def test_nan_weights_are_refused_naming_the_first_bad_tensor(tmp_path):
    folder = native_folder(tmp_path / "m")
    _edit_weights(folder, lambda sd: sd["blocks.1.mlp.fc1.weight"].__setitem__((0, 0), float("nan")))
    with pytest.raises(VitlabError, match=r"'blocks\.1\.mlp\.fc1\.weight' holds NaN or infinite") as info:
        vitlab.load(folder)
    _one_line_error(info)
    _edit_weights(folder, lambda sd: sd.update({"blocks.1.mlp.fc1.weight": torch.zeros(64, 32),
                                                "head.bias": torch.tensor([0.0, float("inf"), 0.0])}))
    with pytest.raises(VitlabError, match="'head.bias' holds NaN or infinite"):
        vitlab.load(folder)


def test_integer_weights_for_float_parameters_are_refused(tmp_path):
    folder = native_folder(tmp_path / "m")
    _edit_weights(folder, lambda sd: sd.update({"head.weight": torch.ones(3, 32, dtype=torch.int32)}))
    with pytest.raises(VitlabError, match=r"'head.weight' is torch.int32, not floating point") as info:
        vitlab.load(folder)
    _one_line_error(info)


def test_integer_buffers_still_load(tmp_path):
    """num_batches_tracked is int64 in the model too: only float parameters must be float."""
    model = vitlab.create_model("resnet-18-small", num_classes=2, image_size=8, in_chans=1, base_width=8,
                                layers=(1,), seed=0).eval()
    save_native(model, tmp_path / "r")
    loaded = vitlab.load(tmp_path / "r")
    x = torch.randn(1, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


# -------------------------------------------------------------------------- Hugging Face folders
@pytest.mark.parametrize("edit_pre,edit_cfg,words", [
    (lambda p: p.update(size={"height": 2048, "width": 2048}), None, "[2048, 2048] does not match"),
    (lambda p: p.update(image_std=[0.5, 0.0, 0.5]), None, "std"),
    (lambda p: p.update(image_mean=[float("nan")] * 3), None, "mean"),
    (lambda p: p.update(size={"height": "big", "width": 16}), None, "preprocessor_config.json"),
    (None, lambda c: c.update(num_attention_heads=0), "heads"),
    (None, lambda c: c.update(num_hidden_layers=12), "num_hidden_layers=12 but the weights hold 2"),
    (None, lambda c: c.update(layer_norm_eps="small"), "layer_norm_eps"),
    (None, lambda c: c.update(image_size=2048), "fix image_size in config.json"),
])
def test_hf_folder_json_is_checked(tmp_path, edit_pre, edit_cfg, words):
    folder = hf_folder(tmp_path / "hf", edit_pre, edit_cfg)
    with pytest.raises(VitlabError) as info:
        load_with_meta(folder)
    message = _one_line_error(info)
    assert words in message, message


def _sharded(folder, weight_map, index="model.safetensors.index.json"):
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_hf_sharded_index_is_validated(tmp_path):
    folder = hf_folder(tmp_path / "hf")
    keys = list(load_file(str(folder / "model.safetensors")))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    good = {k: "model-00001-of-00001.safetensors" for k in keys}
    assert vitlab.load(_sharded(folder, good)).config.depth == 2
    cases = [
        ({**good, keys[0]: "../elsewhere.safetensors"}, "a shard is a .safetensors or .bin file in the same folder"),
        ({**good, keys[0]: "/etc/passwd"}, "a shard is a .safetensors or .bin file in the same folder"),
        ({**good, keys[0]: "model-00002-of-00002.safetensors"}, "is not in"),
        ({**good, "vit.extra.weight": "model-00001-of-00001.safetensors"}, "names tensors no shard holds (vit.extra.weight)"),
        ({}, "no 'weight_map'"),
    ]
    for weight_map, words in cases:
        with pytest.raises(VitlabError) as info:
            vitlab.load(_sharded(folder, weight_map))
        assert words in _one_line_error(info)


# ----------------------------------------------------------------------------------- torch files
class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickled_objects_message_never_advises_weights_only_false(tmp_path, capsys):
    import argparse

    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"head.weight": _Evil()}, f, protocol=2)  # torch's legacy format is protocol 2
    torch.save({"head.weight": torch.zeros(2), "args": argparse.Namespace(lr=0.1)}, tmp_path / "ckpt.pth")
    for name, global_name in (("evil.pth", "print"), ("ckpt.pth", "argparse.Namespace")):
        with pytest.raises(VitlabError) as info:
            vitlab.load(tmp_path / name)
        message = _one_line_error(info)
        assert f"pickled Python objects other than tensors ({global_name})" in message
        assert "never executes" in message and "safetensors" in message
        assert "False" not in message and "Re-running" not in message
    assert "pwned" not in capsys.readouterr().out
    (tmp_path / "junk.pth").write_bytes(b"not a torch file at all")
    with pytest.raises(VitlabError) as info:
        vitlab.load(tmp_path / "junk.pth")
    message = _one_line_error(info)
    assert "cannot read" in message and "False" not in message and "Re-running" not in message


def test_torch_zip_declaring_far_more_than_it_holds_is_refused(tmp_path):
    path = tmp_path / "bomb.pth"
    torch.save({"head.weight": torch.zeros(2, 2)}, path)
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        write_member(zf, "bomb/data/99", (BOMB_BYTES // 4,), zeros=BOMB_BYTES)
    err, peak = traced_peak(lambda: vitlab.load(path))
    assert isinstance(err, VitlabError) and "zip bomb" in str(err) and "\n" not in str(err)
    assert peak < 50 * MB


def test_predict_refuses_a_hostile_preprocessing_in_one_line(tmp_path, capsys):
    from PIL import Image

    from vitlab.cli import main

    folder = native_folder(tmp_path / "m", lambda m: m["preprocess"].update(image_size=[2048, 2048]))
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "x.png")
    assert main(["predict", str(folder), str(tmp_path / "x.png"), "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert "[2048, 2048]" in err and len(err.splitlines()) == 1


def test_limits_are_documented():
    from vitlab import limits

    doc = (Path(__file__).resolve().parents[1] / "docs" / "weights.md").read_text()
    for value in (limits.MAX_DEPTH, limits.MAX_WIDTH, limits.MAX_MLP_DIM, limits.MAX_IMAGE_SIZE):
        assert f"{value:,}" in doc or str(value) in doc
    assert "## Limits" in doc
