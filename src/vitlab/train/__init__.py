"""vitlab.train: the paper's recipes (pre-train, fine-tune, small-data), the loop, checkpoints, torchrun.

    from vitlab.train import resolve_config, train
    cfg = resolve_config("small-data", overrides={"data": "bundled", "epochs": 2})
    result = train(cfg)            # -> TrainResult(model, run_dir, history, test_metrics, ...)
"""

from vitlab.train.config import PRESETS, RECIPES, TrainConfig, recipe_names, resolve_config


def __getattr__(name: str):
    """`train` and `TrainResult` are imported on first use: the loop imports torch, and the `vitlab`
    command reads the recipe names from `vitlab.train.config` while it builds its --help."""
    if name in ("TrainResult", "train"):
        from vitlab.train import loop

        value = getattr(loop, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vitlab.train' has no attribute {name!r}")


__all__ = ["PRESETS", "RECIPES", "TrainConfig", "TrainResult", "recipe_names", "resolve_config", "train"]
