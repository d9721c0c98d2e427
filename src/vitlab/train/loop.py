"""`train(cfg, model=None, data=None) -> TrainResult`: the one training loop behind `vitlab train`,
`vitlab finetune`, `vitlab demo` and `vitlab compare` - on a CPU, a GPU or many processes (torchrun).

A run's lifecycle is `TrainingRun`: `setup` (data, model, batches, precision, run folder, optimizer, resume),
then `run_epochs` (`step` after `step`, `end_epoch` evaluating and checkpointing), then `finish` (the final
evaluation and the run folder's outputs); `interrupt` checkpoints and stops on a first Ctrl-C / SIGTERM. The
parts it is made of live in the modules below it, none of which imports this one: setup.py (seeds, model,
transforms, batch arithmetic, optimizer), state.py (progress and checkpoint state), resume.py (what a resume
continues), signals.py (stop requests), evaluation.py (split predictions and metrics), outputs.py (the
result and the run folder's files)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitlab.errors import VitlabError
from vitlab.models import fast_linear
from vitlab.progress import bar_options
from vitlab.runtime import auto_threads, resolve_device, tune_cpu_allocator  # one policy for every command
from vitlab.train import distributed as D
from vitlab.train.checkpoint import (
    CheckpointManager,
    all_finite,
    find_resume_checkpoint,
    last_finite_checkpoint,
    load_resume_state,
)
from vitlab.train.config import TrainConfig, validate
from vitlab.train.evaluation import predict_split, split_metrics
from vitlab.train.loggers import Trackers, check_installed, open_trackers
from vitlab.train.optim import decay_mask
from vitlab.train.outputs import (
    TrainResult,
    epoch_line,
    gather_stream_failures,
    resolved_settings,
    write_outputs,
)
from vitlab.train.precision import autocast_context, set_stem_precision
from vitlab.train.resume import (
    batch_change_note,
    check_hand_edits,
    check_resume,
    check_same_data,
    check_world_size,
    load_model_state,
    print_numerics,
    record_changes,
    resolve_threads,
    resume_command,
    run_folder_of,
    starts_over,
)
from vitlab.train.run_dir import RunDir, RunLock, new_run_dir, refuse_if_in_use
from vitlab.train.setup import (
    BatchPlan,
    ProcessSettings,
    absolute_weights,
    build_model_for,
    build_optimization,
    build_transforms,
    convert_sync_batchnorm,
    describe_given_model,
    finetune_checkpoint,
    init_head,
    load_splits,
    new_head_note,
    plan_steps,
    prepare_given_model,
    run_precision,
    run_products,
    seed_everything,
    set_deterministic,
    set_train_mode,
    setting_notes,
    split_batch,
    step_seed,
    warmup_notice,
    with_regularisation,
)
from vitlab.train.signals import StopSignals
from vitlab.train.state import (
    Progress,
    _is_fsdp,
    full_model_state,
    full_optim_state,
    gathered_rng_states,
    restore_optimization,
    restore_rng,
)
from vitlab.weights.run_checkpoint import META_KEY

__all__ = ["TrainResult", "TrainingRun", "StopSignals", "train", "params_finite", "predict_split", "split_metrics",
           "auto_threads", "resolve_threads", "run_folder_of", "resume_command"]


def train(cfg: TrainConfig, model: nn.Module | None = None, data=None,
          allow_change: tuple[str, ...] | list[str] = (), force_unlock: bool = False) -> TrainResult:
    """Train (from scratch, pre-train or fine-tune, by `cfg.recipe`) and evaluate; writes a run folder.

    `model`: train this module instead of building one (its head is replaced when the classes differ);
    `data`: a `vitlab.data.DataSplits` instead of loading `cfg.data`;
    `allow_change`: on resume, settings (any TrainConfig field, or world_size) that may differ from the
    run's record; any other difference that changes the run is refused;
    `force_unlock`: take over the run folder's lock even when another machine holds it.

    The thread count and deterministic mode the run sets are the caller's again when it returns (ProcessSettings).
    """
    settings = ProcessSettings.now()
    try:
        return _train(cfg, model, data, tuple(allow_change), force_unlock)
    finally:
        settings.restore()


def _train(cfg: TrainConfig, model: nn.Module | None, data, allow_change: tuple[str, ...],
           force_unlock: bool) -> TrainResult:
    if model is not None and (given := describe_given_model(model)) is not None:
        cfg.model, cfg.model_args = given  # config.yaml records the model trained, not the name cfg carried
    validate(cfg)
    if isinstance(cfg.data, str):  # recorded absolute: a resume or an evaluation from another folder reads the same
        from vitlab.data.load import absolute_source

        cfg.data = absolute_source(cfg.data)
    if isinstance(cfg.weights, str):
        cfg.weights = absolute_weights(cfg.weights)
    check_installed(cfg.logger)  # a missing tracker package stops here, not mid-run
    t_start = time.perf_counter()
    changes = check_resume(cfg, allow_change) if cfg.resume else {}
    cfg.threads = resolve_threads(cfg)
    torch.set_num_threads(cfg.threads)
    set_deterministic(cfg.deterministic)
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        tune_cpu_allocator()
    info = D.init_distributed(device, cfg.dist_timeout)
    stop, lock = StopSignals(), RunLock()
    run: TrainingRun | None = None
    products_before = fast_linear.TRAINING_PRODUCTS  # the run sets its own route; the caller's comes back after
    try:
        # every process computes with rank 0's thread count, which the run records
        cfg.threads = int(D.broadcast_object(cfg.threads, info))
        torch.set_num_threads(cfg.threads)
        run = TrainingRun(cfg, device, info, t_start, stop, allow_change, changes)
        run.setup(model, data, lock, force_unlock)
        run.run_epochs()
        try:
            result = run.finish()
        except KeyboardInterrupt:  # Ctrl-C stops the final evaluation at once: say that every step is kept
            run.finish_interrupted()
            raise
        run.trackers.close(ok=True)
        # every process finishes its last collective before any tears its process group down: a rank that left
        # while rank 0 was still writing the run's outputs once aborted at exit in gloo's teardown
        # ("terminate called without an active exception", FSDP on 2 CPU processes, 1 run in many)
        D.barrier(info)
        return result
    except RuntimeError as exc:
        if D.is_peer_failure(exc, info):  # one line on every live process instead of gloo's trace
            raise D.PeerFailure(peer_failure_message(cfg, info), abandoned=exc) from None
        raise
    finally:
        if run is not None:
            run.trackers.close(ok=False)  # a run that stopped early (closed already when it finished)
        stop.restore()
        fast_linear.set_training_products(products_before)
        lock.release()
        D.shutdown(info)


def peer_failure_message(cfg: TrainConfig, info: D.DistInfo) -> str:
    run = run_folder_of(cfg.resume) if cfg.resume else Path(cfg.out_dir) / (cfg.name or "RUN")
    return (f"process {info.rank} of {info.world_size}: another process did not join a collective within the "
            f"--dist-timeout of {info.timeout_s:g} s (it stopped, hung or died); check that process's log, raise "
            f"--dist-timeout if a step or an evaluation really takes that long, then resume with: "
            f"{resume_command(cfg, run, info.world_size)}")


def _new_run_path(cfg: TrainConfig) -> tuple[str | None, str | None]:
    """(the new run's folder, None), or (None, why it cannot be used): decided on rank 0, sent to every rank."""
    try:
        return str(new_run_dir(cfg)), None
    except VitlabError as exc:
        return None, str(exc)


def lock_run_folder(lock: RunLock, run: RunDir, info: D.DistInfo, force: bool) -> None:
    """Rank 0 takes the run folder's lock; a refusal stops every process (none may wait for it in a collective)."""
    problem = None
    if info.is_main:
        try:
            lock.acquire(run.path, force)
        except VitlabError as exc:
            problem = str(exc)
    problem = D.broadcast_object(problem, info)
    if problem:
        raise VitlabError(problem)



def global_batch(plan) -> int:
    """Images per optimizer step, all processes together."""
    return plan.micro * plan.world * plan.accum


def stream_order(train) -> dict[str, int] | None:
    """What the order of streamed shards depends on besides (seed, epoch, world size): DataLoader workers (half the
    cores) and the shuffle buffer (VITLAB_SHUFFLE_BUFFER). Recorded in each checkpoint and restored by a resume, which
    read another order on a machine with other cores or another buffer; None for other data (order by seed only)."""
    from vitlab.data.loader import default_workers
    from vitlab.data.shards import ShardDataset, shuffle_buffer

    return {"workers": default_workers(), "buffer": shuffle_buffer()} if isinstance(train, ShardDataset) else None


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()



def stop_interrupted(cfg: TrainConfig, run: RunDir, ckpts: CheckpointManager, signal_name: str, step: int,
                     bar: Any, world: int = 1) -> None:
    """After the interrupted step's checkpoint: say where it is and how to go on, then stop (exit code 130)."""
    if bar is not None:
        bar.close()
    if run.enabled:
        print(f"vitlab: stopped by {signal_name} after step {step}; checkpoint {ckpts.latest()}; "
              f"resume with: {resume_command(cfg, run.path, world)}", file=sys.stderr, flush=True)
    raise KeyboardInterrupt


# ---------------------------------------------------------------------------------- divergence
def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This process's shard of FSDP's DTensors, the tensors themselves otherwise."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def params_finite(model: nn.Module, info: D.DistInfo, device: torch.device, sharded: bool) -> bool:
    """All weights finite; sharded (FSDP) weights are checked by their owners and the verdict agreed."""
    ok = all_finite(local_tensors([p for p in model.parameters() if p.is_floating_point()]))
    if sharded and info.enabled:
        ok = D.all_reduce_sum([float(not ok)], info, device)[0] == 0
    return ok


# the advice a diverged run ends with (the studies replace it with their own: `experiments.transfer.study_advice`)
DIVERGENCE_ADVICE = "; lower --lr, keep --grad-clip 1 or use --precision fp32"


def stop_diverged(what: str, value: Any, step: int, epoch: int, ckpts: CheckpointManager, main: bool, bar: Any) -> None:
    """Non-finite loss, gradients or weights: stop before anything is checkpointed, naming the last
    checkpoint whose weights are all finite."""
    if bar is not None:
        bar.close()
    good = last_finite_checkpoint(ckpts.folder) if main else None
    where = f"the last good checkpoint is {good}" if good else "no checkpoint with finite weights was written"
    raise VitlabError(f"{what} became {value} at step {step} (epoch {epoch}); run stopped before writing a checkpoint, "
                      f"{where}{DIVERGENCE_ADVICE}")


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global-norm clipping; with FSDP the gradients are sharded DTensors and the norm is global too."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm



# ------------------------------------------------------------------------------------ the run
@dataclass
class StepOutcome:
    """One optimizer step, summed over its micro-batches and every process."""

    loss: float  # mean loss of the step
    loss_sum: float  # loss x images
    correct: float
    seen: float
    stop_votes: float  # processes that received a stop signal
    lr: float
    grad_norm: float | None


class TrainingRun:
    """One run: `setup`, `run_epochs` (steps, epoch ends), `finish`; `interrupt` on a stop signal."""

    def __init__(self, cfg: TrainConfig, device: torch.device, info: D.DistInfo, t_start: float,
                 stop: StopSignals | None = None, allow_change: tuple[str, ...] | list[str] = (),
                 changes: dict[str, tuple[Any, Any]] | None = None):
        self.cfg, self.device, self.info, self.t_start = cfg, device, info, t_start
        self.cpu_start = time.process_time()  # this run's own: one process may train several (compare, notebooks)
        self.main = info.is_main
        self.show = self.main and not cfg.quiet
        self.stop = stop or StopSignals()
        self.allow_change = tuple(allow_change)
        self.changes = dict(changes or {})
        self.config_put_back = False  # a hand edit of config.yaml that the resuming command undid (check_hand_edits)
        self.step_shift = 0  # Progress.step_shift of the resumed run (plan_after_batch_change)
        self.progress = Progress()
        self.fresh_start = False  # --resume of a run that wrote no checkpoint: it starts again (setup)
        self.trackers = Trackers()  # --logger: TensorBoard / wandb beside metrics.jsonl (rank 0), opened in setup
        self.bar: Any = None
        self.step_delay = float(os.environ.get("VITLAB_TEST_STEP_SLEEP", "0"))  # tests: leave time to kill a run
        self.last_log = (time.perf_counter(), 0)  # time and images (this segment) of the last step record

    # ------------------------------------------------------------------------------ set up
    def setup(self, model: nn.Module | None, data, lock: RunLock | None = None, force_unlock: bool = False) -> None:
        cfg = self.cfg
        if cfg.resume:
            if self.info.world_size == 1:  # under torchrun rank 0's lock (open_run_folder) is the check
                refuse_if_in_use(run_folder_of(cfg.resume), force_unlock)
            self.fresh_start = starts_over(cfg.resume)
            if not self.fresh_start:
                find_resume_checkpoint(cfg.resume)  # fail before loading anything
        seed_everything(cfg.seed)
        self.setup_model(model, data)
        self.setup_batches()
        self.setup_precision()
        state = self.open_run_folder(lock or RunLock(), force_unlock)
        if state is not None:
            self.plan = self.plan_after_batch_change(Progress.from_state(state))
        self.setup_optimization()
        self.start(state)
        self.trackers = open_trackers(cfg.logger, self.run.path, cfg.to_dict(),
                                      self.progress.global_step if state is not None else None, self.main)
        self.announce(resumed=state is not None)

    def setup_model(self, model: nn.Module | None, data) -> None:
        """The data, the model (built, or given) and its train / eval transforms."""
        cfg = self.cfg
        # a fine-tuning's checkpoint, read once: its size decides how the data is stored, then it builds the model
        checkpoint = finetune_checkpoint(cfg) if model is None else None
        if data is None:  # the data's notes also under --quiet
            data = load_splits(cfg, progress=self.show, report=self.main, checkpoint=checkpoint)
        if data.train is None or len(data.train) == 0:
            raise VitlabError("the data has no training images")
        if data.num_classes < 2:  # one class: every prediction is right, and the run reports 100 %
            raise VitlabError(f"the data has {data.num_classes} class{'' if data.num_classes == 1 else 'es'} "
                              f"({', '.join(map(str, data.class_names)) or 'none'}); training needs at least 2 "
                              "(--classes chooses them)")
        self.data = data
        self.class_names = list(data.class_names)
        preprocess = None
        given_classes = getattr(getattr(model, "config", None), "num_classes", None)
        kept_head = None
        if model is None:
            model, preprocess, given_classes, kept_head = build_model_for(cfg, data, checkpoint)
        else:
            model = with_regularisation(prepare_given_model(model, len(self.class_names), cfg, self.main), cfg)
        init_head(model, cfg)
        self.head_note = kept_head or new_head_note(model, cfg, given_classes, len(self.class_names))
        self.model_config = getattr(model, "config", None)
        self.tcfg, self.train_tf, self.eval_tf, self.image_size = build_transforms(cfg, model, data, preprocess,
                                                                                   self.device)
        self.raw_model = model

    def train_loader(self, epoch: int, skip: int, skip_samples: int = 0):
        """This process's micro-batches of one epoch, the first `skip` left out (a resume mid-epoch), or with
        `skip_samples` the first images of the epoch's order (a resume mid-epoch at another batch size)."""
        from vitlab.data import make_loader

        order = self.stream_order or {}  # streamed shards: the run's own workers and buffer decide the order
        return make_loader(self.data.train, self.micro, shuffle=True, seed=self.cfg.seed, epoch=epoch,
                           skip_batches=skip, drop_last=True, rank=self.info.rank, world_size=self.info.world_size,
                           num_workers=order.get("workers"), buffer=order.get("buffer"), skip_samples=skip_samples)

    def setup_batches(self) -> None:
        """Batch arithmetic: global batch = micro x processes x accumulation; steps of an epoch and of the run."""
        cfg, world = self.cfg, self.info.world_size
        self.stream_order = stream_order(self.data.train)
        self.micro, accum = split_batch(cfg.batch_size, cfg.micro_batch, world)
        batches = self.train_loader(0, 0).total_batches
        self.plan = plan_steps(cfg, self.micro, world, accum, batches, len(self.data.train))

    def setup_precision(self) -> None:
        """Precision (recorded in config.yaml: `--config` and `--resume` compute the same way), device, memory."""
        cfg, model = self.cfg, self.raw_model
        self.precision = run_precision(cfg, self.device, model, self.info)
        set_stem_precision(model, self.precision)
        cfg.precision = self.precision
        cfg.products = run_products(cfg, self.device, model, self.precision, self.micro, self.info)
        fast_linear.set_training_products(cfg.products)
        model.to(self.device)
        if cfg.grad_checkpointing:
            if not hasattr(model, "set_grad_checkpointing"):
                raise VitlabError(f"{type(model).__name__} has no activation checkpointing; drop --grad-checkpointing")
            model.set_grad_checkpointing(True)
        self.mask = decay_mask(model)

    def open_run_folder(self, lock: RunLock, force_unlock: bool) -> dict[str, Any] | None:
        """The run folder (new, or the resumed one), locked and cleaned; the resumed checkpoint's weights loaded.
        Returns the resumed checkpoint's state (None for a new run)."""
        cfg, info = self.cfg, self.info
        if cfg.resume:
            run_path = run_folder_of(cfg.resume)
        else:
            run_path, problem = D.broadcast_object(_new_run_path(cfg) if self.main else None, info)
            if problem:  # raised on every process, so that none waits for the others in a collective
                raise VitlabError(problem)
        self.run = RunDir(run_path, enabled=self.main)
        lock_run_folder(lock, self.run, info, force_unlock)  # before anything in the folder is touched
        self.run.remove_leftovers()
        self.ckpts = CheckpointManager(self.run.path / "checkpoints", cfg.keep_last)
        state, state_path = load_resume_state(cfg.resume) if cfg.resume and not self.fresh_start else (None, None)
        if state is not None:  # before the weights load: an edited model_args says so, not a shape mismatch
            self.config_put_back = check_hand_edits(run_path, state, cfg, self.allow_change, self.changes)
            check_world_size(state, info.world_size, self.allow_change, self.changes)
            load_model_state(self.raw_model, state["model"], state_path)
        return state

    def setup_optimization(self) -> None:
        """SyncBatchNorm, the DDP / FSDP wrap, torch.compile, optimizer, schedule and loss scaler."""
        cfg, info = self.cfg, self.info
        self.raw_model = convert_sync_batchnorm(self.raw_model, cfg.batchnorm, info, self.device)
        self.wrapped = D.wrap_model(self.raw_model, info, self.device, fsdp=cfg.fsdp)
        self.optimizer, self.scheduler, self.scaler = build_optimization(cfg, self.wrapped, self.mask, self.plan,
                                                                         self.precision, self.device)
        # Static shapes: the training batch and an epoch's last, shorter one make two graphs. Dynamic shapes crashed
        # Inductor's CUDA codegen in torch 2.11 (an assertion in tiling_utils on the class-token concat's LayerNorm;
        # tests/test_cuda.py, run on an H200).
        self.forward_model = torch.compile(self.wrapped, dynamic=False) if cfg.compile else self.wrapped
        self.eval_model = self.wrapped if cfg.fsdp and info.enabled else self.raw_model

    def start(self, state: dict[str, Any] | None) -> None:
        """A new run records its config; a resumed one takes its checkpoint's optimizer, progress and RNGs."""
        cfg, info = self.cfg, self.info
        if state is not None:
            self.restore(state)
            return
        if self.fresh_start and self.main:
            self.run.metrics_path.unlink(missing_ok=True)  # the stopped attempt's records: its steps are done again
            print(f"vitlab: {self.run.path} holds no checkpoint (the run stopped before its first one): it starts "
                  "again from step 0 with its recorded settings", file=sys.stderr, flush=True)
        self.run.save_config(dataclasses.replace(cfg, resume=None))
        if self.main:
            from vitlab.data import write_skipped

            write_skipped(self.data, self.run.path)
        # per-process RNG streams for dropout / stochastic depth (data order and augmentation are seeded apart)
        torch.manual_seed(cfg.seed + 1000 * info.rank)

    def restore(self, state: dict[str, Any]) -> None:
        check_same_data(state.get("data"), self.data_identity(), self.cfg, self.allow_change)
        new_optimizer = "optimizer" in self.changes
        restore_optimization(self.wrapped, self.optimizer, self.scheduler, state, new_optimizer)
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress.from_state(state)
        self.progress.step_shift = self.step_shift
        self.go_on_at_new_batch()
        if self.stream_order is not None and state.get("stream_order"):  # as threads: the run's, not this machine's
            self.stream_order = dict(state["stream_order"])
        restore_rng(state["rng"], self.info.rank)
        step = self.progress.global_step
        self.run.truncate_metrics(step)
        if self.main:  # the run goes on from `step`: checkpoints after it belong to an abandoned continuation
            later = self.ckpts.set_aside_after(step)
            if later:
                print(f"vitlab: resuming from step {step}: moved the later checkpoint(s) "
                      f"{', '.join(p.name for p in later)} to {self.ckpts.folder / 'abandoned'} (the run goes on "
                      "from here, as metrics.jsonl does; delete them when they are not needed)",
                      file=sys.stderr, flush=True)
            if any(p.name == "best.pt" for p in later):
                self.keep_best_of(state)
        if self.main and not (self.run.path / "config.yaml").is_file():
            print(f"vitlab: {self.run.path} has no config.yaml: the run's settings were taken from its checkpoint; "
                  "config.yaml is written again", file=sys.stderr, flush=True)
            self.run.save_config(dataclasses.replace(self.cfg, resume=None))
        record_changes(self.run, self.cfg, self.changes, step)
        note = batch_change_note(self.changes, step, self.progress, self.plan.total_steps,
                                 streamed=self.stream_order is not None)
        if note and self.main:
            print(note, file=sys.stderr, flush=True)
        if self.config_put_back and not self.changes:  # config.yaml says again what the run goes on with
            self.run.save_config(dataclasses.replace(self.cfg, resume=None))
        if new_optimizer and self.main:
            before, now = self.changes["optimizer"]
            print(f"vitlab: optimizer {before} -> {now}: its state (moments, momentum) starts afresh at step {step}",
                  file=sys.stderr, flush=True)

    def epoch_left_at_new_batch(self, p: Progress) -> tuple[int, int]:
        """For a resume that changed the batch size (`--allow-change batch_size`): (images of the current epoch's
        order trained on, steps of the new batch left in it). The rest of the epoch goes on from its first image
        not yet trained on, so that none comes twice or is left out. Streamed shards cut their stream by the batch
        size, so their order changes with it: they go on by the step count (batch_change_note says so)."""
        plan = self.plan
        before = int(self.changes["batch_size"][0])
        done = p.images_done_in_epoch(before)
        if self.stream_order is not None:
            return done, max(0, plan.steps_per_epoch - p.step_in_epoch)
        from vitlab.data.loader import padded_epoch_length

        world = self.info.world_size
        padded = padded_epoch_length(len(self.data.train), world)  # the order batch_indices splits among the ranks
        return done, max(0, padded - done) // world // plan.micro // plan.accum

    def plan_after_batch_change(self, p: Progress) -> BatchPlan:
        """The resumed run's plan where its batch size changed, now or at an earlier resume: a run of --epochs
        trains the steps left in the current epoch at the new batch and then the later epochs' (it went on to the
        new batch's step count from step 0, so a smaller batch trained past the last epoch and a larger one
        stopped short). The difference is kept in the checkpoints (`Progress.step_shift`) for later resumes. A run
        of --steps keeps its steps."""
        plan, shift = self.plan, p.step_shift
        if self.cfg.steps > 0:
            shift = 0
        elif "batch_size" in self.changes:
            left = self.epoch_left_at_new_batch(p)[1]
            later = max(0, plan.total_steps - (p.epoch + 1) * plan.steps_per_epoch)
            shift = p.global_step + left + later - plan.total_steps
        self.step_shift = shift  # the resumed progress takes it (restore)
        if not shift:
            return plan
        total = max(1, plan.total_steps + shift)
        return dataclasses.replace(plan, total_steps=total, warmup=min(plan.warmup, total))

    def go_on_at_new_batch(self) -> None:
        """Re-express the resumed epoch's position at the new batch size (epoch_left_at_new_batch)."""
        p = self.progress
        if "batch_size" not in self.changes or self.stream_order is not None:
            return
        done, left = self.epoch_left_at_new_batch(p)
        if done:
            p.go_on_at_batch(done, global_batch(self.plan), self.plan.steps_per_epoch, left)

    def keep_best_of(self, state: dict[str, Any]) -> None:
        """best.pt was set aside (written after the resumed step): where the resumed checkpoint is itself the epoch
        with the best validation score so far, it is the run's best.pt again; else the next better epoch writes one."""
        p = self.progress
        last = p.history[-1] if p.history else {}
        if p.best_val is not None and last.get("step") == p.global_step and last.get("val_acc") == p.best_val:
            self.ckpts.save_best(state, p.best_val)

    def announce(self, resumed: bool) -> None:
        if not self.main:
            return
        cfg, plan, world, size = self.cfg, self.plan, self.info.world_size, self.image_size
        self.n_params = sum(p.numel() for p in self.raw_model.parameters())
        print_numerics(cfg, self.precision, world)
        print(f"vitlab: {self.data.summary()}")
        print(f"vitlab: model {getattr(self.model_config, 'name', type(self.raw_model).__name__)} "
              f"({self.n_params:,} parameters), image {size[0]}x{size[1]}, {self.precision} on {self.device}"
              f"{f' x {world} processes' if world > 1 else ''}; batch {cfg.batch_size} = {plan.micro} x {world} x "
              f"{plan.accum} accumulation; {plan.total_steps} steps ({plan.steps_per_epoch}/epoch), warm-up "
              f"{plan.warmup}")
        if self.head_note and not resumed:  # a resumed run's head is the checkpoint's
            print(f"vitlab: {self.head_note}")
        if cfg.fsdp and world == 1:  # FSDP shards over processes: with one there is nothing to shard
            print("vitlab: --fsdp with one process trains the model whole (FSDP shards it over torchrun's "
                  "processes)", file=sys.stderr)
        local, cores = int(os.environ.get("LOCAL_WORLD_SIZE", world)), os.cpu_count() or 1
        if self.device.type == "cpu" and cfg.threads * local > cores:  # oversubscribed: a several-fold slowdown
            print(f"vitlab: {local} process{'es' if local > 1 else ''} x {cfg.threads} threads on {cores} cores: more "
                  f"threads than cores slows every step several-fold; use --threads {max(1, cores // local)}"
                  f"{' (with --allow-change threads on a resume)' if resumed else ''}", file=sys.stderr)
        notice = warmup_notice(cfg, plan)
        if notice:
            print(notice, file=sys.stderr)
        for note in setting_notes(cfg):
            print(f"vitlab: {note}", file=sys.stderr)
        print(f"vitlab: run folder {self.run.path}" +
              (f" (resuming from step {self.progress.global_step})" if resumed else ""), flush=True)
        if resumed and self.progress.global_step >= plan.total_steps:  # else it looked like a run redone
            print(f"vitlab: the run is complete ({plan.total_steps} steps): nothing left to train; its final evaluation "
                  "and files are written again (`vitlab evaluate RUN` evaluates it without touching them)", flush=True)

    # --------------------------------------------------------------------------- checkpoint
    def wall_time(self) -> float:
        """Wall time of the whole run, earlier segments (before a resume) included."""
        return self.progress.wall_prev + time.perf_counter() - self.t_start

    def cpu_time(self) -> float:
        """CPU seconds (all threads of the process) of this run, earlier segments (up to their last checkpoint)
        included: on a shared machine wall time depends on the neighbours, CPU time much less."""
        return self.progress.cpu_prev + time.process_time() - self.cpu_start

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a resume needs to continue bit-identically (collectives under torchrun: every rank)."""
        rngs = gathered_rng_states(self.info)
        return {"model": full_model_state(self.wrapped), "optimizer": full_optim_state(self.wrapped, self.optimizer),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                "rng": rngs, **self.progress.to_state(), "config": self.cfg.to_dict(),
                "world_size": self.info.world_size, "wall_time_s": self.wall_time(),
                "cpu_time_s": self.cpu_time(), META_KEY: self.model_meta(),
                "data": self.data_identity(), "stream_order": self.stream_order}

    def data_identity(self) -> dict[str, Any]:
        """What a resume checks it trains on the same data with (`DataSplits.identity`)."""
        return self.data.identity()

    def model_meta(self) -> dict[str, Any] | None:
        """What RUN/model/config.json will hold, so that a checkpoint loads as weights on its own."""
        if self.model_config is None:
            return None
        from vitlab.weights.native import native_meta

        return native_meta(self.model_config, self.class_names, self.tcfg.preprocess())

    def save_checkpoint(self, best_metric: float | None = None) -> None:
        self.progress.last_saved_step = self.progress.global_step
        state = self.checkpoint_state()
        if self.main:
            # best.pt before the step checkpoint: a kill between the two then resumes from the previous checkpoint
            # and redoes the epoch, writing best.pt again. The other order lost it for good: the resume started
            # after the epoch, its accuracy already counted as the best, and no later epoch rewrote best.pt.
            if best_metric is not None:
                self.ckpts.save_best(state, best_metric)
            self.ckpts.save(state, self.progress.global_step)
        D.barrier(self.info)

    def interrupt(self) -> None:
        """A stop signal: checkpoint this step (unless just done), say how to resume, stop (KeyboardInterrupt)."""
        if self.progress.last_saved_step != self.progress.global_step:
            self.save_checkpoint()
        stop_interrupted(self.cfg, self.run, self.ckpts, self.stop.received or "a signal on another process",
                         self.progress.global_step, self.bar, self.info.world_size)

    def finish_interrupted(self) -> None:
        """Ctrl-C in the final evaluation (after run_epochs, signals stop at once again): every step is checkpointed,
        and a resume writes what is missing (else the run ended on the command's bare "interrupted")."""
        if self.main:
            print(f"vitlab: interrupted in the final evaluation after all {self.progress.global_step} steps (checkpoint "
                  f"{self.ckpts.latest()}); to write the evaluation and the run's files, resume with: "
                  f"{resume_command(self.cfg, self.run.path, self.info.world_size)}", file=sys.stderr, flush=True)

    def diverged(self, what: str, value: Any) -> None:
        stop_diverged(what, value, self.progress.global_step, self.progress.epoch, self.ckpts, self.main, self.bar)

    # -------------------------------------------------------------------------------- train
    def run_epochs(self) -> None:
        """Step until the step budget is spent, an epoch end after each epoch (and after the last step)."""
        if self.show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.plan.total_steps, initial=self.progress.global_step, unit="step",
                            dynamic_ncols=True, **bar_options())
        self.last_log = (time.perf_counter(), self.progress.train_images)
        set_train_mode(self.forward_model, self.cfg.batchnorm)
        self.stop.listen()  # from here on a first Ctrl-C / SIGTERM ends the run at the next step boundary
        while self.progress.global_step < self.plan.total_steps:
            self.run_epoch()
            self.end_epoch()
        self.stop.restore()  # the final evaluation: Ctrl-C stops at once again
        if self.bar is not None:
            self.bar.close()

    def run_epoch(self) -> None:
        """The steps left in this epoch (all of them, or those after a mid-epoch resume)."""
        p, plan, cfg = self.progress, self.plan, self.cfg
        if p.epoch_offset:  # the batch size changed in this epoch: go on from the image where it stopped
            loader = iter(self.train_loader(p.epoch, 0, p.images_done_in_epoch(global_batch(plan))))
        else:
            loader = iter(self.train_loader(p.epoch, p.step_in_epoch * plan.accum))
        while p.step_in_epoch < plan.steps_per_epoch and p.global_step < plan.total_steps:
            t0 = time.perf_counter()
            out = self.step(loader)
            p.add_step(out.loss_sum, out.correct, out.seen, time.perf_counter() - t0)
            if self.step_delay:
                time.sleep(self.step_delay)
            self.log_step(out)
            mid_epoch = p.step_in_epoch < plan.steps_per_epoch and p.global_step < plan.total_steps
            if cfg.ckpt_every and p.global_step % cfg.ckpt_every == 0 and mid_epoch:
                self.save_checkpoint()
            if mid_epoch and self.stop.requested(out.stop_votes if self.info.enabled else None):
                self.interrupt()

    def step(self, loader) -> StepOutcome:
        """One optimizer step: forward / backward over the micro-batches, reduce, check, clip, update."""
        info, device = self.info, self.device
        loss_sum, correct, seen = self.accumulate(loader)
        # the stop request rides on the metrics' reduction, so every process stops after the same step
        loss_val, correct_val, seen_all, stop_votes = D.all_reduce_sum(
            [float(loss_sum), float(correct), float(seen), float(self.stop.received is not None)], info, device)
        step_loss = loss_val / max(seen_all, 1)
        if not math.isfinite(step_loss):
            self.diverged("loss", step_loss)
        grad_norm = self.clip_gradients()
        lr_now = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if not params_finite(self.wrapped, info, device, sharded=_is_fsdp(self.wrapped)):  # a wild update
            self.diverged("the weights", "non-finite")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(step_loss, loss_val, correct_val, seen_all, stop_votes, lr_now, grad_norm)

    def accumulate(self, loader) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Gradients of `accum` micro-batches; returns this process's (loss x n, correct, n)."""
        device = self.device
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        seen = 0
        for m in range(self.plan.accum):
            # the loader leaves the global RNG (dropout, stochastic depth) alone: a DataLoader over streamed files
            # draws its workers' base seed from it when its iterator starts, at the epoch's first batch in an
            # uninterrupted run but at the resumed step's after a mid-epoch resume (another dropout from there on)
            with torch.random.fork_rng(devices=[]):
                x, y = next(loader)
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss, logits = self.forward_backward(x, y, m)
            loss_sum += loss.detach() * len(y)
            correct += (logits.detach().argmax(1) == y).sum()
            seen += len(y)
        return loss_sum, correct, seen

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Augment, (mix,) forward and backward micro-batch `m`; gradients synchronise on the last one only."""
        from vitlab.data.transforms import mix_batch

        cfg, info, tcfg, step = self.cfg, self.info, self.tcfg, self.progress.global_step
        model = self.forward_model
        xt = self.train_tf(x, seed=step_seed(cfg.seed, step, m, info.rank))
        sync = m == self.plan.accum - 1
        ctx = model.no_sync() if (info.enabled and not sync and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with ctx:
            with autocast_context(self.precision, self.device):
                if tcfg.mixing:
                    xt, targets = mix_batch(xt, y, len(self.class_names), mixup_alpha=tcfg.mixup,
                                            cutmix_alpha=tcfg.cutmix, prob=tcfg.mix_prob,
                                            switch_prob=tcfg.mix_switch_prob, label_smoothing=cfg.label_smoothing,
                                            seed=step_seed(cfg.seed + 1, step, m, info.rank))
                logits = model(xt)
            logits = logits.float()
            if tcfg.mixing:
                loss = soft_cross_entropy(logits, targets)
            else:
                loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
            self.scaler.scale(loss / self.plan.accum).backward()
        return loss, logits

    def clip_gradients(self) -> float | None:
        """--grad-clip: the global gradient norm before clipping (None without clipping)."""
        if not self.cfg.grad_clip:
            return None
        self.scaler.unscale_(self.optimizer)
        grad_norm = float(clip_grad_norm(self.wrapped, self.cfg.grad_clip))
        if not math.isfinite(grad_norm) and not self.scaler.is_enabled():  # fp16 skips such steps by design
            self.diverged("the gradient norm", grad_norm)
        return grad_norm

    def log_step(self, out: StepOutcome) -> None:
        """A metrics.jsonl step record every --log-every steps (and the last); the progress bar."""
        p, plan = self.progress, self.plan
        if p.global_step % max(1, self.cfg.log_every) == 0 or p.global_step == plan.total_steps:
            now = time.perf_counter()
            ips = (p.train_images - self.last_log[1]) / max(now - self.last_log[0], 1e-9)
            self.last_log = (now, p.train_images)
            self.log({"type": "step", "step": p.global_step, "epoch": p.epoch,
                          "epoch_float": p.epoch + p.step_in_epoch / plan.steps_per_epoch, "loss": out.loss,
                          "lr": out.lr, "grad_norm": out.grad_norm, "images_per_s": ips})
            if self.bar is not None:
                self.bar.set_postfix(epoch=p.epoch + 1, loss=f"{out.loss:.4f}", lr=f"{out.lr:.2e}", img_s=f"{ips:.0f}",
                                     refresh=False)
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: dict[str, Any]) -> None:
        """One record into metrics.jsonl and, as scalars, into the trackers."""
        self.run.log(record)
        self.trackers.record(record)

    # ---------------------------------------------------------------------------- epoch end
    def end_epoch(self) -> None:
        """End of an epoch (or of the step budget): evaluate, log, checkpoint; a stop signal that came during
        the evaluation stops here."""
        p, cfg = self.progress, self.cfg
        train_loss, train_acc = p.epoch_means()
        record = {"type": "epoch", "epoch": p.epoch + 1, "step": p.global_step, "train_loss": train_loss,
                  "train_acc": train_acc, "lr": self.optimizer.param_groups[0]["lr"], "time_s": self.wall_time()}
        is_last = p.global_step >= self.plan.total_steps
        metric = None
        if self.data.val is not None and ((p.epoch + 1) % max(1, cfg.eval_every) == 0 or is_last):
            metric = self.validate(record)
        p.history.append({k: v for k, v in record.items() if k != "type"})
        self.log(record)
        if self.show and self.bar is not None:
            self.bar.write(epoch_line(record, self.plan.num_epochs))
        elif self.main and cfg.quiet:
            print(epoch_line(record, self.plan.num_epochs), flush=True)
        better = p.improves(metric)
        p.next_epoch()
        self.save_checkpoint(best_metric=metric if better else None)
        if D.all_reduce_sum([float(self.stop.received is not None)], self.info, self.device)[0] > 0:
            self.interrupt()  # the checkpoint is written: this says where, and stops

    def validate(self, record: dict[str, Any]) -> float:
        """Validation metrics into the epoch record; returns the accuracy."""
        logits, labels = self.predict(self.data.val)
        set_train_mode(self.forward_model, self.cfg.batchnorm)  # predict_split restored train() on every layer
        vm = split_metrics(logits, labels, self.class_names)
        record.update(val_loss=vm["loss"], val_acc=vm["accuracy"], val_macro_f1=vm["macro_f1"])
        if "top5" in vm:  # more than 5 classes (timm's eval top-5)
            record["val_top5"] = vm["top5"]
        return vm["accuracy"]

    def predict(self, split) -> tuple[torch.Tensor, torch.Tensor]:
        # RNG-neutral as the training batches (accumulate): a DataLoader over streamed files draws from the global
        # RNG, and --eval-every, which a resume may change, then changed the dropout of every later step
        with torch.random.fork_rng(devices=[]):
            return predict_split(self.eval_model, split, self.eval_tf, self.device, self.precision,
                                 self.cfg.eval_batch_size, self.info)

    # ------------------------------------------------------------------------------- finish
    def finish(self) -> TrainResult:
        """The final evaluation (test split, else val) and the run folder's summary, plots and model."""
        p, data, info = self.progress, self.data, self.info
        result = TrainResult(model=self.raw_model, run_dir=self.run.path, history=p.history, config=self.cfg,
                             best_val_acc=p.best_val)
        split = data.test if data.test is not None else data.val
        split_name = "test" if data.test is not None else "val"
        result.images_per_s = p.total_images / max(p.total_train_time, 1e-9)
        if split is not None:
            result.test_metrics = split_metrics(*self.predict(split), self.class_names)
        result.wall_time_s, result.cpu_time_s = self.wall_time(), self.cpu_time()
        gather_stream_failures(data, info)  # a collective: every rank
        fsdp_state = full_model_state(self.wrapped) if _is_fsdp(self.wrapped) else None  # a collective too
        if self.main:
            from vitlab.data import write_skipped

            line = write_skipped(data, self.run.path)  # again: training files that failed to decode while streaming
            if data.all_skipped():
                print(f"vitlab: {line}", flush=True)
            figures = write_outputs(self.run, self.cfg, result, self.raw_model, self.wrapped, self.class_names,
                                    self.tcfg, split_name, self.n_params, self.precision, self.device,
                                    info.world_size, self.plan.total_steps, fsdp_state,
                                    resolved_settings(self.plan, self.tcfg, self.raw_model, self.device))
            self.trackers.final(result.test_metrics, split_name, p.global_step)
            self.trackers.figures(figures, p.global_step)
        D.barrier(info)
        set_stem_precision(self.raw_model, "fp32")  # the returned model computes in fp32 again
        self.describe_trained(result.model)
        return result

    def describe_trained(self, model: nn.Module) -> None:
        """The returned model says what the run recorded of its input and outputs (RUN/model/config.json): its
        `preprocess` and `class_names`, which `pretrained_cfg`, `vitlab.save` and `predict` read. They kept the
        loaded file's (its resize, interpolation; no class names after the new head) or none at all (vitlab's
        default [-1, 1] input for a model trained from scratch), so the model in hand disagreed with its run."""
        if self.model_config is None:  # not a vitlab model: nothing describes its input
            return
        model.preprocess, model.class_names = self.tcfg.preprocess(), list(self.class_names)
