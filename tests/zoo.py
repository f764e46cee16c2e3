"""The real-model zoo every feature is tried on: common architectures, random weights, small inputs.

Each :class:`ZooCase` builds a fresh model, its loss and optimizer, and makes batches of a
learnable synthetic task (the target is a fixed function of the input), so a few dozen steps
lower the loss. Nothing is downloaded: torchvision models are built with ``weights=None``.

>>> case = ZOO["regression_mlp"]
>>> model, loss_fn, optimizer = case.build()
>>> x, y = case.batch(4)
>>> tuple(model(x).shape), tuple(y.shape)
((4, 1), (4,))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from taste_cl.datasets import TextClassifier

__all__ = ["ZOO", "DictTextClassifier", "KeywordSpotter", "LSTMClassifier", "TextClassifier", "TokenTagger", "ZooCase"]

NUM_CLASSES = 4
VOCAB = 50
SEQ_LEN = 12
MFCC, FRAMES = 40, 98  # a 1 s keyword clip: 40 coefficients x 98 frames of 10 ms


class TokenTagger(nn.Module):
    """Embedding + GRU tagging every token: outputs ``(n, classes, t)`` for CrossEntropyLoss."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden).transpose(1, 2)


class LSTMClassifier(nn.Module):
    """LSTM over float sequences ``(n, t, features)``, classifying from the last hidden state."""

    def __init__(self, features: int = 8, dim: int = 32, classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, dim, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = self.lstm(x)
        return self.head(hidden[-1])


class KeywordSpotter(nn.Module):
    """A 1-D conv keyword-spotting net over MFCC-like frames ``(n, coefficients, frames)``:
    Conv1d + BatchNorm1d + ReLU blocks (two of stride 2), global average pooling, a linear head."""

    def __init__(self, coefficients: int = MFCC, width: int = 32, classes: int = NUM_CLASSES) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index, stride in enumerate((1, 2, 2)):
            layers += [nn.Conv1d(coefficients if index == 0 else width, width, 3, stride, 1, bias=False), nn.BatchNorm1d(width), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(-1))


class DictTextClassifier(TextClassifier):
    """The text transformer returning a Hugging Face style dict: ``{"logits": (n, classes),
    "hidden_states": (n, t, dim)}`` (the embeddings), which the learner must pick ``logits`` from."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"logits": super().forward(input_ids, attention_mask), "hidden_states": self.embed(input_ids)}


@dataclass(frozen=True)
class ZooCase:
    """One architecture: ``build()`` -> (model, loss_fn, optimizer); ``batch(n)`` -> (x, y)."""

    name: str
    make_model: Callable[[], nn.Module]
    loss_fn: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    make_batch: Callable[[int, torch.Generator], tuple[Any, torch.Tensor]]
    has_batchnorm: bool = False

    def build(self, seed: int = 0) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = self.make_model()
        return model, self.loss_fn(), self.make_optimizer(model)

    def batch(self, n: int, seed: int = 0) -> tuple[Any, torch.Tensor]:
        return self.make_batch(n, torch.Generator().manual_seed(seed))


def _image_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Class = which quadrant is brightest (learnable by any CNN)."""
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    x = torch.randn(n, 3, 32, 32, generator=g) * 0.5
    for i, label in enumerate(y.tolist()):
        row, col = divmod(label, 2)
        x[i, :, row * 16 : row * 16 + 16, col * 16 : col * 16 + 16] += 1.5
    return x, y


def _keyword_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Class = which band of 10 coefficients is loud during the clip's middle half."""
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    x = torch.randn(n, MFCC, FRAMES, generator=g) * 0.5
    for i, label in enumerate(y.tolist()):
        x[i, label * 10 : label * 10 + 10, FRAMES // 4 : 3 * FRAMES // 4] += 1.5
    return x, y


def _text_batch(n: int, g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Class = which token range dominates; padded tails masked out."""
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    band = (VOCAB - 2) // NUM_CLASSES
    ids = 2 + y[:, None] * band + torch.randint(0, band, (n, SEQ_LEN), generator=g)
    lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (n,), generator=g)
    mask = (torch.arange(SEQ_LEN)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}, y


def _token_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's tag = its id modulo the classes; padding (id 0) tagged -100 (ignored)."""
    tokens = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=g)
    tokens[:, -2:] = 0
    tags = tokens % NUM_CLASSES
    tags[tokens == 0] = -100
    return tokens, tags


def _sequence_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Class = sign pattern of the mean of two feature channels."""
    x = torch.randn(n, 10, 8, generator=g)
    mean = x[:, :, :2].mean(1)
    y = (mean[:, 0] > 0).long() * 2 + (mean[:, 1] > 0).long()
    return x, y


_W_REG = torch.Generator().manual_seed(1)
_REG_WEIGHTS = torch.randn(16, generator=_W_REG)
_LABEL_WEIGHTS = torch.randn(16, 5, generator=_W_REG)


def _regression_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 16, generator=g)
    return x, torch.tanh(x @ _REG_WEIGHTS / 4) * 2


def _multilabel_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 16, generator=g)
    return x, (x @ _LABEL_WEIGHTS > 0).float()


def _tabular_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :NUM_CLASSES] * 2 + x[:, NUM_CLASSES : 2 * NUM_CLASSES]).argmax(1)


def _sgd(lr: float, momentum: float = 0.0) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def _adamw(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.AdamW(model.parameters(), lr=lr)


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision  # the [avalanche] extra brings it; the zoo needs it

        return getattr(torchvision.models, name)(weights=None, num_classes=NUM_CLASSES)

    return build


ZOO: dict[str, ZooCase] = {
    case.name: case
    for case in (
        ZooCase("resnet18", _torchvision("resnet18"), nn.CrossEntropyLoss, _sgd(0.05, 0.9), _image_batch, True),
        ZooCase("mobilenet_v2", _torchvision("mobilenet_v2"), nn.CrossEntropyLoss, _sgd(0.05, 0.9), _image_batch, True),
        ZooCase("mobilenet_v3_small", _torchvision("mobilenet_v3_small"), nn.CrossEntropyLoss, _sgd(0.05, 0.9), _image_batch, True),
        ZooCase("keyword_spotter", KeywordSpotter, nn.CrossEntropyLoss, _sgd(0.05, 0.9), _keyword_batch, True),
        ZooCase("text_transformer", TextClassifier, nn.CrossEntropyLoss, _adamw(3e-3), _text_batch),
        ZooCase("text_transformer_dict", DictTextClassifier, nn.CrossEntropyLoss, _adamw(3e-3), _text_batch),
        ZooCase("token_tagger", TokenTagger, nn.CrossEntropyLoss, _adamw(1e-2), _token_batch),
        ZooCase("lstm", LSTMClassifier, nn.CrossEntropyLoss, _adamw(1e-2), _sequence_batch),
        ZooCase(
            "regression_mlp",
            lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
            nn.MSELoss,
            _sgd(0.05),
            _regression_batch,
        ),
        ZooCase(
            "multilabel_mlp",
            lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5)),
            nn.BCEWithLogitsLoss,
            _sgd(0.5),
            _multilabel_batch,
        ),
        ZooCase(
            "batchnorm_mlp",
            lambda: nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, NUM_CLASSES)),
            nn.CrossEntropyLoss,
            _sgd(0.1),
            _tabular_batch,
            True,
        ),
    )
}
