"""What a resume continues: the run's recorded settings checked against the resuming command, the numerics
(threads, precision, deterministic mode, processes) restored, allowed changes recorded."""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from vitlab.errors import VitlabError
from vitlab.runtime import auto_threads
from vitlab.train.checkpoint import CheckpointManager, checkpoint_folder, load_resume_state
from vitlab.train.config import TrainConfig, lacked_by, load_yaml, recorded_values
from vitlab.train.run_dir import RunDir, read_metrics

# Decided once when a run starts, recorded in config.yaml and each checkpoint, restored by --resume:
# a resumed process that picked them afresh (e.g. fewer threads under load) computes differently.
NUMERIC_SETTINGS = ("threads", "precision", "products", "deterministic", "world_size")
# Settings that do not change what is trained (where it is written, how often it is logged or checked, how
# long a collective may wait): they may differ on resume. Every other field must match the record.
NEUTRAL_SETTINGS = ("out_dir", "name", "resume", "quiet", "log_every", "ckpt_every", "keep_last", "eval_every",
                    "eval_batch_size", "save_model", "device", "grad_checkpointing", "compile", "dist_timeout",
                    "logger")
# Filled in by the run when not given, then recorded: a resume that leaves them unset continues with the
# record (a study rebuilding its settings from scratch passes them unset).
FILLED_BY_THE_RUN: dict[str, Any] = {"image_size": None, "model_args": {}}


def resolve_threads(cfg: TrainConfig) -> int:
    """The thread count as a number (never None), so that config.yaml records what ran."""
    return int(cfg.threads or auto_threads() or torch.get_num_threads())


def run_folder_of(resume: str | Path) -> Path:
    """`--resume` names a run folder, its checkpoints/ folder or one of its checkpoint files."""
    p = Path(resume)
    if p.is_file() and p.parent.name == "checkpoints":
        return p.parent.parent
    if p.is_dir() and checkpoint_folder(p) == p:  # RUN/checkpoints: its run is the folder above
        return p.parent
    return p


def starts_over(resume: str | Path) -> bool:
    """`--resume RUN` of a run folder that holds its config.yaml but no step checkpoint (stopped before its first
    one, which --ckpt-every 200 puts 200 steps in): nothing to continue, and a run from step 0 with the recorded
    settings is that run, where the resume was refused and a new run in the folder too (it holds a run)."""
    p = Path(resume)
    return (p.is_dir() and (run_folder_of(p) / "config.yaml").is_file()
            and not CheckpointManager(checkpoint_folder(p)).step_files())


def recorded_config(resume: str | Path) -> dict[str, Any]:
    """The run's config.yaml as written when it started; without one (deleted, lost), the settings its checkpoint
    recorded, which are the same ({} when there is neither to read)."""
    path = run_folder_of(resume) / "config.yaml"
    try:
        return load_yaml(path) if path.is_file() else checkpoint_config(resume)
    except VitlabError:
        return {}


def checkpoint_config(resume: str | Path) -> dict[str, Any]:
    """The settings the checkpoint that `resume` continues from recorded ({} when none reads): without them a run
    folder that lost its config.yaml was resumed with the default recipe's settings."""
    try:
        state, _ = load_resume_state(resume)
    except VitlabError:
        return {}
    config = state.get("config")
    return {k: v for k, v in config.items() if k != "resume"} if isinstance(config, dict) else {}


def check_resume(cfg: TrainConfig, allow_change: tuple[str, ...]) -> dict[str, tuple[Any, Any]]:
    """Compare the resumed command with the run's config.yaml; returns the allowed changes {name: (recorded,
    now)}, refuses the others in one line."""
    recorded = recorded_values(recorded_config(cfg.resume))
    changes = restore_numerics(cfg, allow_change, recorded)
    changes.update(check_run_settings(cfg, allow_change, recorded))
    return changes


def restore_numerics(cfg: TrainConfig, allow_change: tuple[str, ...],
                     recorded: dict[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """On resume, set threads, precision and deterministic mode to the run's recorded values. A value that
    was not given (threads null, precision auto) takes the record; a different explicit one is refused
    unless allowed. Returns the allowed changes, {name: (recorded, now)}."""
    if recorded is None:
        recorded = recorded_values(recorded_config(cfg.resume))
    changes = {}
    for name, unset in (("threads", None), ("precision", "auto"), ("products", "auto"), ("deterministic", None)):
        before, now = recorded.get(name), getattr(cfg, name)
        if before is None or before == "auto" or now == before:
            continue  # nothing recorded (a run from before the record), or the same value
        if now == unset:
            setattr(cfg, name, before)
            continue
        refuse_change(name, before, now, allow_change)
        changes[name] = (before, now)
    return changes


def refuse_change(name: str, before: Any, now: Any, allow_change: tuple[str, ...]) -> None:
    if name not in allow_change:
        raise VitlabError(f"this run was recorded with {name} {before} but the resume asks for {now}, which changes "
                          f"its numerics; drop that setting to resume exactly, or add --allow-change {name}")


def check_run_settings(cfg: TrainConfig, allow_change: tuple[str, ...],
                       recorded: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Model, data and split, batch, seed, optimizer, schedule, augmentation...: every setting that shapes the
    run must match the record (else config.yaml would describe another run). Differences not allowed are
    refused in one line naming each with both values; returns the allowed ones."""
    # a setting the run was recorded without: it trained with the value before the setting existed
    recorded = {**lacked_by(recorded), **recorded}
    differences = {}
    for name, before in recorded.items():
        if name in NEUTRAL_SETTINGS or name in NUMERIC_SETTINGS:
            continue
        if name in ("mean", "std") and cfg.weights:  # fine-tuning's are its weights' when the run started: the record
            setattr(cfg, name, before)
            continue
        now = getattr(cfg, name)
        if name in FILLED_BY_THE_RUN and now == FILLED_BY_THE_RUN[name]:
            setattr(cfg, name, before)
            continue
        if comparable(name, before) != comparable(name, now):
            differences[name] = (before, now)
    refused = [name for name in differences if name not in allow_change]
    if refused:
        changed = " and ".join(describe_change(name, *differences[name]) for name in refused)
        raise VitlabError(f"cannot resume {run_folder_of(cfg.resume)}: this command changes the run's {changed}; "
                          f"drop those settings to continue the run as recorded, or add --allow-change "
                          f"{','.join(refused)} (config.yaml then records the change)")
    return differences


def comparable(name: str, value: Any) -> Any:
    """A value in one form for comparison: tuples as lists (also inside a dict: `model_args` {"layers": (1,)} is
    recorded in config.yaml as [1], and was refused as a change on every resume), a class list written "a,b" as
    ["a", "b"]."""
    if isinstance(value, tuple | list):
        return [comparable(name, v) for v in value]
    if isinstance(value, dict):
        return {k: comparable(name, v) for k, v in value.items()}
    if name == "classes" and isinstance(value, str):
        return [part.strip() for part in value.split(",")]
    if name == "classes" and value is not None:
        return str(value)
    if name == "data" and isinstance(value, str):  # a run before absolute paths were recorded: as read from here
        from vitlab.data.load import absolute_source

        return absolute_source(value)
    if name == "weights" and isinstance(value, str):  # likewise for a fine-tuning's weights
        from vitlab.train.setup import absolute_weights

        return absolute_weights(value)
    return value


def check_same_data(recorded: dict[str, Any] | None, now: dict[str, Any], cfg: TrainConfig,
                    allow_change: tuple[str, ...]) -> None:
    """A resume must train on the data the run started on: the same source string can name other data (a
    relative path read from another folder, a folder whose files changed). Compared: classes and split sizes,
    as the checkpoint recorded them (checkpoints from before the record: nothing to compare)."""
    from vitlab.data.dataset import identity_difference

    what = identity_difference(recorded, now) if recorded and "data" not in allow_change else None
    if what is None:
        return
    raise VitlabError(f"cannot resume {run_folder_of(cfg.resume)}: its data {cfg.data!r} is not what the run "
                      f"trained on ({what}); resume with the run's data (a relative path is read from the folder "
                      "you run in), or add --allow-change data to go on with this data")


def describe_change(name: str, before: Any, now: Any) -> str:
    """`batch_size 16 -> 32`; for model_args only the keys that differ: `model_args.dim 32 -> 48`."""
    if isinstance(before, dict) and isinstance(now, dict):
        keys = sorted(k for k in set(before) | set(now) if before.get(k, "unset") != now.get(k, "unset"))
        return ", ".join(f"{name}.{k} {before.get(k, 'unset')} -> {now.get(k, 'unset')}" for k in keys)
    return f"{name} {before} -> {now}"


def load_model_state(model: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """The checkpoint's weights into the model this command built; one line (not torch's list of every
    mismatched tensor) when they do not fit, e.g. a checkpoint file resumed under another model."""
    try:
        model.load_state_dict(weights)
    except RuntimeError:
        raise VitlabError(f"checkpoint {path} does not fit the model this command builds ({first_misfit(model, weights)}"
                          f"another model, model_args or image_size than the run's); resume with the run's model "
                          "settings") from None


def first_misfit(model: nn.Module, weights: dict[str, torch.Tensor]) -> str:
    """`pos_embed: checkpoint [1, 17, 16], model [1, 26, 16]; ` for the first tensor whose shape differs (or that one
    side lacks), so that the line says what differs (an --image-size resumed with --allow-change: the position
    embeddings)."""
    own = model.state_dict()
    for name in list(own) + [k for k in weights if k not in own]:
        mine, theirs = own.get(name), weights.get(name)
        if mine is None or theirs is None or mine.shape != theirs.shape:
            return f"{name}: checkpoint {shape_of(theirs)}, model {shape_of(mine)}; "
    return ""


def shape_of(tensor: torch.Tensor | None) -> list[int] | str:
    return list(tensor.shape) if tensor is not None else "none"


def check_world_size(state: dict[str, Any], world: int, allow_change: tuple[str, ...],
                     changes: dict[str, tuple[Any, Any]]) -> None:
    """A checkpoint from N processes resumed on M: refused unless allowed (then recorded as a change)."""
    before = state.get("world_size")
    if before is not None and before != world:
        if "world_size" not in allow_change:  # nothing the user typed: the launch differs
            launch = f"torchrun --nproc-per-node {before} -m vitlab train" if before > 1 else "vitlab train (no torchrun)"
            raise VitlabError(f"this run ran as {before} process{'es' if before > 1 else ''} and is resumed as {world}; "
                              f"resume it with `{launch} --resume RUN` to continue exactly, or add --allow-change "
                              "world_size to go on with this count (the batch split and numerics change)")
        changes["world_size"] = (before, world)


def check_hand_edits(run_path: Path, state: dict[str, Any], cfg: TrainConfig, allow_change: tuple[str, ...],
                     changes: dict[str, tuple[Any, Any]]) -> bool:
    """config.yaml edited by hand since the resumed checkpoint was written: the resume is built from config.yaml,
    so the command saw no difference and the run went on with the edited settings, recorded nowhere. Each edit is a
    change of the run as a flag would be: refused in one line unless allowed, else recorded in `changes` as
    (checkpoint's value, value the run goes on with). Returns whether config.yaml must be written again (an edit
    that the command itself put back)."""
    edits = edits_since_checkpoint(run_path, state)
    refused = [name for name in edits if name not in allow_change]
    if refused:
        shown = ", ".join(describe_change(name, *edits[name]) for name in refused)
        raise VitlabError(f"cannot resume {run_path}: its config.yaml was edited after checkpoint step "
                          f"{state.get('global_step')} was written ({shown}); put the recorded value"
                          f"{'s' if len(refused) > 1 else ''} back to continue the run as it was, or add "
                          f"--allow-change {','.join(refused)} to go on with the edit (metrics.jsonl then records it)")
    put_back = False
    for name, (before, _) in edits.items():
        now = getattr(cfg, name)
        if comparable(name, now) == comparable(name, before):
            changes.pop(name, None)
            put_back = True
        else:
            changes[name] = (before, now)
    return put_back


def edits_since_checkpoint(run_path: Path, state: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{setting: (value the checkpoint recorded, value in config.yaml)} where they differ, leaving out the changes
    a resume from this checkpoint allowed (metrics.jsonl's change records at its step: the checkpoint was written
    before them) and the settings that may differ on any resume."""
    path = run_path / "config.yaml"
    config = state.get("config")
    if not isinstance(config, dict) or not path.is_file():
        return {}
    try:
        written = recorded_values(load_yaml(path))
    except VitlabError:
        return {}
    step, base = state.get("global_step"), recorded_values(config)
    for record in read_metrics(run_path) if (run_path / "metrics.jsonl").is_file() else []:
        if record.get("type") == "change" and record.get("step") == step:
            base.update(recorded_values({k: v[1] for k, v in record.get("changed", {}).items()}))
    return {name: (base[name], value) for name, value in written.items()
            if name in base and name not in NEUTRAL_SETTINGS and name != "world_size"
            and comparable(name, base[name]) != comparable(name, value)}


def print_numerics(cfg: TrainConfig, precision: str, world: int) -> None:
    print(f"vitlab: numerics (recorded; --resume restores them): threads {cfg.threads}, precision {precision}, "
          f"products {cfg.products}, "
          f"deterministic {'on' if cfg.deterministic else 'off'}, {world} process{'es' if world > 1 else ''}",
          flush=True)


def record_changes(run: RunDir, cfg: TrainConfig, changes: dict[str, tuple[Any, Any]], step: int) -> None:
    """Allowed changes on resume: config.yaml gets the new values, metrics.jsonl a record of when."""
    if not changes:
        return
    run.save_config(dataclasses.replace(cfg, resume=None))
    run.log({"type": "change", "step": step, "changed": {k: list(v) for k, v in changes.items()}})
    if run.enabled:
        text = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())
        print(f"vitlab: resuming with changed settings ({text}), recorded in config.yaml and metrics.jsonl; the run "
              "will not match an uninterrupted one", file=sys.stderr, flush=True)


def batch_change_note(changes: dict[str, tuple[Any, Any]], step: int, progress, total_steps: int,
                      streamed: bool) -> str | None:
    """What an allowed batch-size change does to the run, in one line (None without one): its length in steps at
    the new batch (`total_steps`), which the learning-rate schedule follows; where the epoch goes on from (its first
    image not yet trained on: TrainingRun.go_on_at_new_batch), or, for streamed shards, whose order is cut by the
    batch size, that images of that epoch come twice or not at all."""
    if "batch_size" not in changes:
        return None
    before, now = changes["batch_size"]
    line = (f"vitlab: batch_size {before} -> {now} from step {step}: the run now has {total_steps} steps at the new "
            "batch, and the learning-rate schedule follows the step count")
    if streamed and progress.step_in_epoch and before != now:
        line += ("; resumed in the middle of an epoch of streamed shards, whose order follows the batch size, the "
                 "rest of the epoch is drawn in another order, so some of its images come twice and others not at "
                 "all (resuming from an epoch's last checkpoint avoids this)")
    elif progress.step_in_epoch or progress.epoch_offset:
        done = progress.images_done_in_epoch(now)
        line += f"; this epoch goes on from image {done} of its order, where it stopped"
    return line


# What to run to go on, where a training runs inside a bigger command (compare, the studies): that command again,
# not `vitlab train --resume` of its inner run (which compare would not pick up).
_RESUME_ADVICE: ContextVar[str | None] = ContextVar("vitlab_resume_advice", default=None)


@contextlib.contextmanager
def resume_advice(command: str) -> Iterator[None]:
    """Trainings in this block say `command` where they would say how to resume themselves."""
    token = _RESUME_ADVICE.set(command)
    try:
        yield
    finally:
        _RESUME_ADVICE.reset(token)


def resume_command(cfg: TrainConfig, run_path: Path, world: int = 1) -> str:
    """The command that continues the run; under torchrun the same launch (the checkpoint is of `world`
    processes, and a resume on another count is refused)."""
    advice = _RESUME_ADVICE.get()
    if advice is not None:
        return advice
    command = "finetune" if cfg.weights else "train"
    launch = f"torchrun --nproc-per-node {world} -m vitlab" if world > 1 else "vitlab"
    return f"{launch} {command} --resume {shlex.quote(str(run_path))}"

