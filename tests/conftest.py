"""Fixtures shared by several test modules."""

import os
import random

import numpy as np
import pytest
import torch

_OWN_CACHE: list[str] = []


def pytest_configure(config):
    """The suite's own user cache (weights, engines, choices), new for each run (its xdist workers inherit it),
    where the caller set none: tests that fall back to $VITLAB_CACHE wrote into ~/.cache/vitlab, and a later run
    of the same test read its earlier run's cached engine choice instead of timing (seen: a test passed with the
    rest of its file and failed alone)."""
    if not os.environ.get("VITLAB_CACHE"):
        import tempfile

        _OWN_CACHE.append(tempfile.mkdtemp(prefix="vitlab-test-cache-"))
        os.environ["VITLAB_CACHE"] = _OWN_CACHE[0]


    # A ViT trained outside `vitlab train` times its products' route at its first training forward (fast_linear
    # "auto"); near a ratio of 1.0 the pick follows the moment's timing, so the suite pins oneDNN, as before
    # "auto" existed. tests/test_train_products.py sets its own values.
    os.environ.setdefault("VITLAB_TORCH_PRODUCTS_SPEEDUP", "1.0")


def pytest_unconfigure(config):
    if _OWN_CACHE:
        import shutil

        shutil.rmtree(_OWN_CACHE.pop(), ignore_errors=True)


@pytest.fixture(autouse=True)
def same_random_start():
    """Every test starts from the same random state, whichever tests ran before it in its process: with two
    pytest-xdist workers the order differs from run to run, and a test drawing unseeded inputs would too."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def idle_load_average(monkeypatch):
    """Training's automatic thread count reads the load average (1 thread on a busy machine, runtime.auto_threads).
    Under the suite's own load a test's reference run and its interrupted run could take different counts, and so
    different bits: a resume test then failed by chance. Tests see an idle machine unless they set a load."""
    if hasattr(os, "getloadavg"):
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


@pytest.fixture()
def keep_torch_threads():
    """Leave torch's thread count as the test found it (commands under test set it from --threads)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def two_threads(keep_torch_threads):
    """torch on two threads in this test (rules that take one thread for small calls act only where there are more)."""
    torch.set_num_threads(2)
