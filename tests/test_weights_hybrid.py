"""Hybrid (BiT ResNet stem + ViT) official .npz files: key mapping, GroupNorm (1,1,1,C) squeezing and
config inference. Numerics against a numpy re-implementation of the official StdConv + GroupNorm +
'SAME' padding written here from the reference (official-vit.md 1.2), not from vitlab's code."""

import math

import numpy as np
import pytest
import torch

import vitlab
from vitlab.models.registry import count_parameters, get_config
from vitlab.weights import official

# ------------------------------------------------------------------------- numpy reference (NHWC)


def _same_pads(n, k, s):
    out = -(-n // s)
    total = max((out - 1) * s + k - n, 0)
    return total // 2, total - total // 2


def np_conv(x, w, stride):
    """TF-'SAME' convolution of x (H, W, Cin) with a flax HWIO kernel."""
    k = w.shape[0]
    (t, b), (lft, r) = _same_pads(x.shape[0], k, stride), _same_pads(x.shape[1], k, stride)
    x = np.pad(x, ((t, b), (lft, r), (0, 0)))
    win = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(0, 1))[::stride, ::stride]  # (Ho, Wo, C, k, k)
    return np.einsum("hwcij,ijco->hwo", win, w)


def np_std_conv(x, w, stride):
    w = (w - w.mean(axis=(0, 1, 2))) / (w.std(axis=(0, 1, 2)) + 1e-5)
    return np_conv(x, w, stride)


def np_group_norm(x, scale, bias, groups=32, eps=1e-6):
    h, w, c = x.shape
    g = x.reshape(h, w, groups, c // groups)
    m = g.mean(axis=(0, 1, 3), keepdims=True)
    v = g.var(axis=(0, 1, 3), keepdims=True)
    return ((g - m) / np.sqrt(v + eps)).reshape(h, w, c) * scale.reshape(-1) + bias.reshape(-1)


def np_max_pool_same(x, k=3, s=2):
    (t, b), (lft, r) = _same_pads(x.shape[0], k, s), _same_pads(x.shape[1], k, s)
    x = np.pad(x, ((t, b), (lft, r), (0, 0)), constant_values=-np.inf)
    return np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(0, 1))[::s, ::s].max(axis=(-1, -2))


def np_unit(a, p, x, stride):
    relu = lambda z: np.maximum(z, 0)  # noqa: E731
    if p + "conv_proj/kernel" in a:
        residual = np_group_norm(np_std_conv(x, a[p + "conv_proj/kernel"], stride), a[p + "gn_proj/scale"], a[p + "gn_proj/bias"])
    else:
        residual = x
    y = relu(np_group_norm(np_std_conv(x, a[p + "conv1/kernel"], 1), a[p + "gn1/scale"], a[p + "gn1/bias"]))
    y = relu(np_group_norm(np_std_conv(y, a[p + "conv2/kernel"], stride), a[p + "gn2/scale"], a[p + "gn2/bias"]))
    y = np_group_norm(np_std_conv(y, a[p + "conv3/kernel"], 1), a[p + "gn3/scale"], a[p + "gn3/bias"])
    return relu(residual + y)


def np_stem(a, x_hwc, layers):
    y = np_std_conv(x_hwc, a["conv_root/kernel"], 2)
    y = np.maximum(np_group_norm(y, a["gn_root/scale"], a["gn_root/bias"]), 0)
    y = np_max_pool_same(y)
    for s, n in enumerate(layers):
        for u in range(n):
            y = np_unit(a, f"block{s + 1}/unit{u + 1}/", y, 2 if (s > 0 and u == 0) else 1)
    return y


# ------------------------------------------------------------------- official hybrid layout, random


def hybrid_arrays(layers, rng, dim=64, depth=1, heads=4, mlp=128, patch=1, grid=2, width=64, classes=10,
                  gn_4d=True, zeros=False):
    """An official hybrid checkpoint: the keys of official-vit.md 2.2 ("Hybrid keys") + the ViT keys."""
    def arr(*shape, loc=0.0):
        if zeros:
            return np.broadcast_to(np.float32(0), shape)
        return (loc + rng.normal(0, 0.5, shape)).astype(np.float32)

    def gn(c):
        shape = (1, 1, 1, c) if gn_4d else (c,)
        return arr(*shape, loc=1.0), arr(*shape)

    a = {"conv_root/kernel": arr(7, 7, 3, width)}
    a["gn_root/scale"], a["gn_root/bias"] = gn(width)
    chans = width
    for s, n in enumerate(layers):
        f = width * 2**s
        for u in range(n):
            p = f"block{s + 1}/unit{u + 1}/"
            cin = chans if u == 0 else 4 * f
            a[p + "conv1/kernel"], a[p + "conv2/kernel"], a[p + "conv3/kernel"] = arr(1, 1, cin, f), arr(3, 3, f, f), arr(1, 1, f, 4 * f)
            for r, c in ((1, f), (2, f), (3, 4 * f)):
                a[f"{p}gn{r}/scale"], a[f"{p}gn{r}/bias"] = gn(c)
            if u == 0:
                a[p + "conv_proj/kernel"] = arr(1, 1, cin, 4 * f)
                a[p + "gn_proj/scale"], a[p + "gn_proj/bias"] = gn(4 * f)
        chans = 4 * f
    a["embedding/kernel"], a["embedding/bias"] = arr(patch, patch, chans, dim), arr(dim)
    a["cls"] = arr(1, 1, dim)
    a["Transformer/posembed_input/pos_embedding"] = arr(1, grid * grid + 1, dim)
    for i in range(depth):
        p = f"Transformer/encoderblock_{i}/"
        for ln in ("LayerNorm_0", "LayerNorm_2"):
            a[f"{p}{ln}/scale"], a[f"{p}{ln}/bias"] = arr(dim, loc=1.0), arr(dim)
        m = p + "MultiHeadDotProductAttention_1/"
        for n in ("query", "key", "value"):
            a[f"{m}{n}/kernel"], a[f"{m}{n}/bias"] = arr(dim, heads, dim // heads), arr(heads, dim // heads)
        a[m + "out/kernel"], a[m + "out/bias"] = arr(heads, dim // heads, dim), arr(dim)
        a[p + "MlpBlock_3/Dense_0/kernel"], a[p + "MlpBlock_3/Dense_0/bias"] = arr(dim, mlp), arr(mlp)
        a[p + "MlpBlock_3/Dense_1/kernel"], a[p + "MlpBlock_3/Dense_1/bias"] = arr(mlp, dim), arr(dim)
    a["Transformer/encoder_norm/scale"], a["Transformer/encoder_norm/bias"] = arr(dim, loc=1.0), arr(dim)
    if classes:
        a["head/kernel"], a["head/bias"] = arr(dim, classes), arr(classes)
    return a


@pytest.mark.parametrize("layers,patch,size", [((1, 1), 1, 32), ((), 8, 64), ((2,), 1, 24)])
def test_hybrid_stem_matches_numpy_reference(tmp_path, layers, patch, size):
    rng = np.random.default_rng(0)
    reduction = 4 * 2 ** max(len(layers) - 1, 0)
    grid = size // (reduction * patch)
    a = hybrid_arrays(layers, rng, patch=patch, grid=grid)
    np.savez(tmp_path / "hybrid.npz", **{"opt/target/" + k: v for k, v in a.items()})  # GN stored (1,1,1,C)
    model = vitlab.load(tmp_path / "hybrid.npz")
    assert model.config.resnet.layers == layers and model.config.patch_size == patch
    assert model.config.image_size == (size, size)
    x = rng.uniform(-1, 1, (2, 3, size, size)).astype(np.float32)
    with torch.no_grad():
        feats = model.patch_embed.backbone(torch.from_numpy(x)).numpy()
        tokens, _ = model.patch_embed(torch.from_numpy(x))
    for i in range(2):
        ref = np_stem({k: v.astype(np.float64) for k, v in a.items()}, x[i].transpose(1, 2, 0).astype(np.float64), layers)
        assert feats.shape[1:] == (ref.shape[2], ref.shape[0], ref.shape[1])
        scale = np.abs(ref).max()
        assert np.abs(feats[i].transpose(1, 2, 0) - ref).max() < 1e-4 * max(scale, 1)
        emb = np_conv_patches(ref, a["embedding/kernel"].astype(np.float64), patch) + a["embedding/bias"]
        assert np.abs(tokens[i].numpy() - emb.reshape(-1, emb.shape[-1])).max() < 1e-3


def np_conv_patches(x, w, p):
    h, wd, c = x.shape
    patches = x.reshape(h // p, p, wd // p, p, c).transpose(0, 2, 1, 3, 4).reshape(h // p, wd // p, -1)
    return patches @ w.reshape(-1, w.shape[-1])


def test_group_norm_shapes_c_and_1111_give_the_same_model(tmp_path):
    a4 = hybrid_arrays((1,), np.random.default_rng(3), grid=2, gn_4d=True)
    a1 = {k: (v.reshape(-1) if v.ndim == 4 and v.shape[:3] == (1, 1, 1) and "gn" in k else v) for k, v in a4.items()}
    np.savez(tmp_path / "a4.npz", **a4)
    np.savez(tmp_path / "a1.npz", **a1)
    m4, m1 = vitlab.load(tmp_path / "a4.npz"), vitlab.load(tmp_path / "a1.npz")
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(m4(x), m1(x))


# The paper's hybrids: (registry name, ResNet layers, base ViT (dim, depth, heads, mlp), patch on the
# feature map, image size of the released file, official parameter count at 224 px with 1000 classes
# (official-vit.md 1.2 / models_test.py)).
HYBRIDS = [
    ("r50+vit-b/16", (3, 4, 9), (768, 12, 12, 3072), 1, 384, 98_659_112),
    ("r26+vit-b/32", (2, 2, 2, 2), (768, 12, 12, 3072), 1, 384, 101_383_976),
    ("r26+vit-s/32", (2, 2, 2, 2), (384, 12, 6, 1536), 1, 384, 36_431_912),
    ("r50+vit-l/32", (3, 4, 6, 3), (1024, 24, 16, 4096), 1, 384, 328_994_856),
    ("r+vit-ti/16", (), (192, 12, 3, 768), 8, 224, 6_337_704),
]


@pytest.mark.parametrize("name,layers,vit,patch,size,params", HYBRIDS)
def test_config_inference_for_the_published_hybrids(name, layers, vit, patch, size, params):
    dim, depth, heads, mlp = vit
    reduction = 4 * 2 ** max(len(layers) - 1, 0)
    grid = size // (reduction * patch)
    a = hybrid_arrays(layers, None, dim=dim, depth=depth, heads=heads, mlp=mlp, patch=patch, grid=grid, classes=1000,
                      zeros=True)  # shapes only: broadcast zeros cost no memory
    cfg = official.infer_config(a)
    ref = get_config(name, image_size=size)
    for field in ("patch_size", "dim", "depth", "heads", "mlp_dim", "resnet", "image_size", "classifier"):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert cfg.stride == ref.stride
    with torch.device("meta"):
        model = vitlab.models.registry.build_model(cfg.replace(image_size=224))
    assert count_parameters(model) == params
    assert math.isclose(cfg.grid_size[0], grid)


# Logits of the official Flax code (google-research/vision_transformer vit_jax/models_vit.py and
# models_resnet.py, run with jax 0.10.2 / flax 0.12.8 on CPU) for the arrays `hybrid_arrays` makes with
# np.random.default_rng(7) (pre-Linen names renamed to Linen, GroupNorm squeezed to (C,)); the
# official module's parameter tree had exactly these keys. Input: the same rng's uniform(-1, 1) draw.
OFFICIAL_HYBRID_LOGITS = {
    "stem": ((), 8, 64, [[-5.037988185882568, -3.166806936264038, 3.238300085067749, 7.707211971282959, -2.326174020767212],
                         [-5.651946067810059, -2.243973970413208, 2.7664380073547363, 9.567994117736816, -0.26782798767089844]]),
    "two": ((1, 2), 1, 32, [[-2.690398931503296, 8.364330291748047, -3.499351978302002, 6.034823894500732, 2.426743984222412],
                            [-2.9024710655212402, 9.433395385742188, -3.9239859580993652, 4.710792064666748, -1.4353599548339844]]),
}


@pytest.mark.parametrize("case", sorted(OFFICIAL_HYBRID_LOGITS))
def test_hybrid_logits_match_the_official_flax_code(tmp_path, case):
    layers, patch, size, logits = OFFICIAL_HYBRID_LOGITS[case]
    rng = np.random.default_rng(7)
    reduction = 4 * 2 ** max(len(layers) - 1, 0)
    a = hybrid_arrays(layers, rng, patch=patch, grid=size // (reduction * patch), classes=5)
    x = rng.uniform(-1, 1, (2, 3, size, size)).astype(np.float32)
    np.savez(tmp_path / "h.npz", **a)
    model = vitlab.load(tmp_path / "h.npz")
    with torch.no_grad():
        out = model(torch.from_numpy(x)).double().numpy()
    assert np.abs(out - np.array(logits)).max() < 5e-5
