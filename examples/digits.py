"""The task both examples train: scikit-learn's bundled 8x8 handwritten digits (no download)."""

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def load(rank: int, world: int):
    """``(x_train, y_train, x_test, y_test, shard)``: a fixed 75/25 split; ``shard`` holds the
    training indices of this rank (every ``world``-th sample from ``rank``)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)
    x_train, x_test = (torch.tensor(a, dtype=torch.float32) for a in (x_train, x_test))
    y_train, y_test = (torch.tensor(a) for a in (y_train, y_test))
    return x_train, y_train, x_test, y_test, torch.arange(rank, len(x_train), world)


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def batches(shard: torch.Tensor, batch_size: int, epochs: int):
    """Index batches of this rank's shard, reshuffled each epoch (same order on every run)."""
    for epoch in range(epochs):
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield order[i : i + batch_size]
