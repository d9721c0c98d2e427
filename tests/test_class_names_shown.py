"""Class names that come from a weights file (a Hugging Face `id2label`, a run's config) may hold a line break or a
lone surrogate (JSON allows "\\ud800"). The confusion matrix could not be drawn (FreeType refuses a surrogate) and the
report's per-class table split its row or failed on a strict UTF-8 stdout and in report.md; both show them escaped."""

import torch

from vitlab.evaluate.metrics import classification_metrics, format_report
from vitlab.evaluate.plots import plot_confusion_matrix

NAMES = ["cat\ud800", "two\nlines", "dog"]


def test_the_confusion_matrix_draws_names_a_font_cannot(tmp_path):
    path = plot_confusion_matrix([[2, 0, 0], [0, 1, 1], [0, 0, 3]], NAMES, tmp_path / "cm.png")
    assert path.stat().st_size > 0


def test_the_per_class_table_keeps_one_row_per_class_and_encodes():
    report = format_report(classification_metrics(torch.tensor([0, 1, 2, 1]), torch.tensor([0, 1, 2, 2]), 3, NAMES))
    report.encode("utf-8")  # strict, as a UTF-8 stdout or report.md writes it
    rows = [line for line in report.splitlines() if line.startswith(("cat", "two", "dog"))]
    assert len(rows) == 3 and "two\\nlines" in report


def test_evaluate_says_a_head_was_matched_by_its_size_alone():
    """Weights that name no classes (a state dict) whose head has as many outputs as the data has classes: the
    'trained head' row rests on that guess; `vitlab evaluate` labelled it as a head of the data's own classes."""
    import vitlab
    from vitlab.data import load_data
    from vitlab.data.preprocess import Preprocess
    from vitlab.evaluate.runner import evaluate_model

    data = load_data("digits", classes=[0, 1, 2], progress=False)
    model = vitlab.create_model("custom", dim=16, depth=1, heads=2, mlp_dim=32, patch_size=4, image_size=8,
                                in_chans=1, num_classes=3).eval()
    pre = Preprocess(image_size=(8, 8), channels=1)
    unnamed = evaluate_model(model, data, pre, model_classes=None, progress=False)
    named = evaluate_model(model, data, pre, model_classes=list(data.class_names), progress=False)
    assert unnamed.rows[0]["label"] == "trained head (by class count: the weights name no classes)"
    assert named.rows[0]["label"] == "trained head"
