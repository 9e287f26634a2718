r"""DiLoCo's outer synchronization through THC on the stock allreduce (DESIGN.md sec. 14).

Every site trains ``every`` (H) inner steps on its own; then the sites average the
pseudo-gradient (the outer parameters minus the local ones) with one THC allreduce per
ring (:func:`hhook.thc_allreduce_async`: rotation, agreed scales, correlated rounding,
lanes sized for the number of sites, a stock SUM), an outer optimizer (SGD, Nesterov, lr
0.7, momentum 0.9) steps the outer copy with that mean, and every site continues from it.

Streaming (``fragments=P``): the parameters in ``P`` strided fragments
(:mod:`hhook.diloco.fragments`), fragment ``p`` synced at its own offset in each period of
``H`` steps; with ``overlap=tau`` its exchange is a future that runs while the next ``tau``
inner steps compute, and is merged after them: the fragment becomes the new outer value
plus the local progress made meanwhile. ``overlap=0`` waits at once (DiLoCo itself).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re

import torch
import torch.distributed as dist

from .. import THCState, thc_allreduce_async
from ..errors import PeerLostError, PeerTimeoutError, explain
from ..schedule.dense import count, plain_allreduce
from ..stats import Counters
from .fragments import Fragment, partition
from .sites import Sites, check_agreement, explained, find_sites, peers

logger = logging.getLogger(__name__)

#: Version of :meth:`DiLoCo.state_dict`'s layout.
STATE_FORMAT = 1


def nesterov_sgd(params: list) -> torch.optim.Optimizer:
    """The default outer optimizer (DiLoCo's): SGD with Nesterov momentum 0.9, lr 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclasses.dataclass
class _Exchange:
    """A fragment's exchange in flight: its future (None once read or restored), the inner
    step it was launched after and the one it merges after, the local shard at launch
    (``overlap > 0``) and, once read, the mean pseudo-gradient."""

    future: torch.futures.Future | None
    launched_at: int
    merge_at: int
    snap: torch.Tensor | None
    mean: torch.Tensor | None = None


class DiLoCo:
    r"""The outer synchronizer: construct it once on every rank, call :meth:`step` after
    every inner optimizer step.

    Args:
        model: the module trained inside the site (plain, DDP or FSDP2 on
            ``sites.site_group``); its parameters that ``inner_optimizer`` updates are
            synchronized (buffers stay each site's own).
        inner_optimizer: the site's optimizer (any; AdamW in DiLoCo), or None: every
            parameter that requires grad.
        sites: a :class:`~hhook.diloco.Sites`, or ``ranks_per_site`` for
            :func:`~hhook.diloco.find_sites` (default ``"auto"``: sites are nodes).
        every: H, inner steps between two syncs of a fragment.
        bits: THC's bits per coordinate (1..8), ``"auto"`` (the error rule's width for the number of
            sites, not measured: docs/usage.md#defaults-of-each-entry-point), or None: an fp32 allreduce.
        error_feedback: carry each rank's rounding error into its next outer exchange.
        fragments: P (layer ``i`` in fragment ``i mod P``) or lists of parameter names.
        overlap: inner steps an exchange runs behind before it is merged (0..H/P).
        outer_optimizer: ``params -> torch.optim.Optimizer`` over the outer shards
            (default :func:`nesterov_sgd`).
        seed, block_size: THC's (:class:`hhook.THCState`).

    Construction is collective (the options check, then every site starts from site 0's
    parameters, as DDP broadcasts at construction). Differing options, inner-step counts
    or parameter shapes between ranks raise :class:`~hhook.errors.ConfigMismatchError` on
    every rank; a site that dies or stalls makes the others raise
    :class:`~hhook.errors.PeerLostError` or :class:`~hhook.errors.PeerTimeoutError` naming
    it, from the :meth:`step` that merges the exchange. A world of one site trains
    locally (one log line): :meth:`step` only counts.

    Example::
        >>> sites = hhook.diloco.find_sites("auto")
        >>> model = DDP(net, process_group=sites.site_group)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=4e-4)
        >>> outer = hhook.diloco.DiLoCo(model, opt, sites, every=50, bits=4)
        >>> for x, y in data:
        ...     loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        ...     outer.step()
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer=None, sites: Sites | int | str | None = None, *,
                 every: int = 50, bits: int | str | None = 4, error_feedback: bool = False, fragments=1, overlap: int = 0,
                 outer_optimizer=None, seed: int = 0, block_size: int = 1024):
        named = _synchronized(model, inner_optimizer)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"hhook.diloco: every (H) must be a positive integer, got {every!r}")
        if bits is not None:
            THCState.validate(bits=bits, seed=seed, block_size=block_size, error_feedback=error_feedback)
        groups = partition(named, fragments)
        if every < len(groups):
            raise ValueError(f"hhook.diloco: every={every} inner steps cannot hold {len(groups)} staggered fragments")
        if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap <= every // len(groups):
            raise ValueError(f"hhook.diloco: overlap must be an integer in 0..{every // len(groups)} (H/P: one "
                             f"fragment in flight at a time), got {overlap!r}")
        self.sites = sites if isinstance(sites, Sites) else find_sites("auto" if sites is None else sites)
        self.every, self.bits, self.error_feedback, self.overlap = every, bits, bool(error_feedback), overlap
        self.seed, self.block_size = seed, block_size
        k, j = self.sites.ranks_per_site, self.sites.local_rank
        self.fragments = [Fragment(i, g, k, j) for i, g in enumerate(groups)]
        self.offsets = [(p + 1) * every // len(groups) % every for p in range(len(groups))]
        self.position = self.syncs = 0
        self.pending: dict[int, _Exchange] = {}
        self.counters = Counters()  # the fp32 exchange's bytes (THC's: its state's stats)
        self.thc, self._unchecked = None, False
        if self.sites.n_sites == 1:
            logger.warning("hhook.diloco: a world of one site (%s): no outer synchronization, plain local training",
                           self.sites.describe())
        else:
            if bits is not None:
                self.thc = THCState(self.sites.ring, bits=bits, seed=seed, block_size=block_size,
                                    error_feedback=self.error_feedback)
            self._check()
            self._start_together()
        self.outer = [f.read() for f in self.fragments]
        self.outer_optimizer = (outer_optimizer or nesterov_sgd)(self.outer)

    # -- the schedule ---------------------------------------------------------------------
    def step(self) -> None:
        """After an inner optimizer step: merge the exchanges due now, then launch (and
        with ``overlap=0`` merge) the fragments whose offset this step is."""
        if self.sites.n_sites == 1:
            self.position += 1
            return
        if self._unchecked:
            self._check()
        self.position += 1
        t = self.position
        for p in sorted(self.pending):
            if self.pending[p].merge_at <= t:
                self._merge(p)
        for p, offset in enumerate(self.offsets):
            if t % self.every == offset:
                self._launch(p)
                if self.overlap == 0:
                    self._merge(p)

    def in_flight(self) -> int:
        """Exchanges launched and not merged yet."""
        return len(self.pending)

    def wait(self) -> None:
        """Wait for the exchanges in flight (their means are kept for their merge): before
        a checkpoint, and before the process groups are destroyed at the end of a run."""
        for p, exchange in self.pending.items():
            self._mean(p, exchange)

    def _launch(self, p: int) -> None:
        local = self.fragments[p].read()
        delta = self.outer[p] - local
        try:
            future = self._exchange(p, delta)
        except Exception as exc:  # noqa: BLE001 - a peer lost before the launch: named by its site
            err = _site_error(self.sites, p, self.position, exc)
            if err is exc:
                raise
            raise err from exc
        self.pending[p] = _Exchange(future, self.position, self.position + self.overlap, local if self.overlap else None)
        self.syncs += 1

    def _exchange(self, p: int, delta: torch.Tensor) -> torch.futures.Future:
        """Start averaging ``delta`` over this rank's ring; a future of the mean."""
        if self.thc is not None:
            return thc_allreduce_async(delta, self.thc, key=f"diloco.fragment{p}")
        count(self.counters, delta)  # the schedule's one dense fallback and its byte count
        with explained(f"hhook.diloco's fp32 exchange of fragment {p}", self.sites.ring):
            return plain_allreduce(delta, self.sites.ring, self.sites.n_sites)

    def _merge(self, p: int) -> None:
        exchange = self.pending.pop(p)
        mean = self._mean(p, exchange)
        if not bool(torch.isfinite(mean).all()):
            raise FloatingPointError(f"hhook.diloco: the mean pseudo-gradient of fragment {p} (inner step "
                                     f"{exchange.launched_at}) is not finite: a site's parameters hold inf or NaN")
        outer = self.outer[p]
        outer.grad = mean
        self.outer_optimizer.step()
        outer.grad = None
        new = outer if exchange.snap is None else outer + (self.fragments[p].read() - exchange.snap)
        self.fragments[p].write(new, self.sites.site_group)

    def _mean(self, p: int, exchange: _Exchange) -> torch.Tensor:
        """The exchange's mean, waited for once; a lost or stalled peer names its site."""
        if exchange.mean is None:
            try:
                exchange.mean = exchange.future.wait()
                if self.thc is not None:
                    self.thc.check_deferred(wait=True)  # a GPU decode's bad prefix: ConfigMismatchError here
            except Exception as exc:  # noqa: BLE001 - re-raised; a lost or stalled peer named by its site
                err = _site_error(self.sites, p, exchange.launched_at, exc)
                if err is exc:
                    raise
                raise err from exc
            exchange.future = None
        return exchange.mean

    # -- agreement and the common start ---------------------------------------------------
    def _options(self) -> dict:
        return {"every": self.every, "bits": self.bits, "fragments": len(self.fragments), "overlap": self.overlap,
                "error_feedback": self.error_feedback, "seed": self.seed, "block_size": self.block_size,
                "n_sites": self.sites.n_sites, "ranks_per_site": self.sites.ranks_per_site}

    def _check(self) -> None:
        """The options check (:func:`~hhook.diloco.sites.check_agreement`), blocking, on
        every rank: before the first exchange and again after :meth:`load_state_dict`."""
        shapes = hashlib.sha1(repr([f.digest() for f in self.fragments]).encode()).digest()
        common = {f"the option {name}": -1 if value is None else int(value) for name, value in self._options().items()}
        common["the fragments' parameters (names and shapes)"] = int.from_bytes(shapes[:8], "little") >> 2
        common["the inner steps done (a checkpoint of another step?)"] = self.position
        common["the checkpoint format"] = STATE_FORMAT
        lengths = hashlib.sha1(repr([f.digest(shapes=False) for f in self.fragments]).encode()).digest()
        check_agreement(self.sites, common, {"the shard lengths of this local rank": int.from_bytes(lengths[:8], "little") >> 2})
        self._unchecked = False

    def _start_together(self) -> None:
        """Every site takes site 0's parameters (each ring broadcasts its shard)."""
        source = self.sites.members[0][self.sites.local_rank]
        for fragment in self.fragments:
            shard = fragment.read()
            with explained("hhook.diloco's broadcast of site 0's parameters", self.sites.ring):
                dist.broadcast(shard, source, group=self.sites.ring)
            fragment.write(shard, self.sites.site_group)

    # -- checkpoints and statistics ---------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data (``torch.load(..., weights_only=True)`` reads it): the options, the
        inner steps done, the outer shards, the outer optimizer, THC's state (residuals,
        rounding counters) and the exchanges in flight (waited for: their means). Save it
        with the model and the inner optimizer; every rank saves its own."""
        self.wait()
        return {"format": STATE_FORMAT, "options": self._options(), "position": self.position, "syncs": self.syncs,
                "outer": [t.detach().clone() for t in self.outer], "outer_optimizer": self.outer_optimizer.state_dict(),
                "thc": None if self.thc is None else self.thc.state_dict(), "counters": self.counters.state_dict(),
                "pending": {p: {"launched_at": e.launched_at, "merge_at": e.merge_at, "mean": e.mean.clone(),
                                "snap": None if e.snap is None else e.snap.clone()} for p, e in self.pending.items()}}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict` (load the model and inner optimizer too): bit
        for bit, mid-period included. ValueError for a checkpoint of other options; the
        next :meth:`step` checks every rank's inner-step count and options again."""
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
            raise ValueError(f"hhook.diloco: not a DiLoCo.state_dict() of format {STATE_FORMAT}")
        differ = {k: (v, saved["options"].get(k)) for k, v in self._options().items() if saved["options"].get(k) != v}
        if differ or [len(t) for t in saved["outer"]] != [len(t) for t in self.outer]:
            raise ValueError(f"hhook.diloco: the checkpoint was saved with other options or shards "
                             f"(this run, checkpoint: {differ or 'shard lengths differ'})")
        with torch.no_grad():
            for mine, theirs in zip(self.outer, saved["outer"]):
                mine.copy_(theirs)
        self.outer_optimizer.load_state_dict(saved["outer_optimizer"])
        if self.thc is not None and saved["thc"] is not None:
            self.thc.load_state_dict(saved["thc"])
        self.counters.load_state_dict(saved["counters"])
        self.position, self.syncs = saved["position"], saved["syncs"]
        self.pending = {int(p): _Exchange(None, e["launched_at"], e["merge_at"], e["snap"], e["mean"])
                        for p, e in saved["pending"].items()}
        self._unchecked = self.sites.n_sites > 1

    def stats(self) -> dict:
        """This rank's figures: inner steps, fragment syncs launched (``syncs``) and outer
        steps (syncs / P), exchanges in flight, and the bytes it handed to collectives between sites
        (``wire_bytes``: THC's codes, scales and handshake, or the fp32 tensors; the
        start's broadcast and the checks not counted) against float32's (``dense_bytes``)."""
        counted = self.counters.snapshot() if self.thc is None else self.thc.stats()
        return {"sites": self.sites.n_sites, "ranks_per_site": self.sites.ranks_per_site, "inner_steps": self.position,
                "syncs": self.syncs, "outer_steps": self.syncs / len(self.fragments), "in_flight": len(self.pending),
                "wire_bytes": counted["wire_bytes"], "dense_bytes": counted["dense_bytes"],
                "exchange": "fp32" if self.bits is None else f"thc:{self.bits}"}


def _site_error(sites: Sites, p: int, launched_at: int, exc: BaseException) -> BaseException:
    """``exc`` as the error to raise: a lost or stalled peer (THC's error, or the fp32
    path's transport error explained) with the sites and the site of each rank it names;
    anything else as it is."""
    err = exc
    if not isinstance(exc, (PeerLostError, PeerTimeoutError)):
        err = explain(exc, f"hhook.diloco's exchange of fragment {p}", None, peers(sites.ring))
    if not isinstance(err, (PeerLostError, PeerTimeoutError)):
        return exc
    named = sorted({int(r) for r in re.findall(r"rank (\d+)", str(err))})
    where = "".join(f"; rank {r} is in site {sites.site_of(r)}" for r in named if sites.site_of(r) is not None)
    return type(err)(f"hhook.diloco: the outer exchange of fragment {p} (after inner step {launched_at}) between "
                     f"sites failed ({sites.describe()}{where}): {err}")


def _synchronized(model: torch.nn.Module, inner_optimizer) -> list[tuple[str, torch.Tensor]]:
    """The parameters of ``model`` the outer synchronization covers, in model order: those
    ``inner_optimizer`` updates (all that require grad without one)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if inner_optimizer is not None:
        held = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        known = {id(p) for _, p in model.named_parameters()}
        if held - known:
            raise ValueError("hhook.diloco: the inner optimizer updates tensors that are not the model's parameters")
        named = [(n, p) for n, p in named if id(p) in held]
    if not named:
        raise ValueError("hhook.diloco: the model has no parameter to synchronize")
    return named
