"""timm and torchvision state dicts built from their documented key names (reference peers.md A.6,
A.7, C.1) map 1:1, and a torchvision-style forward built from torch's own nn.MultiheadAttention
(what torchvision's EncoderBlock runs) gives the same logits."""

import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import vitlab
from vitlab.errors import VitlabError
from vitlab.models.registry import create_model
from vitlab.weights import load_with_meta, save_timm

D, DEPTH, HEADS, MLP, P, S, K = 32, 2, 4, 64, 4, 16, 5
N = (S // P) ** 2


def _rand(*shape, gen):
    return torch.randn(*shape, generator=gen) * 0.3


def timm_vit_keys(cls=True, head=True):
    """Documented timm names and shapes (peers.md A.6) for a tiny ViT."""
    keys = {"pos_embed": (1, N + (1 if cls else 0), D), "patch_embed.proj.weight": (D, 3, P, P), "patch_embed.proj.bias": (D,)}
    if cls:
        keys["cls_token"] = (1, 1, D)
    for i in range(DEPTH):
        b = f"blocks.{i}."
        keys.update({b + "norm1.weight": (D,), b + "norm1.bias": (D,), b + "attn.qkv.weight": (3 * D, D),
                     b + "attn.qkv.bias": (3 * D,), b + "attn.proj.weight": (D, D), b + "attn.proj.bias": (D,),
                     b + "norm2.weight": (D,), b + "norm2.bias": (D,), b + "mlp.fc1.weight": (MLP, D),
                     b + "mlp.fc1.bias": (MLP,), b + "mlp.fc2.weight": (D, MLP), b + "mlp.fc2.bias": (D,)})
    keys.update({"norm.weight": (D,), "norm.bias": (D,)})
    if head:
        keys.update({"head.weight": (K, D), "head.bias": (K,)})
    return keys


def torchvision_keys():
    """Documented torchvision names and shapes (peers.md C.1) for a tiny vit."""
    keys = {"class_token": (1, 1, D), "conv_proj.weight": (D, 3, P, P), "conv_proj.bias": (D,),
            "encoder.pos_embedding": (1, N + 1, D)}
    for i in range(DEPTH):
        b = f"encoder.layers.encoder_layer_{i}."
        keys.update({b + "ln_1.weight": (D,), b + "ln_1.bias": (D,), b + "self_attention.in_proj_weight": (3 * D, D),
                     b + "self_attention.in_proj_bias": (3 * D,), b + "self_attention.out_proj.weight": (D, D),
                     b + "self_attention.out_proj.bias": (D,), b + "ln_2.weight": (D,), b + "ln_2.bias": (D,),
                     b + "mlp.0.weight": (MLP, D), b + "mlp.0.bias": (MLP,), b + "mlp.3.weight": (D, MLP), b + "mlp.3.bias": (D,)})
    keys.update({"encoder.ln.weight": (D,), "encoder.ln.bias": (D,), "heads.head.weight": (K, D), "heads.head.bias": (K,)})
    return keys


def _fill(keys, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: _rand(*shape, gen=gen) for k, shape in keys.items()}


def torchvision_reference_forward(sd, x):
    """The torchvision ViT computation written with torch's nn.MultiheadAttention, independent of vitlab."""
    x = F.conv2d(x, sd["conv_proj.weight"], sd["conv_proj.bias"], stride=P).flatten(2).transpose(1, 2)
    x = torch.cat([sd["class_token"].expand(x.shape[0], -1, -1), x], dim=1) + sd["encoder.pos_embedding"]
    for i in range(DEPTH):
        b = f"encoder.layers.encoder_layer_{i}."
        mha = nn.MultiheadAttention(D, HEADS, batch_first=True)
        mha.load_state_dict({"in_proj_weight": sd[b + "self_attention.in_proj_weight"],
                             "in_proj_bias": sd[b + "self_attention.in_proj_bias"],
                             "out_proj.weight": sd[b + "self_attention.out_proj.weight"],
                             "out_proj.bias": sd[b + "self_attention.out_proj.bias"]})
        y = F.layer_norm(x, (D,), sd[b + "ln_1.weight"], sd[b + "ln_1.bias"], eps=1e-6)
        x = x + mha(y, y, y, need_weights=False)[0]
        y = F.layer_norm(x, (D,), sd[b + "ln_2.weight"], sd[b + "ln_2.bias"], eps=1e-6)
        y = F.linear(F.gelu(F.linear(y, sd[b + "mlp.0.weight"], sd[b + "mlp.0.bias"])), sd[b + "mlp.3.weight"], sd[b + "mlp.3.bias"])
        x = x + y
    x = F.layer_norm(x, (D,), sd["encoder.ln.weight"], sd["encoder.ln.bias"], eps=1e-6)
    return F.linear(x[:, 0], sd["heads.head.weight"], sd["heads.head.bias"])


def test_torchvision_maps_one_to_one_and_matches_reference(tmp_path):
    sd = _fill(torchvision_keys())
    torch.save(sd, tmp_path / "vit_tiny.pth")
    model, meta = load_with_meta(tmp_path / "vit_tiny.pth", heads=HEADS)
    assert meta["format"] == "torchvision" and tuple(meta["preprocess"].mean) == (0.485, 0.456, 0.406)
    ours = model.state_dict()
    assert len(ours) == len(sd)
    assert torch.equal(ours["blocks.1.attn.qkv.weight"], sd["encoder.layers.encoder_layer_1.self_attention.in_proj_weight"])
    assert torch.equal(ours["blocks.0.mlp.fc2.bias"], sd["encoder.layers.encoder_layer_0.mlp.3.bias"])
    x = torch.randn(2, 3, S, S)
    with torch.no_grad():
        assert (model(x) - torchvision_reference_forward(sd, x)).abs().max().item() < 1e-5


def test_timm_maps_one_to_one_and_matches_reference(tmp_path):
    tv = _fill(torchvision_keys(), seed=2)
    # the same weights under timm names (qkv == in_proj, proj == out_proj, fc1 == mlp.0, fc2 == mlp.3)
    ren = {"class_token": "cls_token", "encoder.pos_embedding": "pos_embed", "conv_proj.": "patch_embed.proj.",
           "encoder.ln.": "norm.", "heads.head.": "head.", "self_attention.in_proj_weight": "attn.qkv.weight",
           "self_attention.in_proj_bias": "attn.qkv.bias", "self_attention.out_proj": "attn.proj", "ln_1": "norm1",
           "ln_2": "norm2", "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2", "encoder.layers.encoder_layer_": "blocks."}
    sd = {}
    for k, v in tv.items():
        for a, b in ren.items():
            k = k.replace(a, b)
        sd[k] = v
    assert set(sd) == set(timm_vit_keys())
    save_file(sd, str(tmp_path / "timm.safetensors"))
    model, meta = load_with_meta(tmp_path / "timm.safetensors", heads=HEADS, classifier="token")
    assert meta["format"] == "timm" and model.config.gelu == "exact" and model.config.heads == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    x = torch.randn(2, 3, S, S)
    with torch.no_grad():
        assert (model(x) - torchvision_reference_forward(tv, x)).abs().max().item() < 1e-5


def test_timm_variants_gap_map_no_embed_class_pre_logits(tmp_path):
    gap = _fill(timm_vit_keys(cls=False))
    torch.save(gap, tmp_path / "gap.pth")
    assert vitlab.load(tmp_path / "gap.pth", heads=HEADS).config.classifier == "gap"
    noemb = _fill(timm_vit_keys())
    noemb["pos_embed"] = noemb["pos_embed"][:, 1:]
    torch.save(noemb, tmp_path / "noemb.pth")
    with pytest.raises(VitlabError, match="no_embed_class"):  # N slots: N = 4x4 without a class slot or 3x5 with one
        vitlab.load(tmp_path / "noemb.pth", heads=HEADS, classifier="token")
    m = vitlab.load(tmp_path / "noemb.pth", image_size=S, heads=HEADS, classifier="token")
    assert torch.equal(m.pos_embed[:, 0], torch.zeros(1, D)) and torch.equal(m.pos_embed[:, 1:], noemb["pos_embed"])
    pre = _fill(timm_vit_keys())
    pre.update({"pre_logits.fc.weight": torch.randn(D, D), "pre_logits.fc.bias": torch.randn(D)})
    torch.save({"state_dict": pre}, tmp_path / "pre.pth")
    assert vitlab.load(tmp_path / "pre.pth", heads=HEADS, classifier="token").config.representation_size == D
    mp = _fill(timm_vit_keys(cls=False))
    mp.update({"attn_pool.latent": (1, 1, D), "attn_pool.q.weight": (D, D), "attn_pool.q.bias": (D,),
               "attn_pool.kv.weight": (2 * D, D), "attn_pool.kv.bias": (2 * D,), "attn_pool.proj.weight": (D, D),
               "attn_pool.proj.bias": (D,), "attn_pool.norm.weight": (D,), "attn_pool.norm.bias": (D,),
               "attn_pool.mlp.fc1.weight": (MLP, D), "attn_pool.mlp.fc1.bias": (MLP,),
               "attn_pool.mlp.fc2.weight": (D, MLP), "attn_pool.mlp.fc2.bias": (D,)})
    mp = {k: (torch.randn(*v) if isinstance(v, tuple) else v) for k, v in mp.items()}
    torch.save(mp, tmp_path / "map.pth")
    assert vitlab.load(tmp_path / "map.pth", heads=HEADS).config.classifier == "map"


def timm_hybrid_keys(layers=(1, 2), width=64, in_chans=3, dim=D):
    """Documented timm hybrid names (peers.md A.7): stem.conv/norm, stages.s.blocks.j.conv1..3/norm1..3, downsample."""
    pre = "patch_embed.backbone."
    keys = {pre + "stem.conv.weight": (width, in_chans, 7, 7), pre + "stem.norm.weight": (width,), pre + "stem.norm.bias": (width,)}
    chans = width
    for s, n in enumerate(layers):
        f = width * 2**s
        for j in range(n):
            b = f"{pre}stages.{s}.blocks.{j}."
            cin = chans if j == 0 else 4 * f
            keys.update({b + "conv1.weight": (f, cin, 1, 1), b + "conv2.weight": (f, f, 3, 3), b + "conv3.weight": (4 * f, f, 1, 1)})
            for r, c in ((1, f), (2, f), (3, 4 * f)):
                keys.update({f"{b}norm{r}.weight": (c,), f"{b}norm{r}.bias": (c,)})
            if j == 0:
                keys.update({b + "downsample.conv.weight": (4 * f, cin, 1, 1),
                             b + "downsample.norm.weight": (4 * f,), b + "downsample.norm.bias": (4 * f,)})
        chans = 4 * f
    vit = timm_vit_keys()
    vit["patch_embed.proj.weight"] = (dim, chans, 1, 1)
    reduction = 4 * 2 ** (len(layers) - 1)
    grid = 64 // reduction
    vit["pos_embed"] = (1, grid * grid + 1, dim)
    keys.update(vit)
    return keys


def test_timm_hybrid_maps_one_to_one(tmp_path):
    sd = _fill(timm_hybrid_keys())
    save_file(sd, str(tmp_path / "hybrid.safetensors"))
    model = vitlab.load(tmp_path / "hybrid.safetensors", heads=HEADS, classifier="token")
    assert model.config.resnet.layers == (1, 2) and model.config.image_size == (64, 64)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    assert len(model.state_dict()) == len(sd)
    stem_only = {k: v for k, v in timm_hybrid_keys(layers=()).items() if "stages" not in k}
    stem_only["patch_embed.proj.weight"] = (D, 64, 8, 8)
    stem_only["pos_embed"] = (1, 2 * 2 + 1, D)
    model = vitlab.load(_save(tmp_path / "rti.safetensors", _fill(stem_only)), heads=HEADS, classifier="token")
    assert model.config.resnet.layers == () and model.config.patch_size == 8 and model.config.image_size == (64, 64)


def _save(path, sd):
    save_file(sd, str(path))
    return path


def test_timm_export_uses_documented_names(tmp_path):
    model = create_model("custom", dim=D, depth=DEPTH, heads=HEADS, mlp_dim=MLP, patch_size=P, image_size=S, num_classes=K)
    path = save_timm(model, tmp_path / "out.safetensors")
    sd = load_file(str(path))
    assert {k: tuple(v.shape) for k, v in sd.items()} == timm_vit_keys()
    hybrid = create_model("r50+vit-b/16", num_classes=K, image_size=64, depth=1, dim=D, heads=HEADS, mlp_dim=MLP,
                          resnet={"layers": (1, 1, 2)})
    sd = load_file(str(save_timm(hybrid, tmp_path / "h.safetensors")))
    assert sd["patch_embed.backbone.stages.2.blocks.1.conv3.weight"].shape == (1024, 256, 1, 1)
    assert sd["patch_embed.backbone.stages.0.blocks.0.downsample.conv.weight"].shape == (256, 64, 1, 1)
    assert sd["patch_embed.proj.weight"].shape == (D, 1024, 1, 1)


def test_state_dict_errors(tmp_path):
    sd = _fill(timm_vit_keys())
    del sd["blocks.1.mlp.fc1.bias"]
    sd["blocks.0.attn.proj.weight"] = torch.zeros(D, D + 1)
    sd["something.else"] = torch.zeros(1)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(VitlabError) as err:
        vitlab.load(tmp_path / "bad.pth", heads=HEADS, classifier="token")
    msg = str(err.value)
    assert "blocks.1.mlp.fc1.bias" in msg and "something.else" in msg and f"({D}, {D + 1})" in msg and "\n" not in msg
    torch.save({"foo.weight": torch.zeros(2)}, tmp_path / "unknown.pth")
    with pytest.raises(VitlabError, match="unknown state-dict layout"):
        vitlab.load(tmp_path / "unknown.pth", heads=HEADS)
    fc = _fill(timm_vit_keys(cls=False))
    fc["fc_norm.weight"], fc["fc_norm.bias"] = fc.pop("norm.weight"), fc.pop("norm.bias")
    torch.save(fc, tmp_path / "fc.pth")
    with pytest.raises(VitlabError, match="fc_norm"):
        vitlab.load(tmp_path / "fc.pth", heads=HEADS)


def test_pickled_code_is_refused(tmp_path, capsys):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"patch_embed.proj.weight": Evil()}, f)
    with pytest.raises(VitlabError, match="weights_only"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vitlab.load(tmp_path / "evil.pth", heads=HEADS)
    assert "pwned" not in capsys.readouterr().out
    (tmp_path / "trunc.safetensors").write_bytes(b"\x10\x00\x00")
    with pytest.raises(VitlabError, match="complete"):
        vitlab.load(tmp_path / "trunc.safetensors", heads=HEADS)


def test_full_size_b16_configs_are_inferred(monkeypatch):
    """ViT-B/16 under each library's documented names (shapes only, meta tensors): the inferred model has
    the 86,567,656 parameters timm, torchvision and Hugging Face all print (peers.md A.6, B.5, C.1)."""
    from vitlab.models.registry import build_model, count_parameters, get_config
    from vitlab.weights import hf, timm, torchvision

    mod = sys.modules[__name__]
    for name, val in dict(D=768, DEPTH=12, MLP=3072, P=16, S=224, K=1000, N=196).items():
        monkeypatch.setattr(mod, name, val)
    meta = {k: torch.empty(shape, device="meta") for k, shape in timm_vit_keys().items()}
    tv = {k: torch.empty(shape, device="meta") for k, shape in torchvision_keys().items()}
    hf_sd = {}
    for k, v in meta.items():  # HF 4.x names (peers.md B.5)
        k = (k.replace("cls_token", "vit.embeddings.cls_token").replace("pos_embed", "vit.embeddings.position_embeddings")
             .replace("patch_embed.proj", "vit.embeddings.patch_embeddings.projection").replace("blocks.", "vit.encoder.layer.")
             .replace("norm1", "layernorm_before").replace("norm2", "layernorm_after").replace("attn.proj", "attention.output.dense")
             .replace("mlp.fc1", "intermediate.dense").replace("mlp.fc2", "output.dense").replace("head.", "classifier."))
        if k.startswith("norm."):
            k = "vit.layernorm." + k[5:]
        if k.endswith("attn.qkv.weight") or k.endswith("attn.qkv.bias"):
            kind = k.rsplit(".", 1)[1]
            for n in ("query", "key", "value"):
                hf_sd[k.replace(f"attn.qkv.{kind}", f"attention.attention.{n}.{kind}")] = torch.empty(v.shape[0] // 3, *v.shape[1:], device="meta")
            continue
        hf_sd[k] = v
    ref = get_config("vit-b/16")
    for cfg, _, _ in (timm.read_timm(meta, classifier="token"), torchvision.read_torchvision(tv),
                      hf.read_hf_state_dict(hf_sd, {"layer_norm_eps": 1e-12, "num_attention_heads": 12})):
        for field in ("dim", "depth", "heads", "mlp_dim", "patch_size", "image_size", "num_classes", "classifier"):
            assert getattr(cfg, field) == getattr(ref, field), field
        with torch.device("meta"):
            assert count_parameters(build_model(cfg)) == 86_567_656


def test_timm_hub_folder(tmp_path):
    """A timm Hub folder (what hf:timm/NAME downloads): config.json with architecture + pretrained_cfg."""
    import json

    folder = tmp_path / "timm_hub"
    folder.mkdir()
    save_file(_fill(timm_vit_keys()), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architecture": "vit_tiny_test", "num_classes": K, "num_features": D, "global_pool": "token",
        "pretrained_cfg": {"input_size": [3, S, S], "interpolation": "bicubic", "crop_pct": 0.875, "crop_mode": "center",
                           "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]},
        "label_names": [f"l{i}" for i in range(K)]}))
    model, meta = load_with_meta(folder, heads=HEADS)
    assert meta["format"] == "timm" and meta["class_names"] == [f"l{i}" for i in range(K)]
    # timm's eval sizes for crop_pct 0.875: the shorter side to floor(16 / 0.875) = 18, then the centre crop
    assert meta["preprocess"].effective_resize == 18 and meta["preprocess"].interpolation == "bicubic"
    assert model.config.name == "vit_tiny_test"
    cfg = json.loads((folder / "config.json").read_text())
    cfg["global_pool"] = "avg"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VitlabError, match="class token"):
        vitlab.load(folder, heads=HEADS)


def test_resnet_timm_round_trip(tmp_path):
    """BiT ResNet baselines go out with timm ResNetV2's 1x1-conv head (`head.fc`) and come back unchanged."""
    model = create_model("bit-r26x1-postact", num_classes=3, image_size=32, layers=(1, 1), seed=0).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    sd = load_file(str(save_timm(model, tmp_path / "r.safetensors")))
    assert sd["head.fc.weight"].shape == (3, 512, 1, 1) and "stem.conv.weight" in sd
    again = vitlab.load(tmp_path / "r.safetensors")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
