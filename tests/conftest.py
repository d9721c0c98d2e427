"""Fixtures shared by several test modules."""

import pytest
import torch


@pytest.fixture()
def keep_torch_threads():
    """Leave torch's thread count as the test found it (commands under test set it from --threads)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
