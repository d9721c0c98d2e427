"""Official .npz loading against the official Flax outputs (fixtures), and big_vision / i21k / prefix
variants written in their documented layouts. Where the fixtures have no output (gap, MAP heads), a
numpy re-implementation of the official encoder is used, itself first checked against the fixtures."""

from pathlib import Path

import numpy as np
import pytest
import torch

import vitlab
from vitlab.errors import VitlabError
from vitlab.weights import load_with_meta

FIX = Path("/work/shared/fixtures/official")
pytestmark = pytest.mark.skipif(not FIX.is_dir(), reason="official fixtures not available")
NAMINGS = ["tiny_token_linen", "tiny_token_prelinen"]
PRELINEN = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0", "LayerNorm_2": "LayerNorm_1",
            "MlpBlock_3": "MlpBlock_0"}


def _arrays(case):
    with np.load(FIX / f"{case}.npz") as f:
        return {k: f[k] for k in f.files}


def _io(case, resized=False):
    with np.load(FIX / f"{case}{'.resized' if resized else ''}.io.npz") as f:
        return {k: f[k] for k in f.files}


def _to_linen(a):
    out = {}
    for k, v in a.items():
        for old, new in PRELINEN.items():
            k = k.replace(old, new)
        out[k] = v
    return out


def _save(path, arrays):
    np.savez(path, **arrays)
    return path


def _logits(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(x, np.float32))).double().numpy()


# ---------------------------------------------------------------- numpy reference of the official encoder
def _ln(x, s, b, eps=1e-6):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * s + b


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _mha(a, p, q_in, kv_in):
    q = np.einsum("bnd,dhk->bhnk", q_in, a[p + "query/kernel"]) + a[p + "query/bias"][None, :, None]
    k = np.einsum("bnd,dhk->bhnk", kv_in, a[p + "key/kernel"]) + a[p + "key/bias"][None, :, None]
    v = np.einsum("bnd,dhk->bhnk", kv_in, a[p + "value/kernel"]) + a[p + "value/bias"][None, :, None]
    logits = np.einsum("bhqk,bhnk->bhqn", q, k) / np.sqrt(q.shape[-1])
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("bhqn,bhnk->bhqk", w, v)
    return np.einsum("bhqk,hkd->bqd", out, a[p + "out/kernel"]) + a[p + "out/bias"]


def _mlp(a, p, x):
    h = _gelu_tanh(x @ a[p + "Dense_0/kernel"] + a[p + "Dense_0/bias"])
    return h @ a[p + "Dense_1/kernel"] + a[p + "Dense_1/bias"]


def reference_forward(a, x_nchw, classifier="token", posemb_has_cls=True):
    """Official ViT (Linen names, top-level `pos_embedding` for gap/map) in float64 numpy."""
    a = {k: v.astype(np.float64) for k, v in a.items()}
    x = np.asarray(x_nchw, np.float64).transpose(0, 2, 3, 1)
    kp = a["embedding/kernel"].shape[0]
    b, h, w, c = x.shape
    patches = x.reshape(b, h // kp, kp, w // kp, kp, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, kp * kp * c)
    t = patches @ a["embedding/kernel"].reshape(-1, a["embedding/kernel"].shape[-1]) + a["embedding/bias"]
    pe = a.get("Transformer/posembed_input/pos_embedding", a.get("pos_embedding"))
    if classifier == "token":
        t = np.concatenate([np.broadcast_to(a["cls"], (b, 1, t.shape[-1])), t], axis=1)
        t = t + (pe if posemb_has_cls else np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1))
    else:
        t = t + pe
    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in a:
        p = f"Transformer/encoderblock_{i}/"
        y = _ln(t, a[p + "LayerNorm_0/scale"], a[p + "LayerNorm_0/bias"])
        t = t + _mha(a, p + "MultiHeadDotProductAttention_0/", y, y)
        y = _ln(t, a[p + "LayerNorm_1/scale"], a[p + "LayerNorm_1/bias"])
        t = t + _mlp(a, p + "MlpBlock_0/", y)
        i += 1
    t = _ln(t, a["Transformer/encoder_norm/scale"], a["Transformer/encoder_norm/bias"])
    if classifier == "token":
        pooled = t[:, 0]
    elif classifier == "gap":
        pooled = t.mean(1)
    else:
        p = "MAPHead_0/"
        probe = np.broadcast_to(a[p + "probe"], (b, 1, t.shape[-1]))
        y = _mha(a, p + "MultiHeadDotProductAttention_0/", probe, t)
        y = y + _mlp(a, p + "MlpBlock_0/", _ln(y, a[p + "LayerNorm_0/scale"], a[p + "LayerNorm_0/bias"]))
        pooled = y[:, 0]
    if "pre_logits/kernel" in a:
        pooled = np.tanh(pooled @ a["pre_logits/kernel"] + a["pre_logits/bias"])
    return pooled @ a["head/kernel"] + a["head/bias"]


def test_numpy_reference_reproduces_the_official_fixture():
    for case in NAMINGS:
        io = _io(case)
        ref = reference_forward(_to_linen(_arrays(case)), io["input_nchw"])
        assert np.abs(ref - io["logits"]).max() < 1e-4


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("case", NAMINGS)
def test_official_fixture_logits(case):
    io = _io(case)
    model, meta = load_with_meta(FIX / f"{case}.npz")
    assert meta["format"] == "official"
    assert np.abs(_logits(model, io["input_nchw"]) - io["logits"]).max() < 1e-5
    assert tuple(meta["preprocess"].mean) == (0.5, 0.5, 0.5) and meta["preprocess"].resize is None


@pytest.mark.parametrize("case", NAMINGS)
def test_official_fixture_resized(case):
    io = _io(case, resized=True)
    size = int(io["image_size"])
    model, meta = load_with_meta(FIX / f"{case}.npz", image_size=size)
    assert model.config.image_size == (size, size) and tuple(meta["preprocess"].image_size) == (size, size)
    assert np.abs(_logits(model, io["input_nchw"]) - io["logits"]).max() < 1e-5


@pytest.mark.parametrize("prefix", ["opt/target/", "params/"])
def test_prefixes(tmp_path, prefix):
    a = _arrays("tiny_token_prelinen")
    path = _save(tmp_path / "p.npz", {prefix + k: v for k, v in a.items()})
    io = _io("tiny_token_prelinen")
    assert np.abs(_logits(vitlab.load(path), io["input_nchw"]) - io["logits"]).max() < 1e-5


def _big_vision_token(a, stacked=False):
    """The fixture re-written as big_vision stores it: posemb without a class slot, that slot summed into cls."""
    a = _to_linen(a)
    pe = a.pop("Transformer/posembed_input/pos_embedding")
    a["cls"] = a["cls"] + pe[:, :1]
    a["pos_embedding"] = pe[:, 1:]
    if stacked:
        keys = sorted({k.split("/", 2)[2] for k in a if k.startswith("Transformer/encoderblock_")})
        depth = 1 + max(int(k.split("/")[1].split("_")[1]) for k in a if k.startswith("Transformer/encoderblock_"))
        for rest in keys:
            a[f"Transformer/encoderblock/{rest}"] = np.stack([a.pop(f"Transformer/encoderblock_{i}/{rest}") for i in range(depth)])
    return a


@pytest.mark.parametrize("stacked", [False, True])
def test_big_vision_token_layout_gives_the_official_logits(tmp_path, stacked):
    io = _io("tiny_token_linen")
    path = _save(tmp_path / "bv.npz", {"params/" + k: v for k, v in _big_vision_token(_arrays("tiny_token_linen"), stacked).items()})
    model, meta = load_with_meta(path)
    assert meta["format"] == "big_vision"
    assert np.abs(_logits(model, io["input_nchw"]) - io["logits"]).max() < 1e-5
    io = _io("tiny_token_linen", resized=True)  # resampling keeps the class slot out of the grid, as BV
    model = vitlab.load(path, image_size=int(io["image_size"]))
    assert np.abs(_logits(model, io["input_nchw"]) - io["logits"]).max() < 1e-5


def test_big_vision_bf16_arrays_load_as_their_exact_float32(tmp_path):
    """JAX's bf16 arrays are stored in an .npz as 2-byte voids (numpy has no bfloat16); they were refused as "not
    floating point". They load widened to float32, exactly: as the same weights saved as float32."""
    bits = {"params/" + k: (np.ascontiguousarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint16)
            for k, v in _big_vision_token(_arrays("tiny_token_linen")).items()}
    as_bf16 = _save(tmp_path / "bf16.npz", {k: b.view("V2") for k, b in bits.items()})
    as_f32 = _save(tmp_path / "f32.npz", {k: (b.astype(np.uint32) << 16).view(np.float32) for k, b in bits.items()})
    with np.load(as_bf16) as f:
        assert f["params/embedding/kernel"].dtype == np.dtype("V2")  # what numpy writes for ml_dtypes' bfloat16
    model, meta = load_with_meta(as_bf16)
    assert meta["format"] == "big_vision"
    reference = vitlab.load(as_f32).state_dict()
    assert all(torch.equal(t, reference[k]) and t.dtype == torch.float32 for k, t in model.state_dict().items())
    io = _io("tiny_token_linen")  # bf16 weights: the official logits within bf16's rounding
    assert np.abs(_logits(model, io["input_nchw"]) - io["logits"]).max() < 0.05 * np.abs(io["logits"]).max()


def _big_vision_headless(a, kind, rng):
    a = _big_vision_token(a)
    a.pop("cls")
    if kind == "map":
        d, h = 64, 4
        p = "MAPHead_0/"
        a[p + "probe"] = rng.normal(size=(1, 1, d)).astype(np.float32)
        for n in ("query", "key", "value"):
            a[f"{p}MultiHeadDotProductAttention_0/{n}/kernel"] = rng.normal(0, 0.2, (d, h, d // h)).astype(np.float32)
            a[f"{p}MultiHeadDotProductAttention_0/{n}/bias"] = rng.normal(0, 0.2, (h, d // h)).astype(np.float32)
        a[p + "MultiHeadDotProductAttention_0/out/kernel"] = rng.normal(0, 0.2, (h, d // h, d)).astype(np.float32)
        a[p + "MultiHeadDotProductAttention_0/out/bias"] = rng.normal(0, 0.2, (d,)).astype(np.float32)
        a[p + "LayerNorm_0/scale"] = rng.normal(1, 0.2, (d,)).astype(np.float32)
        a[p + "LayerNorm_0/bias"] = rng.normal(0, 0.2, (d,)).astype(np.float32)
        a[p + "MlpBlock_0/Dense_0/kernel"] = rng.normal(0, 0.2, (d, 128)).astype(np.float32)
        a[p + "MlpBlock_0/Dense_0/bias"] = rng.normal(0, 0.2, (128,)).astype(np.float32)
        a[p + "MlpBlock_0/Dense_1/kernel"] = rng.normal(0, 0.2, (128, d)).astype(np.float32)
        a[p + "MlpBlock_0/Dense_1/bias"] = rng.normal(0, 0.2, (d,)).astype(np.float32)
    return a


@pytest.mark.parametrize("kind", ["gap", "map"])
def test_big_vision_gap_and_map_heads(tmp_path, kind):
    a = _big_vision_headless(_arrays("tiny_token_linen"), kind, np.random.default_rng(0))
    x = _io("tiny_token_linen")["input_nchw"]
    model = vitlab.load(_save(tmp_path / f"{kind}.npz", a))
    assert model.config.classifier == kind and model.cls_token is None
    assert np.abs(_logits(model, x) - reference_forward(a, x, classifier=kind)).max() < 1e-5


def test_i21k_pre_logits_zero_head_and_surgery(tmp_path):
    rng = np.random.default_rng(1)
    a = _arrays("tiny_token_prelinen")
    a["pre_logits/kernel"] = rng.normal(0, 0.2, (64, 64)).astype(np.float32)
    a["pre_logits/bias"] = rng.normal(0, 0.2, (64,)).astype(np.float32)
    a["head/kernel"] = np.zeros((64, 21843), np.float32)
    a["head/bias"] = np.zeros((21843,), np.float32)
    path = _save(tmp_path / "ViT-tiny-i21k.npz", a)
    x = _io("tiny_token_prelinen")["input_nchw"]
    model, meta = load_with_meta(path)
    assert model.config.num_classes == 21843 and model.config.representation_size == 64 and meta["zero_head"]
    with torch.no_grad():  # pre-logits (representation) agree with the numpy reference
        ref_a = dict(_to_linen(a))
        ref_a["head/kernel"], ref_a["head/bias"] = np.eye(64, dtype=np.float32), np.zeros(64, np.float32)
        feats = model.forward_head(model.forward_features(torch.from_numpy(x)), pre_logits=True).double().numpy()
        assert np.abs(feats - reference_forward(ref_a, x)).max() < 1e-5
    tuned = vitlab.load(path, num_classes=7, image_size=48)  # paper B.1.1 + 3.2
    assert tuned.pre_logits is None and tuned.head.weight.shape == (7, 64)
    assert not tuned.head.weight.any() and not tuned.head.bias.any()
    assert tuned.pos_embed.shape == (1, 1 + 36, 64)
    kept = vitlab.load(path, num_classes=7, keep_representation=True)
    assert kept.pre_logits is not None and kept.head.weight.shape == (7, 64)


def test_official_errors(tmp_path):
    with pytest.raises(VitlabError, match="not an official"):
        vitlab.load(_save(tmp_path / "other.npz", {"foo": np.zeros(3)}))
    a = _arrays("tiny_token_linen")
    del a["Transformer/encoderblock_1/LayerNorm_0/scale"]
    with pytest.raises(VitlabError, match="LayerNorm_0/scale"):
        vitlab.load(_save(tmp_path / "partial.npz", a))
    data = (FIX / "tiny_token_linen.npz").read_bytes()
    (tmp_path / "trunc.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(VitlabError, match="complete"):
        vitlab.load(tmp_path / "trunc.npz")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    import zipfile

    with zipfile.ZipFile(tmp_path / "pickled.npz", "w") as z:
        z.write(tmp_path / "obj.npy", "embedding/kernel.npy")
    with pytest.raises(VitlabError):
        vitlab.load(tmp_path / "pickled.npz")
