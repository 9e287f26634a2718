r"""Across data centers: DiLoCo's outer synchronization through THC on the stock allreduce
(docs/diloco.md, DESIGN.md sec. 14).

Each site (ranks with fast links inside: DDP or FSDP2 there, optionally with hhook's
per-step hook) trains ``H`` inner steps on its own; then the sites average the
pseudo-gradient (outer parameters minus local ones) through THC, lanes sized for the
number of sites, on one ring per local rank; an outer optimizer (SGD, Nesterov, lr 0.7,
momentum 0.9) steps the outer copy and every site continues from it. Streamed in
fragments, each exchange overlaps the next inner steps::

    sites = hhook.diloco.find_sites("auto")                  # every rank, once
    model = DDP(net, process_group=sites.site_group)
    outer = hhook.diloco.DiLoCo(model, opt, sites, every=50, bits=4, fragments=4, overlap=2)
    ...  loss.backward(); opt.step(); opt.zero_grad(); outer.step()
"""

from .sites import Sites, find_sites, sites_of_groups
from .sync import DiLoCo, nesterov_sgd

__all__ = ["DiLoCo", "Sites", "find_sites", "nesterov_sgd", "sites_of_groups"]
