r"""DiLoCo's outer synchronization through THC on the stock allreduce (DESIGN.md sec. 14).

Every site trains ``every`` (H) inner steps on its own; then the sites average the
pseudo-gradient (the outer parameters minus the local ones) with one THC allreduce per
ring (:func:`hhook.thc_allreduce_async`: rotation, correlated rounding, the state's
default scales: gathered over 2-4 sites on CPUs, one all-gather, else agreed, lanes sized
for the number of sites, a stock SUM), an outer optimizer (SGD, Nesterov, lr
0.7, momentum 0.9) steps the outer copy with that mean, and every site continues from it.

Streaming (``fragments=P``): the parameters in ``P`` strided fragments
(:mod:`hhook.diloco.fragments`), fragment ``p`` synced at its own offset in each period of
``H`` steps; with ``overlap=tau`` its exchange is a future that runs while the next ``tau``
inner steps compute, and is merged after them: the fragment becomes the new outer value
plus the local progress made meanwhile (hhook's rule), or with ``alpha`` Streaming
DiLoCo's mix of the two. ``overlap=0`` waits at once (DiLoCo itself).

The common start (:meth:`DiLoCo.start`) runs before the model's first forward, not at
construction, so that loads before or after construction are alike: a fresh run takes site
0's parameters and buffers then, a resumed one keeps what the checkpoints hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import re

import torch
import torch.distributed as dist

from .. import THCState, thc_allreduce_async
from ..errors import ConfigMismatchError, PeerLostError, PeerTimeoutError, explain
from ..schedule.allreduce import connect
from ..schedule.dense import count, plain_allreduce
from ..stats import Counters
from . import checkpoint
from .checkpoint import STATE_FORMAT
from .fragments import Fragment, first_difference, partition
from .sites import (Sites, explained, find_sites, finished, gather_ints, gather_site, hold_one_model, peers,
                    say_finished)

logger = logging.getLogger(__name__)
_MADE = itertools.count()


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
            synchronized; every other parameter and buffer starts from site 0's.
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
        alpha: None (the merged fragment is the new outer value plus the local progress
            made while the exchange ran) or Streaming DiLoCo's mixing factor in [0, 1]
            (``alpha * local + (1 - alpha) * outer``).
        outer_optimizer: ``params -> torch.optim.Optimizer`` over the outer shards
            (default :func:`nesterov_sgd`).
        seed, block_size: THC's (:class:`hhook.THCState`).

    Construction checks the options on every rank; :meth:`start` (the common start, by
    itself before the model's first forward) takes every parameter and buffer from site
    0, as DDP's construction, or after :meth:`load_state_dict` checks that the model holds
    the checkpoint's weights: resume works in any order of loads and construction before
    the first forward. Differing options (the outer optimizer's too), inner-step counts
    or parameters raise :class:`~hhook.errors.ConfigMismatchError` on every rank; a site
    that dies or stalls makes the others raise :class:`~hhook.errors.PeerLostError` or
    :class:`~hhook.errors.PeerTimeoutError` naming it. A world of one site trains locally
    (one log line): :meth:`step` only counts.

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
                 alpha: float | None = None, outer_optimizer=None, seed: int = 0, block_size: int = 1024):
        named = _synchronized(model, inner_optimizer)
        groups = _validated_options(named, every, bits, error_feedback, fragments, overlap, alpha, seed, block_size)
        self.sites = sites if isinstance(sites, Sites) else find_sites("auto" if sites is None else sites)
        self.every, self.bits, self.error_feedback, self.overlap = every, bits, bool(error_feedback), overlap
        self.alpha, self.seed, self.block_size = None if alpha is None else float(alpha), seed, block_size
        k, j = self.sites.ranks_per_site, self.sites.local_rank
        self.fragments = [Fragment(i, g, k, j) for i, g in enumerate(groups)]
        self.offsets = [(p + 1) * every // len(groups) % every for p in range(len(groups))]
        self.position = self.syncs = 0
        self.pending: dict[int, _Exchange] = {}
        self.counters = Counters()  # the fp32 exchange's bytes (THC's: its state's stats)
        self.thc, self.started, self._resumed_model = None, False, None
        self._others = _unsynchronized(model, named)
        self._tag = str(next(_MADE))  # this synchronizer's keys in the job's store (made alike on every rank)
        self._outer_factory = outer_optimizer or nesterov_sgd
        self.outer = [f.read() for f in self.fragments]
        self.outer_optimizer = self._outer_factory(self.outer)
        if self.sites.n_sites == 1:
            logger.warning("hhook.diloco: a world of one site (%s): no outer synchronization, plain local training",
                           self.sites.describe())
        else:
            if bits is not None:
                self.thc = THCState(self.sites.ring, bits=bits, seed=seed, block_size=block_size,
                                    error_feedback=self.error_feedback)
            _agree(self)
        self._hook = model.register_forward_pre_hook(lambda module, args: self.start(), prepend=True)

    # -- the schedule ---------------------------------------------------------------------
    def step(self) -> None:
        """After an inner optimizer step: merge the exchanges due now, then launch (and
        with ``overlap=0`` merge) the fragments whose offset this step is."""
        if not self.started:  # (no forward through the module given: call start() before training)
            self.start()
        if self.sites.n_sites == 1:
            self.position += 1
            return
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
        return len(self.pending)  # exchanges launched and not merged yet

    def wait(self) -> None:
        """Wait for the exchanges in flight (their means are kept for their merge): before
        a checkpoint, and before the process groups are destroyed at the end of a run."""
        for p, exchange in self.pending.items():
            self._mean(p, exchange)

    def finish(self) -> None:
        """End on one model and leave cleanly (collective; every site after the same inner
        step, else ConfigMismatchError on every rank naming each site's count): merge the
        exchanges in flight, exchange every fragment once more and write the common outer
        parameters into the model, so every site holds the same (evaluation, export)."""
        self.start()
        if self.sites.n_sites == 1:
            return
        say_finished(self.sites, self._tag, self.position)
        for p in sorted(self.pending):
            self._merge(p)
        for p in range(len(self.fragments)):
            self._launch(p)
            self._merge(p, final=True)

    def _launch(self, p: int) -> None:
        local = self.fragments[p].read()
        delta = self.outer[p] - local
        try:
            future = self._exchange(p, delta)
        except Exception as exc:  # noqa: BLE001 - a peer lost before the launch: named by its site
            err = _site_error(self.sites, p, self.position, exc, self._tag)
            if err is exc:
                raise
            raise err from exc
        snap = local if self.overlap and self.alpha is None else None
        self.pending[p] = _Exchange(future, self.position, self.position + self.overlap, snap)
        self.syncs += 1

    def _exchange(self, p: int, delta: torch.Tensor) -> torch.futures.Future:
        """Start averaging ``delta`` over this rank's ring; a future of the mean."""
        if self.thc is not None:
            return thc_allreduce_async(delta, self.thc, key=_key(p))
        count(self.counters, delta)  # the schedule's one dense fallback and its byte count
        with explained(f"hhook.diloco's fp32 exchange of fragment {p}", self.sites.ring):
            return plain_allreduce(delta, self.sites.ring, self.sites.n_sites)

    def _merge(self, p: int, final: bool = False) -> None:
        exchange = self.pending.pop(p)
        mean = self._mean(p, exchange)
        if not bool(torch.isfinite(mean).all()):  # on every site alike: ask each whether it holds them
            raise FloatingPointError(f"hhook.diloco: the mean pseudo-gradient of fragment {p} (inner step "
                                     f"{exchange.launched_at}) is not finite: {_non_finite(self, p)}")
        outer = self.outer[p]
        outer.grad = mean
        self.outer_optimizer.step()
        outer.grad = None
        if final:
            new = outer
        elif self.alpha is not None:  # Streaming DiLoCo's mixing
            new = self.alpha * self.fragments[p].read() + (1 - self.alpha) * outer
        else:  # the new outer value plus the local progress since the launch
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
                err = _site_error(self.sites, p, exchange.launched_at, exc, self._tag)
                if err is exc:
                    raise
                raise err from exc
            exchange.future = None
        return exchange.mean

    # -- agreement and the common start ---------------------------------------------------
    def _options(self) -> dict:
        options = {"every": self.every, "bits": self.bits, "fragments": len(self.fragments), "overlap": self.overlap,
                   "error_feedback": self.error_feedback, "seed": self.seed, "block_size": self.block_size,
                   "n_sites": self.sites.n_sites, "ranks_per_site": self.sites.ranks_per_site}
        if self.alpha is not None:  # (absent: checkpoints from before the option load as they are)
            options["alpha"] = self.alpha
        return options

    def start(self) -> None:
        """The common start, collective, once (by itself before the model's first forward,
        else at the first :meth:`step`): the options handshake with the inner steps done;
        a fresh run takes every parameter and buffer from site 0 and reads the outer copy
        from them; a resumed one checks that the model holds the checkpoint's weights."""
        if self.started:
            return
        self._hook.remove()
        if self.sites.n_sites > 1:
            resumed = self._resumed_model is not None
            holds = None if not resumed else checkpoint.model_digest([f.read() for f in self.fragments])
            loaded = None if not resumed else self._resumed_model < 0 or holds == self._resumed_model
            _agree(self, (("inner steps", self.position), ("model loaded", loaded)))
            if resumed and not loaded:
                raise ValueError("hhook.diloco: the model does not hold the weights it had when this outer state "
                                 "was saved: load the model's state_dict (saved with it) before the model's first "
                                 "forward or the first outer.step()")
            if not resumed:
                _start_together(self.sites, self.fragments, self.outer, self._others)
            if self.thc is not None:  # here, so that no launch waits for another site; the options check
                # above covered the fragments' lengths (float32): their first exchanges take no check round
                connect(self.thc, self.outer[0].device, {_key(p): shard for p, shard in enumerate(self.outer)})
        self.started = True

    # -- checkpoints and statistics ---------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data (``torch.load(..., weights_only=True)`` reads it): the options, the
        inner steps done, the outer shards, the outer optimizer, THC's state (residuals,
        rounding counters), the exchanges in flight (waited for: their means) and a digest
        of this rank's model weights. Save it with the model and the inner optimizer;
        every rank saves its own."""
        self.wait()
        return {"format": STATE_FORMAT, "options": self._options(), "position": self.position, "syncs": self.syncs,
                "outer": [t.detach().clone() for t in self.outer], "outer_optimizer": self.outer_optimizer.state_dict(),
                "thc": None if self.thc is None else self.thc.state_dict(), "counters": self.counters.state_dict(),
                "pending": {p: {"launched_at": e.launched_at, "merge_at": e.merge_at, "mean": e.mean.clone(),
                                "snap": None if e.snap is None else e.snap.clone()} for p, e in self.pending.items()},
                "model": checkpoint.model_digest([f.read() for f in self.fragments])}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict`, bit for bit, mid-period included: before the
        model's first forward, on every rank, with the model's and inner optimizer's
        checkpoints loaded in any order before or after. The whole dict is checked first:
        ``ValueError`` (and nothing changed) for a checkpoint of other options or a
        malformed one; :meth:`start` checks every rank's inner-step count and options."""
        if self.started:
            raise ValueError("hhook.diloco: load_state_dict after the start (the model's first forward or step()): "
                             "build a new DiLoCo and load it before training")
        saved = checkpoint.validated(saved, self._options(), [len(t) for t in self.outer], self.offsets,
                                     self.thc is not None)
        self.outer, self.outer_optimizer = checkpoint.loaded_outer(saved, self._outer_factory, self.thc)
        self.counters.load_state_dict(saved["counters"])
        self.position, self.syncs = saved["position"], saved["syncs"]
        self.pending = {p: _Exchange(None, e["launched_at"], e["merge_at"], e["snap"], e["mean"])
                        for p, e in saved["pending"].items()}
        self._resumed_model = -1 if saved.get("model") is None else saved["model"]

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


def _site_error(sites: Sites, p: int, launched_at: int, exc: BaseException, tag: str) -> BaseException:
    """``exc`` as the error to raise: a peer that finished (:meth:`DiLoCo.finish`) as
    such; a lost or stalled peer (THC's error, or the fp32 path's transport error
    explained) with the sites and the site of each rank it names; anything else as it is."""
    try:
        left = {r: n for r, n in finished(sites, tag, bound_s=2.0).items() if r != dist.get_rank()}
    except Exception:  # noqa: BLE001 - a store that does not answer: nobody known to have finished
        left = {}
    if left:
        said = ", ".join(f"site {sites.site_of(r)} (rank {r}) after inner step {n}" for r, n in left.items())
        return ConfigMismatchError(f"hhook.diloco: the outer exchange of fragment {p} (after inner step {launched_at}) "
                                   f"found that {said} finished (a clean leave, finish()) while this site trains on: "
                                   "every site must run the same number of inner steps")
    err = exc
    if not isinstance(exc, (PeerLostError, PeerTimeoutError)):
        err = explain(exc, f"hhook.diloco's exchange of fragment {p}", None, peers(sites.ring))
    if not isinstance(err, (PeerLostError, PeerTimeoutError)):
        return exc
    named = sorted({int(r) for r in re.findall(r"rank (\d+)", str(err))})
    where = "".join(f"; rank {r} is in site {sites.site_of(r)}" for r in named if sites.site_of(r) is not None)
    return type(err)(f"hhook.diloco: the outer exchange of fragment {p} (after inner step {launched_at}) between "
                     f"sites failed ({sites.describe()}{where}): {err}")


def _key(p: int) -> str:
    """The THC key of fragment ``p``'s exchange."""
    return f"diloco.fragment{p}"


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


def _agree(outer: DiLoCo, extra: tuple = ()) -> None:
    """The options handshake (:meth:`Sites.agree`), blocking, on every rank: at
    construction and again at :meth:`DiLoCo.start`, with the inner steps done and whether
    the model holds a loaded checkpoint's weights (``extra``)."""
    sites, fragments = outer.sites, outer.fragments
    shard_lengths = [f.digest(shapes=False) for f in fragments]
    if sites.ranks_per_site > 1:  # every local rank's shards, the same table on every site
        shard_lengths = gather_site(shard_lengths, sites)
    fields = [*outer._options().items(), ("format", STATE_FORMAT), ("parameters", _digest([f.digest() for f in fragments])),
              ("shard lengths", _digest(shard_lengths)), *extra, *_optimizer_fields(outer.outer_optimizer)]
    try:
        sites.agree(fields)
    except ConfigMismatchError as e:
        if "parameters:" in str(e):  # every rank has the same message: name the first differing parameter
            raise ConfigMismatchError(f"{e} {first_difference(fragments)}") from e
        raise


def _non_finite(outer: DiLoCo, p: int) -> str:
    """Which sites' fragment ``p`` (its outer shard or its parameters now) holds inf or
    NaN: one small all-gather over the ring, which every rank of it makes alike."""
    mine = bool(torch.isfinite(outer.outer[p]).all()) and bool(torch.isfinite(outer.fragments[p].read()).all())
    rows = gather_ints([int(mine)], outer.sites.ring, "hhook.diloco's look for non-finite values")
    ring = dist.get_process_group_ranks(outer.sites.ring)
    bad = [f"site {outer.sites.site_of(r)} (rank {r})" for r, row in zip(ring, rows) if not row[0]]
    return (f"{', '.join(bad)} hold{'s' if len(bad) == 1 else ''} inf or NaN in it" if bad else
            "no site holds inf or NaN in it now (the pseudo-gradient overflowed in the exchange?)")


def _start_together(sites: Sites, fragments: list[Fragment], outer: list[torch.Tensor], others: list) -> None:
    """Every site takes site 0's parameters and buffers (each ring broadcasts its shard
    of the synchronized ones, and the others whole; nothing where every site holds them
    already, :func:`~hhook.diloco.sites.hold_one_model`), and the outer copy is read."""
    source, shards = sites.source(), [fragment.read() for fragment in fragments]
    if hold_one_model(sites, checkpoint.model_digest(shards + list(others))):
        for shard, mine in zip(shards, outer):
            mine.copy_(shard)
        return
    with explained("hhook.diloco's broadcast of site 0's parameters", sites.ring), torch.no_grad():
        for fragment, shard, mine in zip(fragments, shards, outer):
            dist.broadcast(shard, source, group=sites.ring)
            fragment.write(shard, sites.site_group)
            mine.copy_(shard)
        for t in others:
            dist.broadcast(t, source, group=sites.ring)


def _unsynchronized(model: torch.nn.Module, named: list) -> list[torch.Tensor]:
    """Every other parameter and every buffer of ``model`` (an FSDP2 parameter's local
    shard): what the common start takes from site 0, as DDP's construction does."""
    synced = {id(p) for _, p in named}
    out = [p for p in model.parameters() if id(p) not in synced] + list(model.buffers())
    return [t.to_local() if hasattr(t, "to_local") else t for t in out]


def _validated_options(named, every, bits, error_feedback, fragments, overlap, alpha, seed, block_size) -> list:
    """ValueError for an option out of range; the fragments' parameters."""
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
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1):
        raise ValueError(f"hhook.diloco: alpha must be None or a number in [0, 1], got {alpha!r}")
    return groups


def _digest(values) -> int:
    return int.from_bytes(hashlib.sha1(repr(values).encode()).digest()[:8], "little") >> 2


def _optimizer_fields(optimizer: torch.optim.Optimizer) -> list:
    """The outer optimizer's class and hyperparameters as handshake fields (``o.lr``...):
    sites stepping their "common" outer copies differently would drift apart silently.
    What does not fit the handshake's fields goes into one digest, ``o.others``."""
    group = optimizer.param_groups[0]
    first = ("lr", "momentum", "betas", "weight_decay", "nesterov", "eps")
    keys = [k for k in first if k in group] + sorted(k for k in group if k not in first and k != "params")
    values = [(f"o.{k}", group[k] if group[k] is None or isinstance(group[k], (bool, int, float, str)) else repr(group[k]))
              for k in keys]
    room = 7  # the handshake's 24 fields less DiLoCo's 15, the class's and o.others
    head, rest = values[:room], values[room:]
    return [("outer optimizer", type(optimizer).__name__), *head] + ([("o.others", _digest(rest))] if rest else [])
