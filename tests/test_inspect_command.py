"""`vitlab inspect` end to end on a tiny ViT trained for a few steps on scikit-learn's 8x8 digits."""

import base64
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.cli import main
from vitlab.models.registry import create_model
from vitlab.weights import save_native


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-layer ViT trained 40 steps on digits, saved in the native format inside a run folder."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0  # (n, 1, 8, 8) in [0, 1]
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = create_model("custom", dim=32, depth=2, heads=2, mlp_dim=64, patch_size=2, image_size=8,
                         in_chans=1, num_classes=10, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _step in range(40):
        idx = torch.randint(0, len(x), (64,))
        loss = torch.nn.functional.cross_entropy(model((x[idx] - 0.5) / 0.5), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    root = tmp_path_factory.mktemp("inspect")
    run = root / "run"
    save_native(model, run / "model", class_names=[str(i) for i in range(10)])
    images = root / "images"
    images.mkdir()
    for i in range(6):
        Image.fromarray((digits.images[i] * 255 / 16).astype(np.uint8)).save(images / f"digit{i}_{digits.target[i]}.png")
    return model, run, images


def test_inspect_command_writes_figures_report_and_arrays(trained, tmp_path, capsys):
    model, run, images = trained
    out = tmp_path / "out"
    rc = main(["inspect", str(run), "--images", str(images), "--out", str(out), "--quiet", "--rollout-images", "4"])
    assert rc == 0
    for name in ["filters", "posemb", "distance", "rollout", "attention"]:
        png = out / f"inspect_{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 5
    assert not re.search(r"src=\"(?!data:)", html)  # self-contained: no external files
    first = re.search(r"base64,([A-Za-z0-9+/=]+)", html).group(1)
    assert base64.b64decode(first)[:4] == b"\x89PNG"
    info = json.loads((out / "inspect.json").read_text())
    assert info["num_images"] == 6 and info["cls_mode"] == "exclude"
    d = np.array(info["attention_distance_px"])
    assert d.shape == (2, 2)
    # Bounded by the largest patch-centre distance of a 4x4 grid with stride 2.
    assert (d > 0).all() and (d < 2 * np.hypot(3, 3)).all()
    arrays = np.load(out / "inspect.npz")
    assert arrays["rollout_maps"].shape == (4, 4, 4)
    assert arrays["attention_maps"].shape == (2, 2, 4, 4)
    assert arrays["filter_components"].shape == (4, 1, 2, 2)  # 1 x 2 x 2 patches: 4 components at most
    assert arrays["posemb_similarity"].shape == (4, 4, 4, 4)


def test_command_matches_the_functions(trained, tmp_path):
    """The command's distances equal the pure function on the same preprocessed images."""
    from vitlab.inspect import mean_attention_distance

    model, run, images = trained
    out = tmp_path / "out"
    assert main(["inspect", str(run / "model"), "--images", str(images / "digit0_0.png"), "--out", str(out),
                 "--quiet", "--cls", "zero"]) == 0
    img = np.asarray(Image.open(images / "digit0_0.png"), dtype=np.float32) / 255.0
    x = torch.tensor((img - 0.5) / 0.5)[None, None]
    with torch.no_grad():
        _, attn = model(x, return_attention=True)
    ref = mean_attention_distance(attn, (4, 4), 2, num_prefix_tokens=1, cls="zero")
    got = np.array(json.loads((out / "inspect.json").read_text())["attention_distance_px"])
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_resnet_gives_one_line_error(tmp_path, capsys):
    from vitlab.models.config import ResNetConfig, ViTConfig
    from vitlab.models.registry import build_model

    resnet = build_model(ViTConfig(arch="resnet", resnet=ResNetConfig(layers=(1,), stem="small"), num_classes=3,
                                   image_size=16))
    save_native(resnet, tmp_path / "resnet")
    rc = main(["inspect", str(tmp_path / "resnet"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "ResNet" in err and len(err.splitlines()) == 1


def test_bad_image_path_gives_one_line_error(trained, tmp_path, capsys):
    _, run, _ = trained
    rc = main(["inspect", str(run), "--images", str(tmp_path / "missing.png"), "--out", str(tmp_path / "o")])
    assert rc == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_unreadable_image_stops_with_the_way_past_it_or_is_skipped(trained, tmp_path, capsys):
    _, run, images = trained
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in sorted(images.iterdir())[:3]:
        (mixed / f.name).write_bytes(f.read_bytes())
    (mixed / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    args = ["inspect", str(run), "--images", str(mixed), "--out", str(tmp_path / "out"), "--quiet"]
    assert main(args) == 2
    assert capsys.readouterr().err.strip().endswith("broken.png; add --skip-bad to leave unreadable images out")
    assert main([*args, "--skip-bad"]) == 0
    assert "vitlab inspect: skipped" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "inspect.json").read_text())["num_images"] == 3


def test_a_run_folder_defaults_to_its_own_data_and_folder_as_evaluate_does(trained, tmp_path, capsys):
    import shutil

    _, run, _ = trained
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    (mine / "config.yaml").write_text("data: digits\n")
    assert main(["inspect", str(mine), "-n", "16", "--rollout-images", "2"]) == 0
    assert "images from the run's data (digits)" in capsys.readouterr().err
    assert json.loads((mine / "inspect" / "inspect.json").read_text())["num_images"] == 16


def test_a_model_that_is_not_a_run_writes_to_inspect_model_here(trained, tmp_path, monkeypatch):
    _, run, _ = trained
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(run / "model"), "--quiet"]) == 0
    assert (tmp_path / "inspect-model" / "report.html").is_file()


def test_hybrid_skips_filters_gap_model_without_class_token(tmp_path):
    from vitlab.inspect import inspect_model

    hybrid = create_model("r+vit-ti/16", num_classes=3, image_size=64, seed=0, depth=1, dim=48, heads=2, mlp_dim=64)
    res = inspect_model(hybrid, torch.randn(3, 3, 64, 64), tmp_path / "h", progress=False, rollout_images=2)
    assert res.filter_pca is None and "filters" not in res.figures
    assert res.attention_distance.shape == (1, 2)
    gap = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=(8, 12),
                       in_chans=3, num_classes=3, classifier="gap", seed=0)
    res = inspect_model(gap, torch.randn(2, 3, 8, 12), tmp_path / "g", progress=False)
    assert res.rollout_maps.shape == (2, 2, 3) and res.posemb_similarity.shape == (2, 3, 2, 3)
    assert (tmp_path / "g" / "report.html").is_file()


def test_images_from_a_data_set(trained, tmp_path):
    _, run, _ = trained
    out = tmp_path / "out"
    assert main(["inspect", str(run), "--data", "digits", "-n", "10", "--out", str(out), "--quiet"]) == 0
    info = json.loads((out / "inspect.json").read_text())
    assert info["num_images"] == 10
    assert set(info["figures"]) == {"filters", "posemb", "distance", "rollout", "attention"}


def _run_with_checkpoint(trained, tmp_path):
    """A copy of the fixture's run with config.yaml (data: digits) and a training checkpoint checkpoints/best.pt."""
    import shutil

    from vitlab.weights.run_checkpoint import META_KEY

    model, run, _ = trained
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    (mine / "config.yaml").write_text("data: digits\n")
    (mine / "checkpoints").mkdir()
    meta = json.loads((mine / "model" / "config.json").read_text())
    torch.save({"model": model.state_dict(), "config": {"data": "digits"}, "optimizer": {}, META_KEY: meta},
               mine / "checkpoints" / "best.pt")
    return mine


def test_a_checkpoint_of_a_run_is_inspected_like_the_run(trained, tmp_path, monkeypatch, capsys):
    """RUN/checkpoints/best.pt: the run's data and RUN/inspect-best/, not ./inspect-best.pt/ without images."""
    mine = _run_with_checkpoint(trained, tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(mine / "checkpoints" / "best.pt"), "-n", "8", "--rollout-images", "2", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == f"report    {mine / 'inspect-best' / 'report.html'}"
    info = json.loads((mine / "inspect-best" / "inspect.json").read_text())
    assert info["num_images"] == 8 and {"distance", "rollout"} <= set(info["figures"])
    assert info["settings"]["data"] == "digits" and info["settings"]["run"] == str(mine)
    assert not (tmp_path / "inspect-best.pt").exists()
    # RUN/model is the run's final model: inspected as the run, into RUN/inspect/ (evaluate.loading.run_of)
    assert main(["inspect", str(mine / "model"), "-n", "8", "--rollout-images", "2", "--quiet"]) == 0
    assert json.loads((mine / "inspect" / "inspect.json").read_text())["settings"]["data"] == "digits"
    assert not (tmp_path / "inspect-model").exists()
    # a checkpoint file outside any run: ./inspect-<file name without its suffix>
    alone = tmp_path / "alone.pt"
    alone.write_bytes((mine / "checkpoints" / "best.pt").read_bytes())
    assert main(["inspect", str(alone), "--quiet"]) == 0
    assert (tmp_path / "inspect-alone" / "report.html").is_file()


def test_quiet_still_prints_what_the_report_leaves_out(trained, tmp_path, capsys):
    _, run, _ = trained
    out = tmp_path / "out"
    assert main(["inspect", str(run / "model"), "--out", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["attention distance and rollout: skipped, no images (pass --images or --data, with -n above 0)",
                     f"report    {out / 'report.html'}"]


def test_more_images_than_the_split_has_is_said_in_one_line_and_in_the_report(trained, tmp_path, capsys):
    _, run, _ = trained
    out = tmp_path / "out"
    assert main(["inspect", str(run), "--data", "digits", "-n", "500", "--rollout-images", "1", "--out", str(out),
                 "--quiet"]) == 0
    note = "-n 500: the test split of digits has only 179 images, so 179 are used"
    assert note in capsys.readouterr().out.splitlines()
    info = json.loads((out / "inspect.json").read_text())
    assert info["num_images"] == 179 and note in info["notes"]
    assert note in (out / "report.html").read_text()


def test_more_images_files_than_n_is_said(trained, tmp_path, capsys):
    _, run, images = trained
    assert main(["inspect", str(run), "--images", str(images), "-n", "4", "--out", str(tmp_path / "o"),
                 "--quiet"]) == 0
    assert "-n 4: only the first 4 of the 6 --images are used" in capsys.readouterr().out


def test_report_and_json_record_the_data_split_seed_and_image_count(trained, tmp_path):
    import html as html_lib

    _, run, _ = trained
    out = tmp_path / "out"
    assert main(["inspect", str(run), "--data", "digits", "--split", "val", "--seed", "3", "-n", "10",
                 "--rollout-images", "2", "--out", str(out), "--quiet"]) == 0
    settings = json.loads((out / "inspect.json").read_text())["settings"]
    assert {k: settings[k] for k in ("data", "split", "seed", "num_images", "num_images_requested")} == {
        "data": "digits", "split": "val", "seed": 3, "num_images": 10, "num_images_requested": 10}
    assert settings["head_fusion"] == "mean" and settings["rollout_images"] == 2
    text = html_lib.unescape((out / "report.html").read_text())
    assert "<h2>Settings</h2>" in text
    assert "images: 10 (data digits, val split, seed 3)" in text
    for row in ("<td class='text'>split</td><td class='text'>val</td>", "<td class='text'>seed</td><td>3</td>"):
        assert row in text


def test_a_runs_own_data_keeps_its_class_subset(tmp_path, monkeypatch):
    """`vitlab inspect RUN` read the run's data source alone: a run on two classes was inspected on images of all
    ten. It takes the run's classes and split settings, as `vitlab evaluate RUN` does."""
    import vitlab.data as data_module

    assert main(["train", "--data", "bundled", "--classes", "Sandal,Sneaker", "--per-class", "10", "--model", "custom",
                 "--model-args", "dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7", "--steps", "1", "--batch-size",
                 "10", "--out", str(tmp_path), "--name", "r", "--quiet"]) == 0
    real, asked = data_module.load_data, []

    def load_data(*args, **kwargs):
        asked.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_module, "load_data", load_data)
    assert main(["inspect", str(tmp_path / "r"), "-n", "4", "--quiet", "--engine", "torch"]) == 0
    assert asked and asked[-1]["classes"] in ("Sandal,Sneaker", ["Sandal", "Sneaker"]) and asked[-1]["per_class"] == 10
    settings = json.loads((tmp_path / "r" / "inspect" / "inspect.json").read_text())["settings"]
    assert settings["run_classes"] in ("Sandal,Sneaker", ["Sandal", "Sneaker"])


def test_image_size_keeps_the_models_own_position_table(trained, tmp_path, capsys):
    """With --image-size the similarity was computed on the table resampled for the images, where interpolation
    alone makes neighbours similar: random embeddings read as the paper's learned 2-D structure."""
    _, run, images = trained
    out = tmp_path / "big"
    assert main(["inspect", str(run / "model"), "--images", str(images), "--image-size", "16", "--out", str(out),
                 "--quiet", "--engine", "torch"]) == 0
    with np.load(out / "inspect.npz") as z:
        assert z["posemb_similarity"].shape == (4, 4, 4, 4)  # the model's own 4x4 grid, not the 8x8 it ran at
    assert "own 4x4 grid, not the one resampled to 8x8" in (out / "report.html").read_text()
    capsys.readouterr()


def _numpy_map_rollout(model, x: torch.Tensor) -> np.ndarray:
    """A MAP model's rollout map written out in numpy from its weights: the probe's softmax attention over the
    output tokens (mean over heads) times R = A_L ... A_1, A_l = rownorm(mean_heads(attn_l) + I), max-scaled."""
    with torch.no_grad():
        _, attn = model(x, return_attention=True)
        tokens = model.forward_features(x).double().numpy()
    pool, d, heads = model.attn_pool, model.config.dim, model.config.heads
    hd = d // heads
    w = {k: v.detach().double().numpy() for k, v in pool.state_dict().items()}
    q = (w["latent"][0] @ w["q.weight"].T + w["q.bias"]).reshape(heads, hd)  # (heads, hd)
    k = (tokens @ w["kv.weight"][:d].T + w["kv.bias"][:d]).reshape(len(x), -1, heads, hd)  # keys: kv's first half
    logits = np.einsum("hc,bnhc->bhn", q, k) / np.sqrt(hd)
    probe = np.exp(logits - logits.max(-1, keepdims=True))
    probe = (probe / probe.sum(-1, keepdims=True)).mean(1)  # (B, N)
    n = tokens.shape[1]
    r = np.broadcast_to(np.eye(n), (len(x), n, n))
    for a in attn:
        aug = a.double().numpy().mean(1) + np.eye(n)
        r = (aug / aug.sum(-1, keepdims=True)) @ r
    maps = np.einsum("bn,bnm->bm", probe, r).reshape(len(x), *model.config.grid_size)
    return maps / maps.reshape(len(x), -1).max(-1)[:, None, None]


def test_a_map_models_rollout_is_weighted_by_its_probe(tmp_path, capsys):
    """A MAP model's rollout was the mean over all query rows, not the mix of tokens its head reads."""
    from vitlab.inspect import inspect_model

    model = create_model("custom", dim=32, depth=2, heads=2, mlp_dim=64, patch_size=4, image_size=16,
                         classifier="map", num_classes=3, seed=0).eval()
    with torch.no_grad():
        model.attn_pool.latent.normal_(0, 3.0)  # a probe that favours some tokens strongly
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    res = inspect_model(model, x, tmp_path / "m", progress=False, rollout_images=3)
    expected = _numpy_map_rollout(model, x)
    np.testing.assert_allclose(res.rollout_maps, expected, rtol=1e-5, atol=1e-6)
    unweighted = np.array([m / m.max() for m in res.rollout_maps])  # the old map differs: the weighting shows
    from vitlab.inspect.rollout import rollout_maps

    with torch.no_grad():
        _, attn = model(x, return_attention=True)
    assert np.abs(rollout_maps(attn, (4, 4), 0) - unweighted).max() > 1e-3
    assert "probe attention over the output tokens" in (tmp_path / "m" / "report.html").read_text()
    # the probe's weights are those the head mixes the values with
    with torch.no_grad():
        tokens = model.forward_features(x)
        p = model.attn_pool.probe_attention(tokens)  # (B, heads, N)
        _, _, v = model.attn_pool._query_keys_values(tokens)
        mixed = (p.unsqueeze(-1) * v).sum(-2).reshape(len(x), 1, -1)
        out = model.attn_pool.proj(mixed)
        out = (out + model.attn_pool.mlp(model.attn_pool.norm(out)))[:, 0]
        torch.testing.assert_close(out, model.attn_pool(tokens), rtol=1e-5, atol=1e-6)


def test_what_n_and_rollout_images_leave_out_is_said(trained, tmp_path, capsys):
    """-n above the --images given had no note although the docs promise one; -n 0 was blamed on missing images;
    --rollout-images 0 left an empty rollout section."""
    _, run, images = trained
    assert main(["inspect", str(run / "model"), "--images", str(images), "-n", "50", "--out", str(tmp_path / "a"),
                 "--quiet", "--engine", "torch"]) == 0
    assert "-n 50: only 6 --images given, so 6 are used" in capsys.readouterr().out
    assert main(["inspect", str(run / "model"), "--images", str(images), "--out", str(tmp_path / "b"), "--quiet",
                 "--engine", "torch"]) == 0  # the default -n asks for nothing in particular: no note
    assert "--images given" not in capsys.readouterr().out
    assert main(["inspect", str(run / "model"), "--images", str(images), "-n", "0", "--out", str(tmp_path / "c"),
                 "--quiet"]) == 0
    assert "with -n above 0" in capsys.readouterr().out
    assert main(["inspect", str(run / "model"), "--images", str(images), "--rollout-images", "0",
                 "--out", str(tmp_path / "d"), "--quiet", "--engine", "torch"]) == 0
    report = (tmp_path / "d" / "report.html").read_text()
    assert "Abnar &amp; Zuidema" not in report and "--rollout-images 0" in report
    capsys.readouterr()


def test_other_images_than_the_runs_get_a_folder_of_their_own(trained, tmp_path, capsys):
    """`vitlab inspect RUN --images photos/` (or --data other than the run's) wrote over RUN/inspect/, the run's
    own report (vitlab demo's, with its curves and confusion matrix, too); evaluate keeps other data apart."""
    import shutil

    _, run, images = trained
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    (mine / "config.yaml").write_text("data: digits\n")
    assert main(["inspect", str(mine), "-n", "8", "--rollout-images", "2", "--quiet", "--engine", "torch"]) == 0
    own = (mine / "inspect" / "inspect.json").read_text()
    assert main(["inspect", str(mine), "--images", str(images), "--rollout-images", "2", "--quiet",
                 "--engine", "torch"]) == 0
    assert main(["inspect", str(mine), "--data", "bundled", "-n", "8", "--rollout-images", "2", "--quiet",
                 "--engine", "torch"]) == 0
    assert (mine / "inspect" / "inspect.json").read_text() == own
    assert json.loads((mine / "inspect-images" / "inspect.json").read_text())["settings"]["image_paths"]
    assert json.loads((mine / "inspect-bundled" / "inspect.json").read_text())["settings"]["data"] == "bundled"
    # the run's own data named again is still the run's folder
    assert main(["inspect", str(mine), "--data", "digits", "-n", "8", "--rollout-images", "2", "--quiet",
                 "--engine", "torch"]) == 0
    assert sorted(p.name for p in mine.glob("inspect*")) == ["inspect", "inspect-bundled", "inspect-images"]
    capsys.readouterr()


def test_a_runs_report_opens_with_its_curves_as_the_demos_does(tmp_path, capsys):
    """`vitlab demo` writes RUN/inspect/report.html with the run's curves and confusion matrix and says so;
    `vitlab inspect RUN` then wrote the same file without them. A run's report has them (linked from where it is)."""
    assert main(["train", "--data", "bundled", "--classes", "Sandal,Sneaker", "--per-class", "10", "--model", "custom",
                 "--model-args", "dim=16,depth=1,heads=2,mlp_dim=32,patch_size=7", "--steps", "1", "--batch-size",
                 "10", "--out", str(tmp_path), "--name", "r", "--quiet"]) == 0
    run = tmp_path / "r"
    assert main(["inspect", str(run), "-n", "4", "--rollout-images", "2", "--quiet", "--engine", "torch"]) == 0
    report = (run / "inspect" / "report.html").read_text()
    for name in ("accuracy.png", "loss.png", "confusion_matrix.png"):
        assert f'href="../{name}"' in report, name
    assert "Training curves: accuracy" in report
    assert main(["inspect", str(run), "-n", "4", "--rollout-images", "2", "--quiet", "--engine", "torch",
                 "--out", str(tmp_path / "elsewhere")]) == 0
    assert 'href="../r/loss.png"' in (tmp_path / "elsewhere" / "report.html").read_text()
    # a checkpoint's report has no curves: its confusion matrix would be another model's
    step = next((run / "checkpoints").glob("step-*.pt"))
    assert main(["inspect", str(step), "-n", "4", "--rollout-images", "2", "--quiet", "--engine", "torch"]) == 0
    assert "Training curves" not in (run / f"inspect-{step.stem}" / "report.html").read_text()
    capsys.readouterr()
