"""The ViT model of the paper: shapes, variants, parameter counts, numerics of each option."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.errors import VitlabError
from vitlab.models.posemb import resample_posemb, sincos_2d
from vitlab.models.registry import count_parameters, create_model

# The official parameter counts (vit_jax/models_test.py), 224 px, 1000 classes.
OFFICIAL_COUNTS = {
    "vit-ti/16": 5_717_416, "vit-s/16": 22_050_664, "vit-s/32": 22_878_952, "vit-b/8": 86_576_872,
    "vit-b/16": 86_567_656, "vit-b/32": 88_224_232, "vit-l/16": 304_326_632, "vit-l/32": 306_535_400,
    "vit-h/14": 632_045_800, "vit-b/16-gap": 86_566_120,
    "r50+vit-b/16": 98_659_112, "r26+vit-b/32": 101_383_976, "r26+vit-s/32": 36_431_912,
    "r50+vit-l/32": 328_994_856, "r+vit-ti/16": 6_337_704,
}


def tiny(**kw):
    args = dict(dim=32, depth=2, heads=4, mlp_dim=64, patch_size=4, image_size=16, num_classes=5, seed=0)
    args.update(kw)
    return vitlab.create_model("custom", **args)


@pytest.mark.parametrize("name,count", sorted(OFFICIAL_COUNTS.items()))
def test_official_parameter_counts(name, count):
    with torch.device("meta"):
        model = vitlab.create_model(name)
    assert count_parameters(model) == count


def test_paper_table1_shapes():
    for name, (depth, dim, mlp, heads) in {"vit-b/16": (12, 768, 3072, 12), "vit-l/16": (24, 1024, 4096, 16),
                                           "vit-h/14": (32, 1280, 5120, 16)}.items():
        cfg = vitlab.get_config(name)
        assert (cfg.depth, cfg.dim, cfg.mlp_dim, cfg.heads) == (depth, dim, mlp, heads)
    assert vitlab.get_config("ViT-B_16") == vitlab.get_config("vit-b/16")
    assert vitlab.get_config("vit-l/16").dropout == 0.1 and vitlab.get_config("vit-b/16").dropout == 0.0


def test_unknown_name_is_a_clear_error():
    with pytest.raises(VitlabError, match="unknown model"):
        vitlab.create_model("vit-q/16")


def test_forward_shapes_small_variants():
    x = torch.randn(2, 3, 64, 64)
    for name in ("vit-mu/16", "vit-mu/8", "vit-mu/32"):
        model = vitlab.create_model(name, num_classes=7, image_size=64).eval()
        tokens = model.forward_features(x)
        p = model.config.patch_size
        assert tokens.shape == (2, 1 + (64 // p) ** 2, 32)
        assert model(x).shape == (2, 7)


def test_non_square_and_grayscale():
    model = tiny(image_size=(16, 24), in_chans=1).eval()
    out = model(torch.randn(3, 1, 16, 24))
    assert out.shape == (3, 5)
    assert model.forward_features(torch.randn(1, 1, 16, 24)).shape == (1, 1 + 4 * 6, 32)
    with pytest.raises(VitlabError, match="multiple"):
        model(torch.randn(1, 1, 17, 24))
    with pytest.raises(VitlabError, match="expected images"):
        model(torch.randn(1, 3, 16, 24))


def test_gap_has_no_class_token_and_pools_the_mean():
    model = tiny(classifier="gap").eval()
    assert model.cls_token is None and model.pos_embed.shape == (1, 16, 32)
    with torch.no_grad():
        torch.nn.init.normal_(model.head.weight)
        x = torch.randn(2, 3, 16, 16)
        tokens = model.forward_features(x)
        assert tokens.shape == (2, 16, 32)
        torch.testing.assert_close(model(x), model.head(tokens.mean(1)))


def test_token_classifier_uses_the_class_token():
    model = tiny().eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.head.weight)
        x = torch.randn(2, 3, 16, 16)
        tokens = model.forward_features(x)
        torch.testing.assert_close(model(x), model.head(tokens[:, 0]))


def test_representation_layer_is_linear_tanh():
    model = tiny(representation_size=24).eval()
    with torch.no_grad():
        x = torch.randn(2, 3, 16, 16)
        tokens = model.forward_features(x)
        feats = model.forward_head(tokens, pre_logits=True)
        expected = torch.tanh(tokens[:, 0] @ model.pre_logits.fc.weight.T + model.pre_logits.fc.bias)
        torch.testing.assert_close(feats, expected)
        assert model.head.in_features == 24
    model.reset_classifier(3)
    assert model.pre_logits is None and model.head.in_features == 32 and model.config.num_classes == 3
    assert torch.count_nonzero(model.head.weight) == 0


def test_map_head_runs():
    model = tiny(classifier="map").eval()
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_sincos_posemb_is_fixed_and_follows_big_vision():
    model = tiny(posemb="sincos2d", classifier="gap")
    assert "pos_embed" not in dict(model.named_parameters())
    pe = sincos_2d((2, 3), 8)
    # big_vision: omega = 1 / 10000 ** (arange(d/4) / (d/4 - 1)); [sin x, cos x, sin y, cos y]
    y, x = np.meshgrid(np.arange(2), np.arange(3), indexing="ij")
    omega = 1.0 / 10000 ** (np.arange(2) / 1)
    ref = np.concatenate([np.sin(x.reshape(-1, 1) * omega), np.cos(x.reshape(-1, 1) * omega),
                          np.sin(y.reshape(-1, 1) * omega), np.cos(y.reshape(-1, 1) * omega)], axis=1)
    np.testing.assert_allclose(pe[0].numpy(), ref, atol=1e-6)


def test_drop_path_only_in_training():
    model = tiny(drop_path=0.5, depth=4)
    x = torch.randn(4, 3, 16, 16)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model.forward_features(x), model.forward_features(x))
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():
        a = model.forward_features(x)
        b = model.forward_features(x)
    assert not torch.equal(a, b)
    rates = [getattr(blk.drop_path1, "p", 0.0) for blk in model.blocks]
    assert rates[0] == 0.0 and math.isclose(rates[-1], 0.5)


def test_dropout_rate_reaches_every_place_the_paper_puts_it():
    model = tiny(dropout=0.1)
    blk = model.blocks[0]
    assert model.pos_drop.p == 0.1 and blk.attn.proj_drop.p == 0.1
    assert blk.mlp.drop1.p == 0.1 and blk.mlp.drop2.p == 0.1


def test_attention_path_equals_fused_path():
    model = tiny(depth=3).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        x = torch.randn(2, 3, 16, 16)
        fused = model(x)
        logits, attentions = model(x, return_attention=True)
    assert (logits - fused).abs().max() <= 1e-5
    assert len(attentions) == 3 and attentions[0].shape == (2, 4, 17, 17)
    torch.testing.assert_close(attentions[1].sum(-1), torch.ones(2, 4, 17))


def test_same_seed_same_initial_weights():
    a, b, c = tiny(seed=3), tiny(seed=3), tiny(seed=4)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    assert not torch.equal(a.pos_embed, c.pos_embed)


def test_initialisation_follows_the_official_code():
    model = vitlab.create_model("vit-s/16", num_classes=10, seed=0)
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.head.bias) == 0
    assert torch.count_nonzero(model.cls_token) == 0
    assert abs(model.pos_embed.std().item() - 0.02) < 1e-3
    blk = model.blocks[0]
    d = 384
    bound = math.sqrt(6 / (d + d))  # xavier on each (D x D) slice of q, k, v
    q = blk.attn.qkv.weight[:d]
    assert q.abs().max() <= bound and q.abs().max() > 0.95 * bound
    assert torch.count_nonzero(blk.attn.qkv.bias) == 0
    assert blk.mlp.fc1.bias.abs().max() < 1e-5 and blk.mlp.fc1.bias.std() > 0
    fan_in = 3 * 16 * 16
    assert abs(model.patch_embed.proj.weight.std().item() - math.sqrt(1 / fan_in)) < 0.1 * math.sqrt(1 / fan_in)
    assert model.blocks[0].norm1.eps == 1e-6
    biased = vitlab.create_model("vit-mu/16", head_bias_init=-10.0)
    assert torch.all(biased.head.bias == -10.0)


def test_gelu_variants():
    exact = tiny(gelu="exact")
    assert exact.blocks[0].mlp.act.approximate == "none"
    assert tiny().blocks[0].mlp.act.approximate == "tanh"


def test_posemb_resample_identity_at_same_size():
    model = tiny()
    same = resample_posemb(model.pos_embed.data, (4, 4), (4, 4), 1)
    assert torch.equal(same, model.pos_embed.data)


def test_posemb_resample_equals_scipy_zoom_order1():
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    rng = np.random.default_rng(0)
    posemb = rng.normal(size=(1, 1 + 7 * 7, 6)).astype(np.float32)
    new = resample_posemb(torch.from_numpy(posemb), (12, 12), num_prefix_tokens=1).numpy()
    grid = posemb[0, 1:].reshape(7, 7, 6)
    ref = scipy_ndimage.zoom(grid, (12 / 7, 12 / 7, 1), order=1).reshape(1, 144, 6)
    np.testing.assert_allclose(new[:, 1:], ref, atol=1e-5)
    np.testing.assert_array_equal(new[:, :1], posemb[:, :1])
    # non-square target grid
    new = resample_posemb(torch.from_numpy(posemb), (5, 9), num_prefix_tokens=1).numpy()
    ref = scipy_ndimage.zoom(grid, (5 / 7, 9 / 7, 1), order=1).reshape(1, 45, 6)
    np.testing.assert_allclose(new[:, 1:], ref, atol=1e-5)


def test_dynamic_input_size_uses_resampled_posemb():
    model = tiny().eval()
    x = torch.randn(1, 3, 24, 24)
    with torch.no_grad():
        on_the_fly = model(x)
        model.set_image_size(24)
        assert model.pos_embed.shape == (1, 1 + 36, 32)
        torch.testing.assert_close(model(x), on_the_fly)


def test_bf16_autocast_close_to_fp32():
    model = tiny(depth=2).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(4, 3, 16, 16)
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x)
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max() + 0.02


def test_grad_checkpointing_gives_the_same_gradients():
    """Bit for bit, with dropout and stochastic depth on, and the random stream left where it was without it:
    so `--grad-checkpointing` may change on `--resume` (train/resume.py NEUTRAL_SETTINGS) and the run stays exact."""
    def two_steps(checkpointing):
        model = create_model("custom", num_classes=5, image_size=16, dim=32, depth=3, heads=2, mlp_dim=64,
                             patch_size=4, dropout=0.1, drop_path=0.2, seed=0)
        with torch.no_grad():
            torch.nn.init.normal_(model.head.weight, generator=torch.Generator().manual_seed(0))
        model.train().set_grad_checkpointing(checkpointing)
        torch.manual_seed(1)
        x = torch.randn(4, 3, 16, 16)
        for _ in range(2):
            model.zero_grad()
            model(x).sum().backward()
        return [p.grad.clone() for p in model.parameters()], torch.get_rng_state()

    (ref, ref_rng), (got, got_rng) = two_steps(False), two_steps(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert torch.equal(ref_rng, got_rng)


def test_config_round_trip():
    cfg = vitlab.get_config("r50+vit-b/16", num_classes=3, image_size=(384, 256))
    assert vitlab.ViTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(VitlabError, match="unknown model config fields"):
        vitlab.ViTConfig.from_dict({"dimm": 3})


def test_hybrid_patch_projection_equals_the_strided_convolution():
    """The hybrid's matmul projection is the convolution it replaces, in value and in gradients."""
    model = create_model("custom", num_classes=10, image_size=28, in_chans=1, seed=0, dim=32, depth=1, heads=2,
                         mlp_dim=64, patch_size=7, resnet=dict(layers=[], stem="small"))
    pe = model.patch_embed
    feats = pe.backbone(torch.randn(3, 1, 28, 28)).detach().requires_grad_(True)
    tokens, grid = pe._project_as_matmul(feats)
    (g_tok,) = torch.autograd.grad((tokens * torch.linspace(-1, 1, tokens.numel()).view_as(tokens)).sum(), feats)
    ref = F.conv2d(feats, pe.proj.weight, pe.proj.bias, stride=7)
    ref_tokens = ref.flatten(2).transpose(1, 2)
    (g_ref,) = torch.autograd.grad((ref_tokens * torch.linspace(-1, 1, tokens.numel()).view_as(tokens)).sum(), feats)
    assert grid == (4, 4)
    torch.testing.assert_close(tokens, ref_tokens, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_tok, g_ref, atol=1e-5, rtol=1e-5)
