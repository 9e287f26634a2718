"""The task both examples train: scikit-learn's bundled 8x8 handwritten digits (no download),
and the result both report.

The task's code lives in :mod:`hhook.profile.tasks`, which ``hhook-profile train`` shares."""

import torch

from hhook.profile.tasks import batches, load, make_model

__all__ = ["batches", "load", "make_model", "result_of", "result_line"]


def result_of(model, x_test, y_test, steps: int, loss, seconds: float, wire: int | None, **fields) -> dict:
    """A run's result: ``fields`` (what ran), then test accuracy, loss, time and the bytes
    each rank handed to collectives against dense float32 (``wire`` None: dense)."""
    n_params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    dense = 4 * n_params * steps
    wire = dense if wire is None else wire
    return {**fields, "params": n_params, "steps": steps, "test_accuracy": accuracy, "final_loss": loss.item(),
            "seconds": seconds, "dense_bytes": dense, "wire_bytes": wire, "ratio": dense / wire}


def result_line(label: str, result: dict, where: str = "") -> str:
    """The line rank 0 prints (``where``: e.g. the launcher)."""
    dense, wire = result["dense_bytes"], result["wire_bytes"]
    return (f"{label:<14} ranks={result['world_size']} {where}steps={result['steps']} "
            f"test_accuracy={result['test_accuracy']:.4f} final_loss={result['final_loss']:.4f} "
            f"wire={wire / 2**20:.2f} MiB/rank dense={dense / 2**20:.2f} MiB/rank "
            f"ratio={dense / wire:.2f}x time={result['seconds']:.1f}s")
