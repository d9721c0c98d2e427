"""Small calls on one thread, on the calling OS thread only (models/threads.py): `model(x)` and the torch engine run a
ViT call with little arithmetic on one thread without touching other threads' counts, threads that start meanwhile,
or the logits; where torch's runtimes offer no per-thread count, `model(x)` keeps the caller's threads."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import pytest
import torch

import vitlab
from vitlab.engine.torch_engines import TorchEngine
from vitlab.models import threads, vit_direct
from vitlab.models.threads import one_thread, one_thread_here

FMNIST = dict(image_size=28, in_chans=1, patch_size=4, dim=64, depth=6, heads=4, mlp_dim=128, num_classes=10)
linux_wheel = pytest.mark.skipif(sys.platform != "linux", reason="torch's Linux wheels: libgomp and MKL inside")


def fmnist_vit(**kw):
    return vitlab.create_model("custom", **(FMNIST | {"seed": 0} | kw)).eval()


def threads_of_blocks(model, images, monkeypatch) -> list[int]:
    """The thread count each block of the direct route ran with (a hook would turn the route off)."""
    seen, block = [], vit_direct._block

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return block(*args, **kwargs)

    monkeypatch.setattr(vit_direct, "_block", spy)
    with torch.inference_mode():
        model(images)
    monkeypatch.setattr(vit_direct, "_block", block)
    return seen


@linux_wheel
def test_the_switch_acts_on_this_thread_only_and_comes_back(two_threads):
    mkl = None
    if torch.backends.mkl.is_available():  # torch's Linux wheels link MKL into libtorch_cpu
        mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).MKL_Get_Max_Threads
    other_inside, go_on, seen = threading.Event(), threading.Event(), {}

    def other():
        seen["before"] = torch.get_num_threads()
        other_inside.set()
        go_on.wait(10)
        seen["during"] = torch.get_num_threads()

    worker = threading.Thread(target=other)
    worker.start()
    other_inside.wait(10)
    with one_thread_here() as here:
        assert here and torch.get_num_threads() == 1
        assert mkl is None or mkl() == 1
        go_on.set()
        worker.join()
    assert torch.get_num_threads() == 2 and (mkl is None or mkl() == 2)
    assert seen == {"before": 2, "during": 2}
    with pytest.raises(RuntimeError), one_thread_here():
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


@linux_wheel
@pytest.mark.parametrize("caller", ["model(x)", "engine"])
def test_a_thread_that_starts_during_a_small_call_keeps_the_process_count(two_threads, caller, monkeypatch):
    """torch.set_num_threads(1) would leave such a thread on one thread for good (torch's process-wide count)."""
    model, images, seen = fmnist_vit(), torch.randn(1, 1, 28, 28), []
    block = vit_direct._block

    def start_a_thread(*args, **kwargs):
        if not seen:
            late = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            late.start()
            late.join()
            seen.append(torch.get_num_threads())
        return block(*args, **kwargs)

    monkeypatch.setattr(vit_direct, "_block", start_a_thread)
    with torch.inference_mode():
        (model if caller == "model(x)" else TorchEngine(model))(images)
    assert seen == [2, 1]  # the new thread: the process's two; the call's own thread: one


@linux_wheel
def test_model_x_runs_small_calls_on_one_thread_with_the_module_routes_logits(two_threads, monkeypatch):
    model = fmnist_vit()
    for batch in (1, 2):
        images = torch.randn(batch, 1, 28, 28)
        assert threads_of_blocks(model, images, monkeypatch) == [1] * 6
        monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", False)
        with torch.inference_mode():
            expected = model(images)
        monkeypatch.setattr(vit_direct, "DIRECT_INFERENCE", True)
        with torch.inference_mode():
            assert torch.equal(model(images), expected)
    assert torch.get_num_threads() == 2
    assert threads_of_blocks(model, torch.randn(4, 1, 28, 28), monkeypatch) == [2] * 6  # 94 MFLOP: both threads


@linux_wheel
def test_model_x_keeps_all_threads_past_the_bounds(two_threads, monkeypatch):
    """More tokens than the explicit attention route takes (its fused kernel may round differently on one thread),
    or more arithmetic than the bound."""
    many_tokens = vitlab.create_model("custom", image_size=48, patch_size=4, dim=16, depth=2, heads=2, mlp_dim=32,
                                      num_classes=3, seed=0).eval()
    images = torch.randn(1, 3, 48, 48)  # 145 tokens, about 2 MFLOP
    assert threads_of_blocks(many_tokens, images, monkeypatch) == [2, 2]
    model, images = fmnist_vit(), torch.randn(1, 1, 28, 28)
    monkeypatch.setattr(threads, "ONE_THREAD_MAX_FLOPS", 1e6)
    assert threads_of_blocks(model, images, monkeypatch) == [2] * 6
    monkeypatch.setattr(threads, "ONE_THREAD_MAX_FLOPS", 64e6)
    torch.set_num_threads(1)
    assert threads_of_blocks(model, images, monkeypatch) == [1] * 6


def test_without_per_thread_counts_model_x_keeps_the_callers_threads_and_the_engine_sets_them(two_threads,
                                                                                                monkeypatch):
    monkeypatch.setattr(threads, "_setters", lambda: None)
    model, images = fmnist_vit(), torch.randn(1, 1, 28, 28)
    assert threads_of_blocks(model, images, monkeypatch) == [2] * 6
    with one_thread(process_wide_fallback=False) as one:
        assert not one and torch.get_num_threads() == 2
    with one_thread() as one:
        assert one and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    assert threads_of_blocks(TorchEngine(model), images, monkeypatch) == [1] * 6


def test_a_size_the_model_does_not_take_fails_in_its_own_words_on_the_callers_threads(two_threads):
    model = fmnist_vit()
    with pytest.raises(vitlab.VitlabError, match="input image size"), torch.inference_mode():
        model(torch.randn(1, 1, 30, 28))
    assert torch.get_num_threads() == 2


def test_switches_that_do_not_act_on_torchs_count_are_not_taken(monkeypatch):
    """Another OpenMP runtime in the process (one torch does not count with): its switch is checked and left out."""
    class Runtime:  # an OpenMP runtime torch does not use: its count moves, torch's does not
        def __init__(self):
            self.count = torch.get_num_threads()
            self.omp_set_num_threads = lambda n: setattr(self, "count", n)
            self.omp_get_max_threads = lambda: self.count

    monkeypatch.setattr(threads, "_libraries", lambda: iter([Runtime()]))
    threads._setters.cache_clear()
    try:
        assert threads._setters() is None
        with one_thread_here() as here:
            assert not here
    finally:
        threads._setters.cache_clear()


@linux_wheel
def test_the_count_follows_a_changed_model(two_threads, monkeypatch):
    """The FLOPs are counted per image size and config: pruning blocks (the config's depth follows) counts anew."""
    model, images = fmnist_vit(), torch.randn(3, 1, 28, 28)  # 3 images: 71 MFLOP, past the bound
    assert threads_of_blocks(model, images, monkeypatch) == [2] * 6
    model.prune_intermediate_layers([2])  # blocks 0-2 kept: 35 MFLOP
    assert threads_of_blocks(model, images, monkeypatch) == [1] * 3
