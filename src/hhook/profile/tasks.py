r"""Training tasks that need no download: scikit-learn's bundled 8x8 handwritten digits.

The examples (``examples/ddp_train.py``, ``examples/horovod_train.py``) and
``hhook-profile train`` share the data split, the sharding and the models defined here.

Models of ``hhook-profile train`` (``--model``):

``wide-cnn``
    Communication-bound: two small convolutions, then a 4096 x 1280 fully connected
    layer; 5.3M parameters (21 MB of float32 gradients) for about 0.6 GFLOP per batch
    of 32. Compression has the most to gain here.
``deep-cnn``
    Compute-heavier: four 3x3 convolutions of 64 channels at full 8x8 resolution;
    0.12M parameters (0.5 MB of gradients) for about as many FLOPs as ``wide-cnn``:
    a hundred times more compute per gradient byte.
    Communication is a small part of a step: compression has little to gain.
``resnet18``
    ResNet-18 as for CIFAR (a 3x3 stem without pooling, four stages of two basic blocks,
    64 to 512 channels, batch norm), on the digits as 1x8x8 images: 11.2M parameters
    (45 MB of float32 gradients), torchvision's resnet18 size, built here without it.
    A real CNN's buckets: ``ci/gpu_check.sh``'s step stage trains it on a GPU.
``mlp``
    The examples' 64-256-256-10 MLP (85k parameters): a step takes about a millisecond,
    for quick checks and tests.
``gpt``
    A small decoder-only transformer (byte tokens, 4 pre-norm layers of width 256, 4
    heads, causal attention, 64-byte context; 3.3M parameters) trained on English text
    that ships with every Python (``pydoc_data.topics``, the help topics, about 0.8 MB):
    next-byte prediction, judged by validation loss (and next-byte accuracy).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn


def load(rank: int, world: int):
    """``(x_train, y_train, x_test, y_test, shard)``: a fixed 75/25 split of the digits,
    pixels scaled to [0, 1] and flattened to 64 features; ``shard`` holds the training
    indices of this rank (every ``world``-th sample from ``rank``)."""
    from .deps import require

    load_digits = require("sklearn.datasets", "the bundled digits task").load_digits
    train_test_split = require("sklearn.model_selection", "the bundled digits task").train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)
    x_train, x_test = (torch.tensor(a, dtype=torch.float32) for a in (x_train, x_test))
    y_train, y_test = (torch.tensor(a) for a in (y_train, y_test))
    return x_train, y_train, x_test, y_test, shard(len(x_train), rank, world)


def shard(n: int, rank: int, world: int) -> torch.Tensor:
    """Training indices of ``rank``: every ``world``-th of ``n`` samples from ``rank``."""
    return torch.arange(rank, n, world)


def make_model(hidden: int) -> nn.Module:
    """The examples' MLP: 64 -> hidden -> hidden -> 10."""
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def batches(shard: torch.Tensor, batch_size: int, epochs: int | None):
    """Index batches of this rank's shard, reshuffled each epoch (same order on every run);
    ``epochs=None`` goes on for ever."""
    epoch = 0
    while epochs is None or epoch < epochs:
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield order[i : i + batch_size]
        epoch += 1


def wide_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 1280), nn.ReLU(),
        nn.Linear(1280, 10),
    )


def deep_cnn(channels: int = 64, layers: int = 4) -> nn.Module:
    body: list[nn.Module] = [nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, channels, 3, padding=1), nn.ReLU()]
    for _ in range(layers - 1):
        body += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
    body += [nn.MaxPool2d(2), nn.Flatten(), nn.Linear(channels * 16, 10)]
    return nn.Sequential(*body)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 convolution when the
    stride or the width changes), as in torchvision's resnet18."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet18(width: int = 64, classes: int = 10) -> nn.Module:
    """ResNet-18 for small images (the CIFAR variant: 3x3 stem, no max pool) on the
    digits' flat 64 pixels; ``width`` channels in the first stage, doubling per stage."""
    layers: list[nn.Module] = [nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, width, 3, 1, 1, bias=False),
                               nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage in range(4):
        cout = width << stage
        layers += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


#: The gpt task's context (bytes per training window) and its held-out share of the text.
CONTEXT, VALIDATION_SHARE, VALIDATION_WINDOWS = 64, 0.1, 256


def load_text(context: int = CONTEXT):
    """``(x_train, y_train, x_val, y_val)`` of next-byte prediction on the Python help
    topics (``pydoc_data.topics``, in every CPython; no download): non-overlapping windows
    of ``context + 1`` bytes, the last 10% of the text held out for validation."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    windows = data[: len(data) // (context + 1) * (context + 1)].view(-1, context + 1)
    split = int(len(windows) * (1 - VALIDATION_SHARE))
    train, val = windows[:split], windows[split:][:VALIDATION_WINDOWS]
    return train[:, :-1], train[:, 1:], val[:, :-1], val[:, 1:]


class TinyGPT(nn.Module):
    """Decoder-only transformer over bytes: token and position embeddings, pre-norm
    causal self-attention blocks, a final layer norm and a linear head."""

    def __init__(self, vocab: int = 256, context: int = CONTEXT, width: int = 256, layers: int = 4, heads: int = 4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def load_digits_split():
    return load(0, 1)[:4]


@dataclasses.dataclass(frozen=True)
class Task:
    """A model, its data (``load() -> (x_train, y_train, x_test, y_test)``) and the
    optimizer settings it trains well with."""

    name: str
    build: Callable[[], nn.Module]
    lr: float
    batch_size: int
    summary: str
    load: Callable[[], tuple] = load_digits_split


TASKS = {
    t.name: t
    for t in (
        Task("wide-cnn", wide_cnn, 0.02, 32, "communication-bound CNN, 5.3M parameters"),
        Task("deep-cnn", deep_cnn, 0.05, 32, "compute-heavier CNN, 0.12M parameters"),
        Task("resnet18", resnet18, 0.05, 32, "ResNet-18 (CIFAR variant) on the digits as 8x8 images, 11.2M "
             "parameters"),
        Task("mlp", lambda: make_model(256), 0.05, 32, "the examples' MLP, 85k parameters"),
        Task("gpt", TinyGPT, 0.1, 16, "decoder-only transformer on the Python help topics (bytes), 3.3M parameters",
             load_text),
    )
}
