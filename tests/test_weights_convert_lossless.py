"""Conversions are lossless or refuse (issue 16): what a timm file cannot carry travels beside it (safetensors
header or `NAME.vitlab.json` sidecar) or the load asks for it; `convert` never overwrites its source; and the
timm files that used to fail (non-square grids, stem-only hybrids) load."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import vitlab
from vitlab.cli import main
from vitlab.errors import VitlabError
from vitlab.models.registry import build_model, create_model
from vitlab.weights import load_with_meta, read_checkpoint, save_native, save_timm
from vitlab.weights import timm as timm_format

FIX = Path("/work/shared/fixtures/official")
needs_fixture = pytest.mark.skipif(not FIX.is_dir(), reason="official fixtures not available")
D, HEADS, MLP, P, K = 32, 4, 64, 4, 5


def _randomised(model, seed=0):
    """Every parameter random (a zero head or zero class slot would hide pooling and position mistakes)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _tiny(seed=0, **overrides):
    args = dict(dim=D, depth=2, heads=HEADS, mlp_dim=MLP, patch_size=P, image_size=16, num_classes=K)
    args.update(overrides)
    return _randomised(create_model("custom", **args), seed)


def _logits(model, size, seed=1):
    x = torch.randn(2, model.config.in_chans, *size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(x)


def _max_diff(a, b):
    return (a - b).abs().max().item()


# ------------------------------------------------------------------ official -> timm -> vitlab, lossless
@needs_fixture
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_official_to_timm_round_trip_keeps_logits_names_and_preprocessing(tmp_path, suffix):
    """The probe's failure: heads guessed 1 for width 64 and GELU read as exact gave logits off by 0.11."""
    src = FIX / "tiny_token_prelinen.npz"
    (tmp_path / "names.txt").write_text("\n".join(f"c{i}" for i in range(10)) + "\n")
    out = tmp_path / f"x{suffix}"
    assert main(["convert", str(src), str(out), "--to", "timm", "--class-names", str(tmp_path / "names.txt"),
                 "--quiet"]) == 0
    assert (tmp_path / "x.pth.vitlab.json").is_file() == (suffix == ".pth")
    ref, ref_meta = load_with_meta(src)
    back, meta = load_with_meta(out)
    assert (back.config.heads, back.config.gelu, back.config.classifier) == (4, "tanh", "token")
    assert back.config == ref.config.replace(name=back.config.name)
    assert _max_diff(_logits(back, (32, 32)), _logits(ref, (32, 32))) <= 1e-6
    assert meta["class_names"] == [f"c{i}" for i in range(10)]
    assert meta["preprocess"] == ref_meta["preprocess"]


@needs_fixture
def test_predict_on_the_timm_export_matches_predict_on_the_source(tmp_path, capsys):
    """`vitlab convert official.npz x.pth --to timm` then `vitlab predict x.pth`: the same probabilities."""
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(images / f"{i}.png")
    src = str(FIX / "tiny_token_prelinen.npz")
    assert main(["convert", src, str(tmp_path / "x.pth"), "--to", "timm", "--quiet"]) == 0
    capsys.readouterr()
    outputs = []
    for weights in (src, str(tmp_path / "x.pth")):
        assert main(["predict", weights, str(images), "--format", "json", "--quiet", "--device", "cpu"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]


def test_sidecar_of_another_model_is_refused(tmp_path):
    path = save_timm(_tiny(), tmp_path / "m.pth")
    torch.save(timm_format.to_timm_state_dict(_tiny(depth=1)), path)  # weights replaced, old sidecar left
    with pytest.raises(VitlabError, match="describes another model"):
        vitlab.load(path)


def test_old_safetensors_exports_without_classifier_still_load(tmp_path):
    """vitlab's earlier timm export stored only heads/GELU/eps/resample; its class-token files are 'token'."""
    model = _tiny(gelu="tanh")
    sd = timm_format.to_timm_state_dict(model)
    old = {"heads": HEADS, "gelu": "tanh", "layer_norm_eps": 1e-6, "posemb_resample": "bilinear_ac"}
    save_file(sd, str(tmp_path / "old.safetensors"), metadata={"format": "pt", "vitlab_config": json.dumps(old)})
    back = vitlab.load(tmp_path / "old.safetensors")
    assert back.config.classifier == "token" and back.config.gelu == "tanh"
    assert _max_diff(_logits(back, (16, 16)), _logits(model, (16, 16))) == 0


# ------------------------------------------------------------------ foreign files: table or refuse
def test_heads_come_from_the_published_widths_only():
    assert [timm_format.guess_heads(w) for w in (192, 384, 768, 1024, 1280)] == [3, 6, 12, 16, 16]
    with pytest.raises(VitlabError, match="heads=N"):
        timm_format.guess_heads(64)  # was 64 // 64 = 1 head, silently


def test_bare_timm_file_needs_heads_and_pooling(tmp_path):
    model = _tiny()
    torch.save(model.state_dict(), tmp_path / "bare.pth")  # what timm's own torch.save(model.state_dict()) gives
    with pytest.raises(VitlabError, match="heads=N"):
        vitlab.load(tmp_path / "bare.pth", classifier="token")
    with pytest.raises(VitlabError, match="classifier='token'"):
        vitlab.load(tmp_path / "bare.pth", heads=HEADS)
    back = vitlab.load(tmp_path / "bare.pth", heads=HEADS, classifier="token", gelu="tanh")
    assert _max_diff(_logits(back, (16, 16)), _logits(model, (16, 16))) == 0


def _timm_avg_pool_logits(sd, model, x):
    """timm global_pool='avg', class_token=True, fc_norm=False: mean of the normed patch tokens (not the class token)."""
    with torch.no_grad():
        tokens = model.forward_features(x)
        return tokens[:, 1:].mean(dim=1) @ sd["head.weight"].T + sd["head.bias"]


def test_class_token_with_average_pooling_is_not_read_as_token_pooling(tmp_path):
    """The probe's failure: a timm `class_token=True, global_pool='avg', fc_norm=False` file loaded as class-token
    pooling (logits off by 1.07). Its keys are those of a token-pooled file, so the pooling must be stated."""
    model = _tiny(gelu="exact")
    sd = model.state_dict()
    torch.save(sd, tmp_path / "avg.pth")
    x = torch.randn(2, 3, 16, 16)
    assert _max_diff(_timm_avg_pool_logits(sd, model, x), model(x).detach()) > 1e-2  # the two readings differ
    with pytest.raises(VitlabError, match="does not say how it pools"):
        vitlab.load(tmp_path / "avg.pth", heads=HEADS)
    with pytest.raises(VitlabError, match="cannot be expressed"):
        vitlab.load(tmp_path / "avg.pth", heads=HEADS, classifier="gap")
    assert main(["convert", str(tmp_path / "avg.pth"), str(tmp_path / "n"), "--heads", str(HEADS), "--quiet"]) == 2
    assert main(["convert", str(tmp_path / "avg.pth"), str(tmp_path / "n"), "--quiet",
                 "--model-args", f"heads={HEADS},classifier=token"]) == 0
    assert vitlab.load(tmp_path / "n").config.classifier == "token"


def test_gap_and_map_files_need_no_pooling_flag(tmp_path):
    for classifier in ("gap", "map"):
        model = _tiny(classifier=classifier)
        torch.save(model.state_dict(), tmp_path / f"{classifier}.pth")
        back = vitlab.load(tmp_path / f"{classifier}.pth", heads=HEADS, gelu="tanh")
        assert back.config.classifier == classifier
        assert _max_diff(_logits(back, (16, 16)), _logits(model, (16, 16))) == 0


def test_unknown_model_args_are_one_line(tmp_path, capsys):
    save_timm(_tiny(), tmp_path / "m.safetensors")
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "n"), "--model-args", "hedas=4"]) == 2
    err = capsys.readouterr().err
    assert "unknown model config fields ['hedas']" in err and err.count("\n") == 1


# ------------------------------------------------------------------ what timm cannot take is refused
def test_representation_layer_is_refused_for_timm(tmp_path, capsys):
    """timm's VisionTransformer has no `pre_logits`: the file would not load there (the probe's exit 0)."""
    model = _tiny(representation_size=D)
    save_native(model, tmp_path / "rep")
    with pytest.raises(VitlabError, match="no representation layer"):
        save_timm(model, tmp_path / "rep.safetensors")
    assert main(["convert", str(tmp_path / "rep"), str(tmp_path / "rep.safetensors"), "--to", "timm"]) == 2
    assert "--num-classes" in capsys.readouterr().err and not (tmp_path / "rep.safetensors").exists()
    assert main(["convert", str(tmp_path / "rep"), str(tmp_path / "ft.safetensors"), "--to", "timm",
                 "--num-classes", "3", "--quiet"]) == 0  # fine-tuning surgery drops pre_logits
    assert not any(k.startswith("pre_logits") for k in load_file(str(tmp_path / "ft.safetensors")))


# ------------------------------------------------------------------ convert never overwrites its input
def test_convert_refuses_to_overwrite_its_source(tmp_path, capsys):
    model = _tiny()
    save_native(model, tmp_path / "native")
    save_timm(model, tmp_path / "a.safetensors")
    before = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "a.safetensors")
    cases = [
        ("a.safetensors", "a.safetensors", "timm"),       # the same file
        ("a.safetensors", "link.safetensors", "timm"),    # the same file through a link
        ("native", "native", "native"),                   # the same folder
        ("native", "native", "timm"),                     # into the source folder (native/model.safetensors)
        ("native/model.safetensors", "native", "hf"),     # the folder around the source file
        ("native", "native/sub", "native"),               # inside the source folder
    ]
    for src, dst, to in cases:
        assert main(["convert", str(tmp_path / src), str(tmp_path / dst), "--to", to]) == 2, (src, dst, to)
        assert "overwrite the source" in capsys.readouterr().err
    assert (tmp_path / "a.safetensors").read_bytes() == before
    assert vitlab.load(tmp_path / "native").config == model.config


@needs_fixture
def test_convert_npz_onto_itself_is_refused(tmp_path, capsys):
    """The probe's `vitlab convert a.npz a.npz --to timm` overwrote its source and exited 0."""
    src = tmp_path / "a.npz"
    src.write_bytes((FIX / "tiny_token_prelinen.npz").read_bytes())
    before = src.read_bytes()
    assert main(["convert", str(src), str(src), "--to", "timm"]) == 2
    err = capsys.readouterr().err
    assert ".safetensors, .pth, .pt, .bin" in err and err.count("\n") == 1
    assert src.read_bytes() == before


def test_unknown_output_suffixes_are_refused(tmp_path, capsys):
    save_timm(_tiny(), tmp_path / "m.safetensors")
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "out.onnx"), "--to", "timm"]) == 2
    assert ".safetensors, .pth, .pt, .bin" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "out.safetensors"), "--to", "native"]) == 2
    assert "writes a folder" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists() and not (tmp_path / "out.safetensors").exists()
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "folder"), "--to", "timm", "--quiet"]) == 0
    assert (tmp_path / "folder" / "model.safetensors").is_file()


# ------------------------------------------------------------------ the failing loads load
@pytest.mark.parametrize("no_embed_class", [False, True])
def test_non_square_timm_file_loads_at_its_image_size(tmp_path, capsys, no_embed_class):
    """A 16x24 model (4x6 grid): the error asked for image_size=(H, W), which then failed the same way."""
    model = _tiny(image_size=(16, 24))
    sd = model.state_dict()
    if no_embed_class:  # timm no_embed_class: no slot for the class token; vitlab's zero slot is the same model
        with torch.no_grad():
            model.pos_embed[:, 0] = 0
        sd = {**model.state_dict(), "pos_embed": model.pos_embed[:, 1:].detach().clone()}
    torch.save(sd, tmp_path / "wide.pth")
    ask = dict(heads=HEADS, classifier="token", gelu="tanh")
    with pytest.raises(VitlabError, match=r"image_size=\(H, W\)"):
        vitlab.load(tmp_path / "wide.pth", **ask)
    back = vitlab.load(tmp_path / "wide.pth", image_size=(16, 24), **ask)
    assert back.config.image_size == (16, 24)
    assert _max_diff(_logits(back, (16, 24)), _logits(model, (16, 24))) == 0
    with pytest.raises(VitlabError, match="4x4 grid"):
        read_checkpoint(tmp_path / "wide.pth", image_size=(16, 16), **ask)  # the file's size must fit the table
    assert main(["convert", str(tmp_path / "wide.pth"), str(tmp_path / "n1"), "--quiet", "--image-size", "16x24",
                 "--model-args", f"heads={HEADS},classifier=token,gelu=tanh"]) == 0
    assert main(["convert", str(tmp_path / "wide.pth"), str(tmp_path / "n2"), "--quiet",
                 "--model-args", f"image_size=16x24,heads={HEADS},classifier=token,gelu=tanh"]) == 0
    for out in ("n1", "n2"):
        assert _max_diff(_logits(vitlab.load(tmp_path / out), (16, 24)), _logits(model, (16, 24))) == 0
    save_timm(model, tmp_path / "wide.safetensors")  # vitlab's own export stores the size: no flag needed
    assert vitlab.load(tmp_path / "wide.safetensors").config.image_size == (16, 24)


def test_non_square_torchvision_file_loads_at_its_image_size(tmp_path):
    model = _tiny(image_size=(16, 24), gelu="exact")
    sd = model.state_dict()
    tv = {"class_token": sd["cls_token"], "encoder.pos_embedding": sd["pos_embed"],
          "conv_proj.weight": sd["patch_embed.proj.weight"], "conv_proj.bias": sd["patch_embed.proj.bias"],
          "encoder.ln.weight": sd["norm.weight"], "encoder.ln.bias": sd["norm.bias"],
          "heads.head.weight": sd["head.weight"], "heads.head.bias": sd["head.bias"]}
    names = {"norm1": "ln_1", "norm2": "ln_2", "attn.qkv.weight": "self_attention.in_proj_weight",
             "attn.qkv.bias": "self_attention.in_proj_bias", "attn.proj": "self_attention.out_proj",
             "mlp.fc1": "mlp.0", "mlp.fc2": "mlp.3"}
    for k, v in sd.items():
        if k.startswith("blocks."):
            _, i, rest = k.split(".", 2)
            for ours, theirs in names.items():
                if rest.startswith(ours):
                    tv[f"encoder.layers.encoder_layer_{i}.{theirs}{rest[len(ours):]}"] = v
    torch.save(tv, tmp_path / "tv.pth")
    with pytest.raises(VitlabError, match=r"image_size=\(H, W\)"):
        vitlab.load(tmp_path / "tv.pth", heads=HEADS)
    back = vitlab.load(tmp_path / "tv.pth", image_size=(16, 24), heads=HEADS)
    assert _max_diff(_logits(back, (16, 24)), _logits(model, (16, 24))) == 0


# Printed from timm 1.0.31 in /work/peers:
#   m = timm.create_model('vit_tiny_r_s16_p8_224', pretrained=False)
#   [(k, tuple(v.shape)) for k, v in m.state_dict().items() if not k.startswith('blocks.')]
# (the blocks.N.* keys are the plain ViT's; depth 12, 192 wide, 3 heads)
TIMM_VIT_TINY_R_S16_P8_224 = {
    "cls_token": (1, 1, 192),
    "pos_embed": (1, 50, 192),
    "patch_embed.backbone.conv.weight": (64, 3, 7, 7),
    "patch_embed.backbone.norm.weight": (64,),
    "patch_embed.backbone.norm.bias": (64,),
    "patch_embed.proj.weight": (192, 64, 8, 8),
    "patch_embed.proj.bias": (192,),
    "norm.weight": (192,),
    "norm.bias": (192,),
    "head.weight": (1000, 192),
    "head.bias": (1000,),
}
_BLOCK = {"norm1.weight": (192,), "norm1.bias": (192,), "attn.qkv.weight": (576, 192), "attn.qkv.bias": (576,),
          "attn.proj.weight": (192, 192), "attn.proj.bias": (192,), "norm2.weight": (192,), "norm2.bias": (192,),
          "mlp.fc1.weight": (768, 192), "mlp.fc1.bias": (768,), "mlp.fc2.weight": (192, 768), "mlp.fc2.bias": (192,)}


def _timm_r_s16_p8_keys():
    keys = dict(TIMM_VIT_TINY_R_S16_P8_224)
    for i in range(12):
        keys.update({f"blocks.{i}.{k}": shape for k, shape in _BLOCK.items()})
    return keys


def test_timm_stem_only_hybrid_reads_and_writes_timm_names():
    """vit_tiny_r_s16_p8_224: timm's `patch_embed.backbone.conv/norm` (vitlab's `...backbone.stem.conv/norm`)."""
    keys = _timm_r_s16_p8_keys()
    sd = {k: torch.empty(shape, device="meta") for k, shape in keys.items()}
    config, ours, _ = timm_format.read_timm(sd, classifier="token")
    assert config.resnet.layers == () and config.resnet.stem == "bit"
    assert (config.dim, config.depth, config.heads, config.patch_size, config.image_size) == (192, 12, 3, 8, (224, 224))
    assert "patch_embed.backbone.stem.conv.weight" in ours
    model = build_model(config)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in ours.items()}
    written = timm_format.to_timm_state_dict(model)
    assert {k: tuple(v.shape) for k, v in written.items()} == keys


def test_timm_stem_only_hybrid_round_trip_is_exact(tmp_path):
    model = _tiny(resnet={"layers": [], "base_width": 32}, patch_size=2, image_size=32)
    path = save_timm(model, tmp_path / "rti.pth")
    sd = torch.load(path, weights_only=True)
    assert "patch_embed.backbone.conv.weight" in sd and not any(".stem." in k for k in sd)
    assert _max_diff(_logits(vitlab.load(path), (32, 32)), _logits(model, (32, 32))) == 0
    timm_format.sidecar_path(path).unlink()  # a foreign file with timm's names
    # a foreign timm hybrid is read with timm's ws_eps 1e-8; this one was made with the official eps (None)
    back = vitlab.load(path, heads=HEADS, classifier="token", gelu="tanh", ws_eps=None)
    assert _max_diff(_logits(back, (32, 32)), _logits(model, (32, 32))) == 0
    assert vitlab.load(path, heads=HEADS, classifier="token", gelu="tanh").config.resnet.ws_eps == 1e-8


def test_timm_args_describe_the_model():
    """The keywords stored as 'timm_args' (checked against timm itself by hand, docs/weights.md)."""
    args = timm_format.timm_model_args(_tiny(gelu="tanh", image_size=(16, 24)).eval().config)
    assert args["act_layer"] == "gelu_tanh" and args["img_size"] == [16, 24] and args["num_heads"] == HEADS
    assert args["global_pool"] == "token" and args["class_token"] and args["mlp_ratio"] * D == MLP
    assert timm_format.timm_model_args(_tiny(layer_norm_eps=1e-12).config) is None  # no JSON keyword for eps


@pytest.mark.parametrize("fmt", ["hf", "timm.safetensors", "timm.pth"])
@pytest.mark.parametrize("fields", [dict(posemb="sincos2d"), dict(posemb_resample="bicubic_aa", drop_path=0.3)])
def test_what_hf_and_timm_configs_cannot_say_survives_the_round_trip(tmp_path, fmt, fields):
    """A fixed sin-cos table came back as a learned parameter, and through HF the table's resampling became bicubic
    and drop_path 0: the same logits at the model's own size, other logits at any other (up to 0.03) and another
    fine-tuning. vitlab's exports now record them (timm: the record; HF: config.json's `vitlab_config`)."""
    from vitlab.weights import adapt, save_hf
    from vitlab.weights.io import safetensors_metadata

    model = _tiny(**fields)
    path = tmp_path / fmt
    save_hf(model, path) if fmt == "hf" else save_timm(model, path)
    back = vitlab.load(path)
    assert {k: getattr(back.config, k) for k in fields} == fields
    bigger = vitlab.load(path, image_size=24)
    assert torch.equal(_logits(bigger, (24, 24)), _logits(adapt(_tiny(**fields), None, 24, False), (24, 24)))
    if fields.get("posemb") != "sincos2d":
        return
    # the stored table must be the fixed one: a copy trained elsewhere is another model, refused
    weights = path / "model.safetensors" if fmt == "hf" else path
    key = "vit.embeddings.position_embeddings" if fmt == "hf" else "pos_embed"
    if weights.suffix == ".safetensors":
        sd, meta = load_file(weights), safetensors_metadata(weights)
        sd[key] += 0.01
        save_file(sd, weights, metadata=meta or None)
    else:
        sd = torch.load(weights, weights_only=True)
        sd[key] += 0.01
        torch.save(sd, weights)
    with pytest.raises(VitlabError, match="stored table is not that table"):
        vitlab.load(path)


@pytest.mark.parametrize("name, fmt", [("bit-r50x1", "timm.safetensors"), ("bit-r50x1", "timm.pth"),
                                       ("resnet-18", "timm.safetensors"), ("resnet-18", "hf")])
def test_resnets_keep_their_size_and_eps_through_timm_and_hf(tmp_path, name, fmt):
    """The timm record of a BiT ResNet held its name only: on reload timm's ws_eps 1e-8 replaced big_transfer's
    1e-10 (logits moved by about 1e-5), and every ResNet came back made for 224 px (export's default size)."""
    from vitlab.weights import save_hf

    model = create_model(name, num_classes=3, image_size=64).eval()
    path = tmp_path / fmt
    save_hf(model, path) if fmt == "hf" else save_timm(model, path)
    back = vitlab.load(path).eval()
    assert back.config.image_size == (64, 64) and back.config.name == model.config.name
    if model.config.resnet.kind == "bit":
        assert back.config.resnet.ws_eps == 1e-10
    assert torch.equal(_logits(back, (64, 64)), _logits(model, (64, 64)))
