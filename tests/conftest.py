from __future__ import annotations

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state, so results are reproducible."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def digits_tasks():
    from taste_cl.datasets import split_digits

    return split_digits(5)


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test: small models on a shared 2-core machine
    run far faster and steadier than on two (a busy neighbour makes each op wait)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
