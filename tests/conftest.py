"""Fixtures shared by several test modules."""

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def same_random_start():
    """Every test starts from the same random state, whichever tests ran before it in its process: with two
    pytest-xdist workers the order differs from run to run, and a test drawing unseeded inputs would too."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture()
def keep_torch_threads():
    """Leave torch's thread count as the test found it (commands under test set it from --threads)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
