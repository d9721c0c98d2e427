"""Evaluation: classification metrics, plots, frozen-feature evaluation (few-shot ridge, kNN, probe), zero-shot."""

from vitlab.evaluate.metrics import classification_metrics, confusion_matrix, wilson_interval

__all__ = ["classification_metrics", "confusion_matrix", "wilson_interval"]
