"""The outside audit's second round of reader findings, each a one-line refusal or a correct load now:
extra or doubled arrays in official `.npz` files (while what genuine checkpoints carry beside their parameters
still loads), tensors no reader can hold (float8, sparse, meta), Hugging Face preprocessing and labels read as
transformers reads them, unreadable and renamed files, `vitlab convert` and what is already at DST, and the
subpackages reachable after a plain `import vitlab`."""

import builtins
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import vitlab
from test_weights_hostile import hf_folder, official_arrays, tiny_model
from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.weights import load_with_meta, save_native

FIX = Path("/work/shared/fixtures/official")
needs_fixtures = pytest.mark.skipif(not FIX.is_dir(), reason="official fixtures not available")


def refusal(fn, *args, **kwargs) -> str:
    """The one-line VitlabError message `fn` must end in."""
    with pytest.raises(VitlabError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def fixture(case):
    with np.load(FIX / f"{case}.npz") as f:
        arrays = {k: f[k] for k in f.files}
    with np.load(FIX / f"{case}.io.npz") as f:
        return arrays, torch.from_numpy(f["input_nchw"].astype(np.float32)), f["logits"]


def logits(path, x, **kw):
    with torch.no_grad():
        return vitlab.load(path, **kw)(x).numpy()


# ------------------------------------------------------------------- 1. official .npz: extra arrays
@needs_fixtures
@pytest.mark.parametrize("case,extra", [
    ("tiny_token_prelinen", "Transformer/encoderblock_0/MlpBlock_3/Dense_2/kernel"),
    ("tiny_token_linen", "foo"),
])
def test_official_npz_with_an_unknown_array_is_refused_naming_it(tmp_path, case, extra):
    arrays, _, _ = fixture(case)
    np.savez(tmp_path / "x.npz", **arrays, **{extra: np.zeros((4, 4), np.float32)})
    message = refusal(vitlab.load, tmp_path / "x.npz")
    assert extra in message and "does not use" in message and str(tmp_path / "x.npz") in message


def test_official_npz_listing_many_extras_names_a_few_and_the_count(tmp_path):
    np.savez(tmp_path / "x.npz", **official_arrays(), **{f"junk/{i}": np.zeros(2, np.float32) for i in range(5)})
    message = refusal(vitlab.load, tmp_path / "x.npz")
    assert "junk/0, junk/1, junk/2 ... (5 in all)" in message


@needs_fixtures
def test_a_depth_override_no_longer_drops_blocks_silently(tmp_path):
    # depth=1 on a 2-block file used to build a 1-block model and ignore encoderblock_1 without a word
    message = refusal(vitlab.load, FIX / "tiny_token_linen.npz", depth=1)
    assert "Transformer/encoderblock_1/" in message


def test_two_parameter_sets_in_one_file_are_refused_as_ambiguous(tmp_path):
    a = official_arrays()
    other = official_arrays(seed=1)
    np.savez(tmp_path / "two.npz", **a, **{"params/" + k: v for k, v in other.items()})
    message = refusal(vitlab.load, tmp_path / "two.npz")
    assert "2 ViT parameter sets" in message and "'unprefixed', 'params/'" in message
    np.savez(tmp_path / "two2.npz", **{"opt/target/" + k: v for k, v in a.items()},
             **{"params/" + k: v for k, v in other.items()})
    assert "ambiguous" in refusal(vitlab.load, tmp_path / "two2.npz")


@needs_fixtures
@pytest.mark.parametrize("layout", ["flax-optimizer", "big_vision-train-state", "two-tower"])
def test_what_genuine_checkpoints_carry_beside_the_parameters_still_loads(tmp_path, layout):
    """Flax optimizer checkpoints (`opt/target/` + `opt/state/...`), big_vision train states (`params/` + optax
    `opt/...` + `chrono/...`) and two-tower files (`params/img/` + `params/txt/...`, `params/t`, `params/b`)
    give the official logits; the extra arrays are not read."""
    arrays, x, ref = fixture("tiny_token_prelinen")
    zeros = np.zeros((3,), np.float32)
    if layout == "flax-optimizer":
        out = {"opt/target/" + k: v for k, v in arrays.items()}
        out.update({"opt/state/step": np.int64(7) * np.ones((), np.int64),
                    "opt/state/param_states/embedding/kernel/momentum": np.zeros_like(arrays["embedding/kernel"])})
    elif layout == "big_vision-train-state":
        out = {"params/" + k: v for k, v in arrays.items()}
        out.update({"opt/0/count": np.ones((), np.int32), "opt/1/0/mu/embedding/kernel": arrays["embedding/kernel"],
                    "chrono/accum_train_time": np.ones((), np.float64)})
    else:
        out = {"params/img/" + k: v for k, v in arrays.items()}
        out.update({"params/txt/Encoder_0/encoder_norm/scale": zeros, "params/t": zeros[:1], "params/b": zeros[:1]})
    np.savez(tmp_path / "x.npz", **out)
    assert np.abs(logits(tmp_path / "x.npz", x) - ref).max() < 1e-5


@needs_fixtures
def test_prefixed_file_with_junk_outside_its_parameter_set_is_refused(tmp_path):
    arrays, _, _ = fixture("tiny_token_linen")
    np.savez(tmp_path / "x.npz", **{"params/" + k: v for k, v in arrays.items()}, foo=np.zeros(2, np.float32))
    assert "foo" in refusal(vitlab.load, tmp_path / "x.npz")


@needs_fixtures
@pytest.mark.parametrize("case", ["tiny_token_linen", "tiny_token_prelinen"])
def test_every_official_fixture_still_loads_exactly(case):
    _, x, ref = fixture(case)
    assert np.abs(logits(FIX / f"{case}.npz", x) - ref).max() < 1e-5


# ------------------------------------------------------------- 2. tensors no reader can hold
def test_native_folder_with_a_float8_tensor_is_refused_naming_it(tmp_path):
    save_native(tiny_model(), tmp_path / "m")
    sd = load_file(tmp_path / "m" / "model.safetensors")
    sd["head.weight"] = sd["head.weight"].to(torch.float8_e4m3fn)
    save_file(sd, tmp_path / "m" / "model.safetensors")
    message = refusal(vitlab.load, tmp_path / "m")
    assert "'head.weight'" in message and "float8_e4m3fn" in message


@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_pth_with_a_sparse_or_meta_tensor_is_refused_naming_it(tmp_path, kind):
    sd = tiny_model().state_dict()
    if kind == "sparse":
        sd["head.weight"] = sd["head.weight"].to_sparse()
    else:
        sd["head.weight"] = torch.empty(sd["head.weight"].shape, device="meta")
    torch.save(sd, tmp_path / "x.pth")
    message = refusal(vitlab.load, tmp_path / "x.pth", heads=4, classifier="token")
    assert "'head.weight'" in message and ("sparse" in message if kind == "sparse" else "meta tensor" in message)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_half_bfloat16_and_double_weights_keep_loading(tmp_path, dtype):
    model = tiny_model()
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    torch.save(sd, tmp_path / "x.pth")
    save_native(model, tmp_path / "m")
    save_file(sd, tmp_path / "m" / "model.safetensors")
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        want = model.to(dtype).float()(x)
        for path, kw in ((tmp_path / "x.pth", {"heads": 4, "classifier": "token"}), (tmp_path / "m", {})):
            assert torch.allclose(vitlab.load(path, **kw)(x), want, atol=1e-5)


# ------------------------------------------------ 3. Hugging Face preprocessing and labels
def _hf_affine(pp):
    """transformers' (x * r - mean) / std on pixel values 0..255, as (scale, offset) per channel."""
    r = pp.get("rescale_factor", 1 / 255) if pp.get("do_rescale", True) else 1.0
    mean = np.array(pp["image_mean"]) if pp.get("do_normalize", True) else np.zeros(3)
    std = np.array(pp["image_std"]) if pp.get("do_normalize", True) else np.ones(3)
    return r / std, -mean / std


@pytest.mark.parametrize("edit", [
    {"do_rescale": False},
    {"rescale_factor": 1 / 127.5, "do_normalize": False},
    {"rescale_factor": 1 / 127.5, "image_mean": [1.0, 1.0, 1.0], "image_std": [1.0, 1.0, 1.0]},
])
def test_hf_rescale_settings_are_reproduced_not_ignored(tmp_path, edit):
    from vitlab.data.preprocess import normalize_batch

    folder = hf_folder(tmp_path / "hf", edit_pre=lambda p: p.update(edit))
    pp = json.loads((folder / "preprocessor_config.json").read_text())
    _, meta = load_with_meta(folder)
    x = torch.arange(0, 256, dtype=torch.float64).repeat(3, 1).view(1, 3, 16, 16)
    ours = normalize_batch(x, meta["preprocess"].mean, meta["preprocess"].std)
    scale, offset = _hf_affine(pp)
    theirs = x * torch.tensor(scale).view(1, 3, 1, 1) + torch.tensor(offset).view(1, 3, 1, 1)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6 * float(theirs.abs().max()))


@pytest.mark.parametrize("edit,words", [
    ({"resample": 99}, "resample 99"),
    ({"resample": "bilinear"}, "resample 'bilinear'"),
    ({"rescale_factor": 0}, "rescale_factor 0"),
    ({"rescale_factor": "1/255"}, "rescale_factor '1/255'"),
    ({"do_rescale": "no"}, "do_rescale 'no'"),
])
def test_hf_preprocessing_vitlab_cannot_reproduce_is_refused(tmp_path, edit, words):
    folder = hf_folder(tmp_path / "hf", edit_pre=lambda p: p.update(edit))
    message = refusal(vitlab.load, folder)
    assert words in message and "preprocessor_config.json" in message


def test_hf_id2label_keys_are_read_with_int_like_transformers(tmp_path):
    folder = hf_folder(tmp_path / "hf", edit_cfg=lambda c: c.update(id2label={"00": "cat", "01": "dog", "02": "fox"}))
    assert load_with_meta(folder)[1]["class_names"] == ["cat", "dog", "fox"]
    transformers = pytest.importorskip("transformers")
    assert transformers.ViTConfig.from_pretrained(folder).id2label == {0: "cat", 1: "dog", 2: "fox"}


@pytest.mark.parametrize("id2label,words", [
    ({"a": "cat", "b": "dog", "c": "fox"}, "key 'a', not an integer"),
    ({"0": "cat", "1": "dog"}, "2 labels but the classifier has 3"),
    ({"0": "cat", "1": "dog", "3": "fox"}, "no name for [2]"),
    ({"0": "cat", "00": "cat2", "1": "dog", "2": "fox"}, "names class 0 twice"),
    (["cat", "dog", "fox"], "must be an object"),
])
def test_hf_id2label_that_does_not_name_each_class_once_is_refused(tmp_path, id2label, words):
    folder = hf_folder(tmp_path / "hf", edit_cfg=lambda c: c.update(id2label=id2label))
    assert words in refusal(vitlab.load, folder)


# ------------------------------------------------------ 4. unreadable and renamed files
def _deny(monkeypatch, target):
    """Make `open` on `target` fail as on a chmod 000 file (the tests may run as root, which chmod cannot stop)."""
    real = builtins.open

    def fake(file, *args, **kwargs):
        if Path(str(file)) == Path(target):
            raise PermissionError(13, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake)


@pytest.mark.parametrize("layout", ["native", "hf", "pth", "npz"])
def test_an_unreadable_weights_file_is_reported_as_permission_denied(tmp_path, monkeypatch, layout):
    model = tiny_model()
    if layout == "native":
        target = save_native(model, tmp_path / "m") / "model.safetensors"
    elif layout == "hf":
        target = hf_folder(tmp_path / "m") / "model.safetensors"
    elif layout == "pth":
        target = tmp_path / "m.pth"
        torch.save(model.state_dict(), target)
    else:
        target = tmp_path / "m.npz"
        np.savez(target, **official_arrays())
    _deny(monkeypatch, target)
    message = refusal(vitlab.load, target.parent if layout in ("native", "hf") else target)
    assert "permission denied" in message and str(target) in message and "complete" not in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file")
def test_a_chmod_000_file_is_reported_as_permission_denied(tmp_path):
    folder = save_native(tiny_model(), tmp_path / "m")
    (folder / "model.safetensors").chmod(0)
    try:
        assert "permission denied" in refusal(vitlab.load, folder)
    finally:
        (folder / "model.safetensors").chmod(0o644)


def test_safetensors_named_pth_and_pickle_named_safetensors_load_by_content(tmp_path):
    model = tiny_model()
    sd = model.state_dict()
    save_file(sd, tmp_path / "st.pth")
    torch.save(sd, tmp_path / "pk.safetensors")
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        for path in (tmp_path / "st.pth", tmp_path / "pk.safetensors"):
            assert torch.equal(vitlab.load(path, heads=4, classifier="token")(x), model(x))


def test_vitlab_timm_export_renamed_keeps_its_record(tmp_path):
    # the record (heads, pooling, class names) lives in the safetensors header: a rename to .pth keeps it
    vitlab.weights.save_timm(tiny_model(), tmp_path / "t.safetensors", class_names=["a", "b", "c"])
    (tmp_path / "t.safetensors").rename(tmp_path / "t.pth")
    assert load_with_meta(tmp_path / "t.pth")[1]["class_names"] == ["a", "b", "c"]


def test_native_folder_whose_model_safetensors_is_a_pickle_says_so(tmp_path):
    folder = save_native(tiny_model(), tmp_path / "m")
    torch.save(tiny_model().state_dict(), folder / "model.safetensors")
    message = refusal(vitlab.load, folder)
    assert "PyTorch file (torch.save), not safetensors" in message and "header too large" not in message


# ------------------------------------------------------------ 5. convert and what is at DST
@pytest.fixture
def src(tmp_path):
    return str(save_native(tiny_model(), tmp_path / "src", class_names=["a", "b", "c"]))


def test_convert_refuses_a_non_empty_folder_without_force(tmp_path, src, capsys):
    dst = tmp_path / "important"
    dst.mkdir()
    (dst / "config.json").write_text("{\"mine\": 1}")
    (dst / "notes.txt").write_text("keep")
    assert main(["convert", src, str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert json.loads((dst / "config.json").read_text()) == {"mine": 1}
    assert main(["convert", src, str(dst), "--quiet", "--force"]) == 0
    assert (dst / "notes.txt").read_text() == "keep" and vitlab.load(dst) is not None
    assert main(["convert", src, str(tmp_path / "empty"), "--quiet"]) == 0  # a new folder needs nothing


def test_convert_refuses_an_existing_timm_file_without_force(tmp_path, src, capsys):
    dst = tmp_path / "exist.safetensors"
    dst.write_bytes(b"unrelated")
    assert main(["convert", src, str(dst), "--to", "timm", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and dst.read_bytes() == b"unrelated"
    assert main(["convert", src, str(dst), "--to", "timm", "--quiet", "--force"]) == 0
    assert vitlab.load(dst) is not None
    sidecar = tmp_path / "x.pth.vitlab.json"
    sidecar.write_text("mine")  # a .pth writes its sidecar too: that counts as DST
    assert main(["convert", src, str(tmp_path / "x.pth"), "--to", "timm", "--quiet"]) == 2
    assert sidecar.read_text() == "mine"


@pytest.mark.parametrize("to,name", [("timm", "evil.pth"), ("timm", "evil.safetensors"), ("native", "evil")])
def test_convert_never_writes_through_a_link(tmp_path, src, capsys, to, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dst = tmp_path / name
    dst.symlink_to(victim)
    assert main(["convert", src, str(dst), "--to", to, "--quiet"]) == 2
    assert "link" in capsys.readouterr().err and victim.read_text() == "precious"
    assert main(["convert", src, str(dst), "--to", to, "--quiet", "--force"]) == 0
    assert victim.read_text() == "precious" and not dst.is_symlink()  # the link itself was replaced
    assert vitlab.load(dst) is not None


def test_convert_force_into_a_folder_replaces_linked_model_files_not_their_targets(tmp_path, src):
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "config.json").symlink_to(victim)
    assert main(["convert", src, str(dst), "--quiet", "--force"]) == 0
    assert victim.read_text() == "precious" and not (dst / "config.json").is_symlink()


# ----------------------------------------------------------------- 6. subpackages as attributes
def test_documented_subpackages_are_attributes_after_a_plain_import():
    code = ("import sys, vitlab\n"
            "assert 'torch' not in sys.modules  # import vitlab stays light\n"
            "assert callable(vitlab.weights.load_with_meta)\n"
            "assert vitlab.data.__name__ == 'vitlab.data'\n"
            "assert 'weights' in dir(vitlab)\n"
            "try:\n    vitlab.no_such_thing\nexcept AttributeError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "ok"


# ------------------------------------------------------------------- files named as something they are not
def test_an_npz_is_read_as_one_whatever_its_name_and_what_is_not_one_is_said(tmp_path):
    """Random bytes named .npz got numpy's text inviting allow_pickle=True; an .npz named .pth or .safetensors
    got torch's 'Expected hasRecord("version")'; a safetensors file named .npz was refused as a pickle."""
    from safetensors.torch import save_file as save_st

    arrays = official_arrays()
    np.savez(tmp_path / "real.npz", **arrays)
    x = torch.randn(2, 3, 8, 8)
    expected = logits(tmp_path / "real.npz", x)
    for name in ("as.pth", "as.safetensors", "as.bin"):
        (tmp_path / name).write_bytes((tmp_path / "real.npz").read_bytes())
        assert np.array_equal(logits(tmp_path / name, x), expected), name
    # seeded: os.urandom began with a pickle's 0x80 (or a zip's 'PK') about once in 256 runs, another refusal
    garbage = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert garbage[:1] != b"\x80" and garbage[:2] != b"PK"
    (tmp_path / "garbage.npz").write_bytes(garbage)
    message = refusal(vitlab.load, tmp_path / "garbage.npz")
    assert "is not an .npz" in message and "allow_pickle" not in message
    model = tiny_model()
    with torch.no_grad():  # every weight random: a zero head would give equal logits for any reading
        for p in model.parameters():
            p.normal_(0, 0.3)
    save_st({k: v.contiguous() for k, v in vitlab.weights.timm.to_timm_state_dict(model).items()},
            tmp_path / "st.npz")
    # a safetensors file named .npz, read as the bare timm file it is
    back = vitlab.load(tmp_path / "st.npz", classifier="token", heads=4, gelu="tanh").eval()
    with torch.no_grad():
        y = torch.randn(1, 3, 16, 16)
        assert torch.equal(back(y), model(y)) and model(y).abs().max() > 0.1


def test_a_folder_whose_config_json_does_not_parse_says_so(tmp_path):
    folder = hf_folder(tmp_path / "hf")
    (folder / "config.json").write_text("{'model_type': 'vit'}")
    message = refusal(vitlab.load, folder)
    assert "config.json is not valid JSON" in message
