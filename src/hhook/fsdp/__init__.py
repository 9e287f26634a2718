r"""THC compression for FSDP2 (``torch.distributed.fsdp.fully_shard``) and custom HSDP.

:func:`register` puts a :class:`THCReduceScatter` on every ``FSDPModule`` of a model.
FSDP's reduce-scatter input is a flat buffer of ``world_size`` per-rank chunks (dim 0
padded). Each chunk is one THC message of the shared format (:mod:`hhook.scales.message`: the
prefix with count, status and fingerprints, then the codes), encoded by the agreed scale
policy (:class:`hhook.scales.ScalePolicy`) under the key ``(module name, chunk index)``,
with its rotation blocks inside the chunk. The scale vectors of all chunks are
MAX-allreduced together (every rank knows the scales of every chunk it encodes), the
messages of all chunks go through the stock ``reduce_scatter_tensor`` with SUM (lanes
add without carries), and each rank decodes only its own chunk's summed message: the
mean over the shard group, written into FSDP's output.

FSDP's reduction is made a plain SUM (``set_force_sum_reduction_for_comms(True)``).

* 1-D FSDP without a user divide factor: FSDP's division is switched off
  (``set_gradient_divide_factor(1.0)``) and the decode's mean is the result.
* 1-D FSDP with a factor the user set before :func:`register`: the comm returns the sum
  (mean times world size) and FSDP divides by that factor, as plain FSDP2 would.
* Native 2-D HSDP (``fully_shard(mesh=2-D mesh)``): the comm returns the sum over the
  shard group; FSDP then runs its own (dense, uncompressed) SUM all-reduce over the
  replicate group and divides by its factor (the whole data-parallel size unless the
  user set one). Only the reduce-scatter is compressed; to compress the replica
  all-reduce too, use :func:`register_hsdp` on a 1-D shard mesh.
* FSDP2's ``replicate`` (a mesh with a replicate dimension only) has no reduce-scatter:
  :func:`register` refuses it.

Predicted scales are refused: a key's predicted scales come from the summed thermometer
counts of its message, but after a reduce-scatter only rank ``j`` holds the sums of chunk
``j``, while every rank encodes chunk ``j`` at the next step; sharing them would cost the
extra round predicted scales exist to save. Gathered scales are refused too: they hand every
rank every rank's whole message, where a reduce-scatter hands each its own shard.

Custom HSDP (:func:`register_hsdp`): 1-D FSDP over the ranks of one node plus
``set_all_reduce_hook`` running :func:`hhook.thc_allreduce` over the replica group
(every rank with the same shard rank), which averages over replicas and returns the
same bits on every replica (or FSDP2's own dense reduction, where ``bits="auto"`` runs
``dense``). The layout is checked at registration.
"""

from .all_gather import AllGatherOptions
from .hsdp import register_hsdp
from .reduce_scatter import THCReduceScatter
from .register import all_gather_stats, compress_all_gather, register

__all__ = ["register", "register_hsdp", "compress_all_gather", "all_gather_stats", "AllGatherOptions",
           "THCReduceScatter"]
