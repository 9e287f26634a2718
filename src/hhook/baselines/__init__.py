r"""Published compressors that THC is measured against, for ``hhook-profile train``.

Not part of hhook's API and not imported by ``import hhook``: these are benchmark
baselines, kept apart from the homomorphic (THC) path.

* :mod:`hhook.baselines.golomb` - Golomb coding of positions (vectorised bit packing).
* :mod:`hhook.baselines.sbc` - Sparse Binary Compression (Sattler et al., arXiv 1805.08768):
  weight updates after local steps, one sign group as +-mean plus Golomb-coded positions.
* :mod:`hhook.baselines.lgc` - Learned Gradient Compression, ring-allreduce variant
  (Abrahamyan et al., arXiv 2103.08870). **LGC is patented** (WO2021245072A1 / EP3920097 /
  US20230222354A1, imec and VUB): it is a benchmark baseline only and deliberately not
  exported here; import it explicitly from ``hhook.baselines.lgc`` to measure it.
"""

from . import golomb
from .sbc import SBC, sbc_compress

__all__ = ["golomb", "SBC", "sbc_compress"]
