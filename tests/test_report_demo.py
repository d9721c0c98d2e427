"""The demo's report.html shows the training curves and the confusion matrix (embedded and linked) and
lists the analyses it skipped, with why; a 1-channel Hugging Face export works with ViTImageProcessor."""

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from vitlab.commands import demo
from vitlab.evaluate.plots import plot_confusion_matrix, plot_lines
from vitlab.inspect import inspect_model
from vitlab.models.registry import create_model
from vitlab.train import resolve_config


def _hybrid():
    """The demo's architecture (a conv stem before a 1x1 patch embedding), tiny."""
    return create_model("custom", conv_stem=[8, 16], patch_size=1, classifier="gap", posemb="sincos2d", dim=16,
                        depth=1, heads=2, mlp_dim=32, image_size=28, in_chans=1, num_classes=10, seed=0).eval()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A fake finished demo run: its folder with curves and confusion matrix, its model and config."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    plot_lines({"validation accuracy": ([1, 2, 3], [0.5, 0.7, 0.8])}, run_dir / "accuracy.png", "Accuracy")
    plot_lines({"validation loss": ([1, 2, 3], [1.2, 0.8, 0.6])}, run_dir / "loss.png", "Loss")
    plot_confusion_matrix(np.eye(3, dtype=int) * 5, ["a", "b", "c"], run_dir / "confusion_matrix.png")
    cfg = resolve_config("demo", overrides={"out_dir": str(run_dir.parent)})
    result = SimpleNamespace(model=_hybrid(), config=cfg, run_dir=run_dir, test_metrics={"accuracy": 0.8, "n": 9})
    pngs = demo._attention_figures(result, quiet=True)
    return run_dir, pngs, (run_dir / "inspect" / "report.html").read_text()


def test_demo_report_embeds_and_links_curves_and_confusion_matrix(demo_run):
    run_dir, pngs, html = demo_run
    assert pngs, "the demo's inspection figures were skipped"
    for name in ("accuracy.png", "loss.png", "confusion_matrix.png"):
        assert f'href="../{name}"' in html and (run_dir / name).is_file()
    for title in ("Training curves: accuracy", "Training curves: loss", "Confusion matrix"):
        assert title in html
    # curves + confusion matrix + posemb, distance, rollout, raw attention, all embedded
    assert html.count("data:image/png;base64,") == 7
    assert html.index("Training curves") < html.index("Position-embedding similarity")


def test_demo_report_lists_skipped_analyses_with_why(demo_run):
    _, _, html = demo_run
    assert "<h2>Skipped analyses</h2>" in html
    row = re.search(r"<tr><td class='text'>Embedding filters[^<]*</td><td class='text'>([^<]*)</td></tr>", html)
    assert row, "the embedding filters are not listed as skipped"
    assert "conv stem" in row.group(1) and "not pixels" in row.group(1)
    assert "inspect_filters.png" not in html


def test_report_without_images_lists_the_attention_analyses_as_skipped(tmp_path):
    model = create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=8, in_chans=1,
                         num_classes=3, seed=0)
    res = inspect_model(model, None, tmp_path, progress=False)
    html = res.report.read_text()
    assert "Skipped analyses" in html and "no images (pass --images or --data" in html
    assert [a for a, _ in res.skipped] == ["Mean attention distance, attention rollout, raw attention"]


def test_plain_vit_report_skips_nothing(tmp_path):
    model = create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=8, in_chans=1,
                         num_classes=3, seed=0)
    res = inspect_model(model, torch.randn(2, 1, 8, 8), tmp_path, progress=False)
    assert res.skipped == [] and "Skipped analyses" not in res.report.read_text()


def test_hf_export_of_a_1_channel_model_runs_through_vit_image_processor(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from vitlab.cli import main
    from vitlab.weights import save_native

    model = create_model("custom", dim=32, depth=1, heads=2, mlp_dim=64, patch_size=4, image_size=16, in_chans=1,
                         num_classes=3, seed=0).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
    save_native(model, tmp_path / "native", class_names=["a", "b", "c"])
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    out = capsys.readouterr().out
    assert "grayscale" in out and "convert('L')" in out
    assert "grayscale" in (tmp_path / "hf" / "README.md").read_text()

    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8))
    gray = rgb.convert("L")
    ref = torch.from_numpy(np.asarray(gray.resize((16, 16), Image.BILINEAR), np.float32) / 255.0)
    ref = ((ref - 0.5) / 0.5)[None, None]  # vitlab's preprocessing
    # transformers 5 with torchvision installed resizes in torchvision (up to one level of 255 off PIL's);
    # its PIL backend, and transformers 4's ViTImageProcessor, resize as vitlab does (docs/weights.md)
    exact = getattr(transformers, "ViTImageProcessorPil", transformers.ViTImageProcessor)
    default = transformers.ViTImageProcessor
    x = exact.from_pretrained(tmp_path / "hf")(gray, return_tensors="pt")["pixel_values"]
    assert x.shape == (1, 1, 16, 16)
    torch.testing.assert_close(x, ref, rtol=0, atol=1e-6)
    proc = default.from_pretrained(tmp_path / "hf")
    x_default = proc(gray, return_tensors="pt")["pixel_values"]
    assert (x_default - ref).abs().max().item() <= 1 / 127.5 + 1e-6
    with torch.no_grad():  # the converted model gives vitlab's logits on the same pixels
        assert (hf(pixel_values=x).logits - model(ref)).abs().max().item() < 1e-4
    # the documented failures of RGB input: in the PIL processor, or in the model after torchvision's processor
    with pytest.raises(ValueError, match="mean must have 3 elements|Expected 1 but got 3"):
        hf(pixel_values=proc(rgb, return_tensors="pt")["pixel_values"])


def test_two_demos_in_one_second_get_two_folders(tmp_path):
    """A named folder that already holds a run is refused, so the demo's default name must not repeat."""
    first = demo._new_name(str(tmp_path))
    (tmp_path / first).mkdir()
    second = demo._new_name(str(tmp_path))
    assert second != first and second.startswith(first[: len("demo-YYYYmmdd-HH")])
