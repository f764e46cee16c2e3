from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from taste_cl.adapters.device.loader import training_build_installed

TRAINING_BUILD_MISSING = (
    "needs ONNX Runtime's training build (onnxruntime-training-cpu 1.19.2, deprecated upstream; the [onnx-training] "
    "extra), and this venv has plain onnxruntime or none: CI runs these in a venv with .[onnx-training,test] (`-m training_build`)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, saying why, the tests marked ``training_build`` where the training build is not installed."""
    if training_build_installed():
        return
    skip = pytest.mark.skip(reason=TRAINING_BUILD_MISSING)
    for item in items:
        if item.get_closest_marker("training_build") is not None:
            item.add_marker(skip)


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
