"""vitlab.train: the paper's recipes (pre-train, fine-tune, small-data), the loop, checkpoints, torchrun.

    from vitlab.train import resolve_config, train
    cfg = resolve_config("small-data", overrides={"data": "bundled", "epochs": 2})
    result = train(cfg)            # -> TrainResult(model, run_dir, history, test_metrics, ...)
"""

from vitlab.train.config import PRESETS, RECIPES, TrainConfig, recipe_names, resolve_config
from vitlab.train.loop import TrainResult, train

__all__ = ["PRESETS", "RECIPES", "TrainConfig", "TrainResult", "recipe_names", "resolve_config", "train"]
