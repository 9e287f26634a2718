r"""The DDP communication hook: THC compression for every gradient bucket."""

# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations
# and compares them with dist.GradBucket and Future[Tensor] objects, not strings.
import dataclasses
import functools
import inspect
import logging
import weakref

import torch
import torch.distributed as dist

from .codec import warm_up
from .decision import live_decision, reduce_bucket_as_decided
from .decision.hook import one_host, skip_measuring
from .scales.message import CallChanged
from .schedule import load_check
from .schedule.futures import completed, then
from .state import THCState
from .state.checkpoint import saved_layouts
from .state.advice import one_process

logger = logging.getLogger(__name__)

#: DDP models :func:`register` was called on (DDP takes one comm hook, once).
_REGISTERED: "weakref.WeakSet" = weakref.WeakSet()


@dataclasses.dataclass
class Registration:
    """What :func:`register` learnt of the DDP model, kept in ``state.registration``: its
    parameters' names (``id(parameter) -> name``), so a resumed run finds the saved
    buckets again, this DDP's iterations, counted by the hook, and the DDP itself (a weak
    reference: what its ``join`` asked for)."""

    names: dict
    iterations: int = 0
    model: object = None
    told_join: bool = False


def thc_hook(state: THCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Average a gradient bucket with homomorphic THC compression.

    1. Before ``state.start_iter``, run DDP's plain allreduce (buckets are rebuilt after
       the first iteration). So do float64 and sparse buckets, always.
    2. Otherwise rotate the bucket (randomized Hadamard, shared seed) and take its block
       maxima. With agreed scales (and a predicted bucket's first compressed call)
       MAX-allreduce them with a header (non-finite flag, fingerprint, digest); with
       predicted scales use the bound on last step's maxima that every rank holds.
    3. Quantize with unbiased stochastic rounding, pack the codes into lanes with
       headroom, and SUM-allreduce the integer words behind the common prefix (with
       predicted scales, this step's thermometer of block maxima rides along).
    4. Decode the sum once, into ``bucket.buffer()``, already averaged.

    The hook returns at once; every later stage is a continuation of a collective.
    Under compiled DDP with ``torch._dynamo.config.optimize_ddp = "python_reducer"`` DDP
    calls it once per parameter with ``(grad, param)`` and ignores the future: the
    gradient is then reduced before the hook returns (THC when run eagerly; an exact
    functional allreduce, with one log line, while compiled autograd traces it).

    Example::
        >>> state = THCState(process_group=None, bits=4)
        >>> ddp_model.register_comm_hook(state, thc_hook)
    """
    if isinstance(bucket, tuple):
        return _per_parameter(state, *bucket)
    # The key's state is checked against the bucket's parameter layout: when DDP rebuilds
    # its buckets an index may name other parameters, whose residual and scales must
    # start afresh.
    layout = _bucket_layout(state, bucket)
    said = load_check.said(state)  # now: a continuation runs later, perhaps after a load
    fut = None
    if state.pending_load is not None:  # this rank loaded a checkpoint: did every rank?
        loaded = state.pending_load
        fut = load_check.exchange(loaded, functools.partial(_marked, state, loaded, bucket, layout))
        if fut is None:  # every rank did: the handshake runs again (state.context())
            state.pending_load = None
    if fut is None:
        fut = _exchange(state, bucket, layout)
    if bucket.is_last():  # one iteration per backward pass
        state.iter += 1
        if state.pending_load is not None:  # the group's, which a load does not change
            state.pending_load.iter += 1
        registration = state.registration
        if registration is not None:
            registration.iterations += 1
            _join_weighting(registration)
    return fut.then(functools.partial(_value_or_raise, said))


def _exchange(state: THCState, bucket: dist.GradBucket, layout: tuple) -> torch.futures.Future:
    """The exchange of ``bucket`` that :func:`thc_hook` launches."""
    buffer = bucket.buffer()
    # Made once (a checkpoint loaded since makes it again): at the first bucket, before
    # anything else, the options handshake (hhook.register ran it already), so that ranks
    # with different options (start_iter above all: its plain iterations would pair one
    # rank's SUM with another's MAX) fail on every rank rather than mis-pair collectives.
    ctx = state.contexts.get((None, None)) or state.context(device=buffer.device)
    first = _first_iteration(state, buffer)
    if state.options.bits == "auto" and ctx.world_size > 1:  # the exchange this iteration's decision says
        live_decision(state)
        return reduce_bucket_as_decided(state, bucket, layout, _split(saved_layouts(state) if first else None, bucket,
                                                                      layout))
    if state.iter < state.options.start_iter or buffer.is_sparse:  # with the count of ranks that loaded since
        return load_check.plain(ctx, buffer)
    fut = _before_rebuild(saved_layouts(state), bucket, layout, _fixed_width(ctx)) if first else None
    return fut if fut is not None else ctx.schedule(ctx, buffer, bucket.index(), layout)


def _marked(state: THCState, loaded: load_check.Loaded, bucket: dist.GradBucket, layout: tuple,
            changed) -> torch.futures.Future:
    """A loading rank's exchange of ``bucket``, as every rank verified it, marked with
    ``changed`` (:func:`hhook.schedule.load_check.exchange`): at a fixed width the
    verified context's; under ``bits="auto"`` the decision's, run on the state as it was
    (``loaded.shadow``) at the group's iteration. A resumed run's first iteration splits
    the bucket into the keys the state held before the load (``loaded.layouts``), as the
    others split it into theirs."""
    first = _first_iteration(state, bucket.buffer())
    if loaded.shadow is None:
        def reduce(key, tensor, key_layout):
            return load_check.marked(loaded, tensor, key, key_layout, changed)
        fut = _before_rebuild(loaded.layouts, bucket, layout, reduce) if first and not loaded.plain else None
        return fut if fut is not None else reduce(bucket.index(), bucket.buffer(), layout)
    loaded.shadow.iter = loaded.iter
    live_decision(loaded.shadow)
    return reduce_bucket_as_decided(loaded.shadow, bucket, layout, _split(loaded.layouts if first else None, bucket,
                                                                          layout), changed=changed)


def _first_iteration(state: THCState, buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is a dense bucket of this DDP's first iteration, whose buckets are
    not rebuilt yet (a resumed run's saved keys are: :func:`_before_rebuild`)."""
    registration = state.registration
    return registration is not None and registration.iterations == 0 and not buffer.is_sparse


def _split(saved: dict | None, bucket: dist.GradBucket, layout: tuple):
    """``bits="auto"``'s ``split`` of a resumed run's first iteration into the ``saved``
    keys (:func:`_before_rebuild`); None: not that iteration."""
    return None if saved is None else (lambda reduce: _before_rebuild(saved, bucket, layout, reduce))


def _join_weighting(registration: Registration) -> None:
    """One log line where the program asked DDP's ``join(divide_by_initial_world_size=False)``:
    DDP's own allreduce then divides a step some ranks sat out by the ranks still training,
    but a comm hook (torch's own too) averages over the whole group, the joined ranks'
    zeros included: the flag is not honoured, and the user should know."""
    ddp = registration.model() if registration.model is not None else None
    if registration.told_join or getattr(ddp, "_divide_by_initial_world_size", True) is not False:
        return
    registration.told_join = True
    logger.warning("hhook: DDP's join(divide_by_initial_world_size=False) is not honoured by a comm hook (hhook's, "
                   "like torch's own): a step that some ranks sat out (out of data) is averaged over the whole "
                   "world, their zeros included, as with the default divide_by_initial_world_size=True")


def _from_state_dict(saved: dict, process_group) -> THCState:
    """A state continuing from ``saved`` (:meth:`THCState.state_dict`) on ``process_group``."""
    if "bits" not in saved:
        raise TypeError("hhook.register: state must be a THCState or a THCState.state_dict() dict; this dict has keys "
                        f"{sorted(saved)[:8]} (a framework's checkpoint of every rank's state, {{'ranks': [...]}}, "
                        "is loaded by that framework's adapter)")
    state = THCState(process_group=process_group)
    state.load_state_dict(saved, announce=False)  # its options replace the defaults
    return state


def _fixed_width(ctx):
    return lambda key, tensor, layout: ctx.schedule(ctx, tensor, key, layout)


def _value_or_raise(said: tuple, fut: torch.futures.Future) -> torch.Tensor:
    """The continuation every future handed to DDP goes through. hhook's futures fail by
    holding their exception (so that its own waiters get :class:`~hhook.errors.PeerLostError`
    and the rest unwrapped), and DDP's C++ reducer reads such a value as an object to cast:
    the user read ``Unable to cast <hhook's message> to Tensor``. Raising here fails the
    future in C++, and DDP raises ``... PeerLostError: <hhook's message>`` instead. A
    bucket's exchange that found a checkpoint loaded on some ranks, not all, raises the
    :class:`~hhook.errors.ConfigMismatchError` naming each rank's options as the hook
    found them (``said``, :func:`hhook.schedule.load_check.said`)."""
    try:
        return fut.value()
    except CallChanged:  # only ever a load on some ranks: no other DDP exchange is marked
        raise load_check.named_error(said) from None
    except BaseException as exc:  # noqa: BLE001 - re-raised without torch's frames
        raise exc.with_traceback(None) from exc.__cause__


def _bucket_layout(state: THCState, bucket: dist.GradBucket) -> tuple:
    """What a bucket holds: its parameters' shapes and dtypes, and their names where
    :func:`register` knows the model (a resumed run can then find them again)."""
    if state.registration is None:
        return tuple((tuple(p.shape), str(p.dtype)) for p in bucket.parameters())
    names = state.registration.names
    return tuple((names.get(id(p)), tuple(p.shape), str(p.dtype)) for p in bucket.parameters())


def _before_rebuild(saved: dict, bucket: dist.GradBucket, layout: tuple, reduce):
    """A resumed run's first iteration: DDP reduces its initial buckets (in torch 2.13 one
    bucket of every parameter) before rebuilding the ones the checkpoint's keys hold.

    When this bucket holds exactly the parameters of several saved keys, each key's
    parameters are reduced as that key, in key order, as the uninterrupted run reduced
    them (``reduce(key, tensor, layout)``, a future: THC at the fixed width, or
    ``bits="auto"``'s exchange of this iteration): the same bits, residuals and scales
    (resume is bit for bit). Otherwise the bucket goes keyless, so the saved keys' state
    waits for the rebuilt buckets instead of being reset. None: the bucket is a saved
    key's own (the usual path applies). ``saved``: the checkpointed keys' layouts
    (:func:`hhook.state.checkpoint.saved_layouts`)."""
    if saved.get(bucket.index(), layout) == layout:
        return None
    buffer = bucket.buffer()
    offsets, start = {}, 0
    for item, p in zip(layout, bucket.parameters()):
        offsets[item] = (start, p.numel())
        start += p.numel()
    mine = set(layout)
    plan = [(key, saved_layout) for key, saved_layout in sorted(saved.items()) if set(saved_layout) <= mine]
    covered = [item for _, saved_layout in plan for item in saved_layout]
    if len(covered) != len(layout) or set(covered) != mine:
        logger.info("hhook: bucket %d of a resumed run's first iteration matches no saved bucket; it is reduced "
                    "without carried state (the saved state waits for the rebuilt buckets)", bucket.index())
        return reduce(None, buffer, layout)
    futures, moves = [], []
    for key, saved_layout in plan:
        parts = [buffer[o:o + n] for o, n in (offsets[item] for item in saved_layout)]
        joined = torch.cat(parts)
        futures.append(reduce(key, joined, saved_layout))
        moves.append((joined, parts))

    def scatter(done: list) -> torch.Tensor:
        for f in done:
            f.value()  # raises a key's exception
        for joined, parts in moves:
            start = 0
            for part in parts:
                part.copy_(joined[start:start + part.numel()])
                start += part.numel()
        return buffer

    return then(torch.futures.collect_all(futures), scatter, buffer)


_warned_traced = False


def _per_parameter(state: THCState, grad: torch.Tensor, param: torch.Tensor) -> torch.futures.Future:
    """The python-reducer form: reduce ``grad`` in place before returning."""
    global _warned_traced
    if torch.compiler.is_compiling():
        # Compiled autograd traces this call: THC's kernels and futures cannot be traced.
        if not _warned_traced:
            _warned_traced = True
            logger.warning(
                "hhook: compiled autograd (optimize_ddp='python_reducer') traces the comm hook; "
                "gradients are reduced exactly (uncompressed) there. Use dynamo's default DDPOptimizer "
                "to compress under torch.compile."
            )
        import torch.distributed._functional_collectives as fcol

        group = state.process_group if state.process_group is not None else dist.group.WORLD
        grad.copy_(fcol.all_reduce(grad / dist.get_world_size(group), "sum", group))
        return None  # DDP drops it; a Future would not trace
    # Keyed per parameter (no buckets to rebuild, so no plain iterations are needed).
    with torch.no_grad():
        layout = (tuple(param.shape), str(grad.dtype))
        ctx = state.context(device=grad.device)
        ctx.schedule(ctx, grad, ("param", id(param)), layout).wait()
    state.check_deferred(wait=True)
    return completed(grad)


def register(ddp_model: "torch.nn.parallel.DistributedDataParallel", state: THCState | None = None, *,
             process_group: "dist.ProcessGroup | None" = None, bits: int | str = "auto", block_size: int = 1024,
             seed: int = 0, error_feedback: bool = False, start_iter: int = 2, scales: str = "auto",
             chunk_mb: float | str = "auto", topology: str | int = "flat", rounding: str = "correlated") -> THCState:
    r"""Register :func:`thc_hook` on ``ddp_model``; the options (each documented at
    :class:`THCState`, defaults alike but ``bits``) build its state, or pass ``state`` (e.g.
    one loaded from a checkpoint) instead.

    ``bits`` defaults to ``"auto"``: the hook measures this job's step with THC at the
    auto rule's width and narrower ones (down to 2 bits, while each bit fewer still buys
    time), a bf16 and the fp32 allreduce, in turns on every rank alike, keeps the fastest
    and re-decides on a schedule and on drift (:mod:`hhook.decision`;
    ``state.stats()["decision"]`` says what and why). Where every rank runs on one host
    with CPU tensors no exchange can beat DDP's own fp32 allreduce: there ``bits="auto"``
    installs no hook, logs why (one line, rank 0) and ``stats()["decision"]`` says
    ``{"method": "plain", "phase": "not measured", "hook": None, "reason": ...}``
    (:func:`hhook.decision.hook.one_host`; ``HHOOK_AUTO_ONE_HOST=measure`` measures
    anyway). An integer ``bits`` always compresses at that width.

    ``state`` is a :class:`THCState` or what its ``state_dict()`` returned (a checkpoint's
    part; any other object raises :class:`TypeError`). The process group defaults to the
    model's own (also for a state dict, which holds none). Registration runs the options
    handshake (:mod:`hhook.schedule.handshake`) on every rank, before anything else is
    exchanged: ranks with other options raise
    :class:`~hhook.errors.ConfigMismatchError` here, on every rank, naming each option and
    each rank's value, and so do the ranks that call it where another rank does not (that
    one runs DDP without hhook, or another comm hook) once the group's timeout has passed.
    With ``topology="auto"`` (or a number of ranks per node) the node layout is found next,
    on every rank, so a bad layout raises
    :class:`~hhook.schedule.topology.TopologyError` at registration. A DDP model takes one
    registration (:class:`RuntimeError` for a second one, whatever the options). The state
    learns the model's parameter names, so that a run resumed from a checkpoint of the
    state continues bit for bit through DDP's first iteration, whose buckets are not
    yet the rebuilt ones the saved state describes.
    A model that is not DDP-wrapped raises :class:`TypeError` saying what it got, except
    in a world of one process, where nothing is exchanged: there it logs why nothing will
    be compressed and returns the state unregistered.

    Example::
        >>> state = hhook.register(ddp_model)          # measured choice
        >>> state = hhook.register(ddp_model, bits=4)  # always THC at 4 bits
        >>> torch.save({"hook": state.state_dict(), ...}, path)
        >>> state = hhook.register(new_ddp_model, state=torch.load(path, weights_only=True)["hook"])  # resume
    """
    state = _state_for(ddp_model, state, dict(
        process_group=process_group, bits=bits, block_size=block_size, seed=seed, error_feedback=error_feedback,
        start_iter=start_iter, scales=scales, chunk_mb=chunk_mb, topology=topology, rounding=rounding))
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        return _not_ddp(ddp_model, state)
    if ddp_model in _REGISTERED:
        raise RuntimeError(
            "hhook.register can be called once per DDP model (DDP takes one comm hook, once); this one is registered "
            "already. Keep the THCState the first call returned (state.load_state_dict resumes it from a checkpoint), "
            "or wrap a new DDP model")
    module = getattr(ddp_model, "module", ddp_model)
    state.registration = Registration({id(p): name for name, p in module.named_parameters()},
                                      model=weakref.ref(ddp_model))
    if dist.is_initialized():
        # On every rank, here, before anything else is exchanged: the options handshake (a
        # rank without hhook, or with other options, raises here on every rank that runs
        # it), then the node layout (a layout that cannot hold raises now).
        ctx = state.context(device=next(module.parameters(), torch.empty(0)).device)
        if state.options.bits == "auto" and ctx.world_size > 1:
            reason = one_host(state, ddp_model)
            if reason is not None:  # nothing to measure: DDP's own allreduce, no Python hook
                skip_measuring(state, reason)
                _REGISTERED.add(ddp_model)
                return state
            live_decision(state)
    ddp_model.register_comm_hook(state, thc_hook)
    _REGISTERED.add(ddp_model)
    for param in ddp_model.parameters():
        warm_up(param.device)  # compile the fused codec now, not in the first backward pass
        break
    return state


def _state_for(ddp_model, state, options: dict) -> THCState:
    """:func:`register`'s state: built of ``options``, or ``state`` (a state dict loads)."""
    defaults = inspect.signature(register).parameters
    given = sorted(name for name, value in options.items() if value != defaults[name].default)
    if state is not None and given:
        raise TypeError(f"hhook.register: pass options or a state, not both (got {given})")
    if state is None:
        if options["process_group"] is None:
            options["process_group"] = getattr(ddp_model, "process_group", None)
        return THCState(**options)
    if isinstance(state, dict):  # a THCState.state_dict(), e.g. torch.load(path, weights_only=True)["hook"]
        return _from_state_dict(state, getattr(ddp_model, "process_group", None))
    if not isinstance(state, THCState):
        raise TypeError(f"hhook.register: state must be a THCState or a THCState.state_dict() dict (what "
                        f"state.state_dict() saved), got {type(state).__name__}")
    return state


def _not_ddp(ddp_model, state: THCState) -> THCState:
    """:func:`register` of a model DDP did not wrap: in a world of one, the state with one
    log line (nothing to exchange); else a :class:`TypeError` saying what to do."""
    got = type(ddp_model).__name__
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        logger.warning(
            "hhook.register got a %s, not a DistributedDataParallel model, in a world of one process "
            "(torch.distributed %s): there is nothing to exchange, so nothing will be compressed. A launcher "
            "or framework that starts one process does not wrap the model in DDP. Here %s",
            got, "initialized, world size 1" if dist.is_initialized() else "not initialized", one_process())
        return state
    raise TypeError(
        f"hhook.register needs a torch.nn.parallel.DistributedDataParallel model, got {got} (world of {world} "
        "processes): nothing would be compressed and the ranks' gradients would not even be averaged. Wrap "
        "the model in DDP first (Accelerate: after accelerator.prepare; Ray Train: after prepare_model; "
        "Lightning: hhook.lightning.THCCallback; torch.compile: register on the DDP model, then compile)."
    )

