"""Plug your own replay strategy into OnlineLearner: a FIFO ("most recent") buffer.

A strategy implements ``add``, ``sample`` and ``__len__`` (plus ``state_dict`` and
``load_state_dict`` for checkpoints). ``BufferStorage`` does the tensor bookkeeping;
``check_replay_strategy`` verifies the contract before you trust it in production.

Run: python examples/custom_replay.py
"""

from __future__ import annotations

import sys

import torch

from taste_cl import BufferStorage, ReplayStrategy, ReservoirReplay
from taste_cl.datasets import split_digits
from taste_cl.reference import build_digits_learner
from taste_cl.experiment import run_class_incremental
from taste_cl.testing import check_replay_strategy


class FIFOReplay(ReplayStrategy):
    """Keep the ``capacity`` most recent samples; rehearse uniformly among them."""

    def __init__(self, capacity: int, *, seed: int = 0) -> None:
        self.capacity = capacity
        self.seed = seed
        self._storage = BufferStorage(capacity)
        self._next = 0  # slot the next sample overwrites once full
        self._generator = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._storage.check_batch(x, y)
        for i in range(x.shape[0]):
            if len(self._storage) < self.capacity:
                self._storage.append(x[i : i + 1], y[i : i + 1])
            else:
                self._storage.write(torch.tensor([self._next]), x[i : i + 1], y[i : i + 1])
                self._next = (self._next + 1) % self.capacity

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        picks = torch.randperm(len(self._storage), generator=self._generator)[:n]
        return self._storage.gather(picks)

    def __len__(self) -> int:
        return len(self._storage)

    def state_dict(self) -> dict:
        return {"storage": self._storage.state_dict(), "next": self._next, "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._storage.load_state_dict(state["storage"])
        self._next = int(state["next"])
        self._generator.set_state(state["generator"])


def main() -> None:
    check_replay_strategy(FIFOReplay(capacity=16))
    print("FIFOReplay passes check_replay_strategy")
    tasks = split_digits(5)
    print(f"{'replay':<9}  {'final acc':>9}  {'forgetting':>10}")
    for name, replay in (("fifo", FIFOReplay(200)), ("reservoir", ReservoirReplay(200))):
        torch.manual_seed(0)
        learner = build_digits_learner(replay=replay)
        # a progress bar when someone watches (not in pipes or logs)
        result = run_class_incremental(learner, tasks, batch_size=10, progress=sys.stderr.isatty())
        print(f"{name:<9}  {result.final_accuracy:>9.3f}  {result.forgetting:>10.3f}")


if __name__ == "__main__":
    main()
