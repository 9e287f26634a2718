"""The task both examples train: scikit-learn's bundled 8x8 handwritten digits (no download).

The code lives in :mod:`hhook.profile.tasks`, which ``hhook-profile train`` shares."""

from hhook.profile.tasks import batches, load, make_model

__all__ = ["batches", "load", "make_model"]
