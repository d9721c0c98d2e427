"""Run trackers beside metrics.jsonl (`--logger tensorboard,wandb`): TensorBoard event files in RUN/tensorboard/
and a Weights & Biases run in RUN/wandb/, fed the same records as metrics.jsonl, which is always written.

Only rank 0 tracks. A resume continues the same event files (TensorBoard purges the steps after the checkpoint,
which are redone) and the same wandb run (its id is kept in RUN/wandb_run_id). The packages are imported only
when a tracker is opened; a missing one is named, with its install command, before the run starts.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from vitlab.errors import VitlabError

TRACKERS = ("tensorboard", "wandb")
NO_TRACKER = ("none", "jsonl", "")  # metrics.jsonl only (it is written in every case)
# tracker -> (module it needs, how to install it)
PACKAGES = {"tensorboard": ("tensorboard", "pip install 'vitlab[tensorboard]'"),
            "wandb": ("wandb", "pip install 'vitlab[wandb]'")}
WANDB_ID_FILE = "wandb_run_id"
# metrics.jsonl keys -> tracker tags (Hugging Face Trainer style: train/..., val/...; the step axis is the
# optimizer step of the records)
STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "images_per_s": "train/images_per_s",
             "grad_norm": "train/grad_norm", "epoch_float": "train/epoch"}
EPOCH_TAGS = {"train_loss": "epoch/train_loss", "train_acc": "epoch/train_acc", "lr": "epoch/lr",
              "time_s": "epoch/time_s"}
FINAL_KEYS = ("accuracy", "macro_f1", "macro_precision", "macro_recall", "weighted_f1", "top5", "loss")


def parse_logger(value: Any) -> str:
    """`--logger` as its canonical text: "none", or tracker names in the given order without repeats."""
    items = value if isinstance(value, list | tuple) else str(value if value is not None else "none").split(",")
    names: list[str] = []
    for item in items:
        name = str(item).strip().lower()
        if name in NO_TRACKER:
            continue
        if name not in TRACKERS:
            raise VitlabError(f"logger must be none, tensorboard, wandb or a comma list such as tensorboard,wandb; "
                              f"got {item!r}")
        if name not in names:
            names.append(name)
    return ",".join(names) or "none"


def logger_names(value: Any) -> list[str]:
    """The trackers a `--logger` value asks for ([] for none)."""
    text = parse_logger(value)
    return [] if text == "none" else text.split(",")


def check_installed(value: Any) -> None:
    """Refuse at start-up, in one line, a tracker whose package is not installed (not mid-run)."""
    for name in logger_names(value):
        module, install = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise VitlabError(f"--logger {name} needs the {module} package, which is not installed; {install} "
                              f"(or drop --logger {name})")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The tracker scalars of one metrics.jsonl record (step and epoch records; others have none)."""
    kind = record.get("type")
    out = {}
    for key, value in record.items():
        if kind == "step":
            tag = STEP_TAGS.get(key)
        elif kind == "epoch":
            tag = f"val/{key[4:]}" if key.startswith("val_") else EPOCH_TAGS.get(key)
        else:
            return {}
        number = _number(value)
        if tag and number is not None:
            out[tag] = number
    return out


def final_scalars(metrics: dict[str, Any], split: str) -> dict[str, float]:
    """The final evaluation's scalar metrics as `test/...` (or `final_val/...` when the run has no test split)."""
    prefix = "test" if split == "test" else f"final_{split}"
    return {f"{prefix}/{k}": float(metrics[k]) for k in FINAL_KEYS if _number(metrics.get(k)) is not None}


class Tracker(Protocol):
    """What a tracker does: scalars at a step, a figure at a step, close."""

    def log_scalars(self, values: dict[str, float], step: int) -> None: ...

    def log_image(self, tag: str, path: Path, step: int) -> None: ...

    def close(self, ok: bool = True) -> None: ...


def png_pixels(path: Path):
    """A PNG as an (H, W, 3) uint8 array (matplotlib reads it; the alpha channel is dropped)."""
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(str(path))
    if pixels.dtype != np.uint8:
        pixels = (np.clip(pixels, 0, 1) * 255 + 0.5).astype(np.uint8)
    if pixels.ndim == 2:
        pixels = np.stack([pixels] * 3, axis=-1)
    return pixels[..., :3]


class TensorBoardTracker:
    """Event files in RUN/tensorboard/ (`tensorboard --logdir RUN/tensorboard`)."""

    def __init__(self, run_path: Path, config: dict[str, Any], resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # on resume, the events after the checkpoint's step are dropped by TensorBoard's readers: they are redone
        purge = None if resumed_step is None else resumed_step + 1
        self.writer = SummaryWriter(log_dir=str(run_path / "tensorboard"), purge_step=purge)
        if resumed_step is None:
            import yaml

            self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def log_image(self, tag: str, path: Path, step: int) -> None:
        self.writer.add_image(tag, png_pixels(path), step, dataformats="HWC")

    def close(self, ok: bool = True) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run named after the run folder, files in RUN/wandb/; WANDB_MODE=offline (or `wandb
    offline`) keeps it on this machine. Project: $WANDB_PROJECT, else vitlab."""

    def __init__(self, run_path: Path, config: dict[str, Any], resumed_step: int | None):
        import wandb

        id_file = run_path / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        try:
            self.run = wandb.init(dir=str(run_path), project=os.environ.get("WANDB_PROJECT") or "vitlab",
                                  name=run_path.name, id=run_id, resume="allow", config=config,
                                  allow_val_change=True, settings=wandb.Settings(console="off"))
        except Exception as exc:  # wandb raises its own errors for login, network, settings
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise VitlabError(f"cannot start the wandb run ({reason[:300]}); run `wandb login`, or set "
                              "WANDB_MODE=offline to keep the run on this machine (`wandb sync` uploads it later), "
                              "or drop --logger wandb") from None
        id_file.write_text(self.run.id + "\n")

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def log_image(self, tag: str, path: Path, step: int) -> None:
        import wandb

        self.run.log({tag: wandb.Image(str(path))}, step=step)

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


OPENERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


class Trackers:
    """The trackers of one run (none on ranks other than 0): each metrics.jsonl record, the final metrics and
    the figures go to every one of them."""

    def __init__(self, trackers: Iterable[Tracker] = ()):
        self.trackers = list(trackers)

    def record(self, record: dict[str, Any]) -> None:
        scalars = scalars_of(record)
        if scalars and self.trackers:
            for tracker in self.trackers:
                tracker.log_scalars(scalars, int(record["step"]))

    def final(self, metrics: dict[str, Any] | None, split: str, step: int) -> None:
        if metrics is not None:
            for tracker in self.trackers:
                tracker.log_scalars(final_scalars(metrics, split), step)

    def figures(self, paths: Iterable[Path], step: int) -> None:
        """Each PNG as an image tagged `figures/<name>`."""
        for path in paths:
            if Path(path).is_file():
                for tracker in self.trackers:
                    tracker.log_image(f"figures/{Path(path).stem}", Path(path), step)

    def close(self, ok: bool = True) -> None:
        """Flush and close every tracker (once; later calls do nothing)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(ok)


def open_trackers(names: Any, run_path: Path, config: dict[str, Any], resumed_step: int | None,
                  main: bool) -> Trackers:
    """The trackers `--logger` names, on rank 0 only; `resumed_step`: the checkpoint's step of a resume."""
    if not main:
        return Trackers()
    opened = Trackers()
    try:
        for name in logger_names(names):
            opened.trackers.append(OPENERS[name](Path(run_path), config, resumed_step))
    except BaseException:
        opened.close(ok=False)
        raise
    return opened
