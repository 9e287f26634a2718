r"""``bits="auto"`` for FSDP2 (:func:`hhook.fsdp.register`'s default): measure, per job,
which exchange makes the optimizer step fastest, and keep it.

* ``rs+ag``: THC's reduce-scatter (at the auto rule's width for the shard group) and the
  compressed parameter all-gather (8 bits unless ``all_gather`` says otherwise);
* ``rs``: THC's reduce-scatter, FSDP's own all-gather;
* ``dense``: plain FSDP2, whatever its ``MixedPrecisionPolicy`` says (bf16 parameters
  and reduce when the policy is bf16).

:func:`hhook.fsdp.register_hsdp` adds the replica all-reduce: the two THC candidates
compress it too, ``ar`` compresses it alone (FSDP's reduce-scatter and all-gather inside
the node, THC across replicas), and ``dense`` is FSDP2's own HSDP.

The decision is the DDP hook's (:class:`hhook.decision.Decision`, measured by
:class:`hhook.decision.Prober`), not a second copy: the candidates take turns of a few
steps in lockstep, each rank times the period between successive step starts, the
slowest rank's periods reach every rank through one MAX all-reduce (with the decision's
fingerprint: ranks whose decisions differ raise on every rank), and the argmin of those
numbers is the choice, the same on every rank. So the job is never slower than plain
FSDP2 by more than the DDP hook's margin: the turns of the slower candidates while
measuring, and the noise of five steps per turn.

**A step is one optimizer step, whatever the loop.** It ends when an optimizer steps
over the registered model's parameters (any ``torch.optim.Optimizer``: torch's global
step hook), however many forwards, backwards and reduce-scatters came before it
(gradient accumulation with or without ``set_requires_gradient_sync(False)``, two
forwards before one backward, SAM's two passes), whatever ``module.training`` says. The
next step starts at the first forward of the root or the first all-gather after that, in
any mode (an evaluation under ``no_grad`` included, which then belongs to that step), and
never inside a backward: so the method is fixed before the step's first all-gather of any
kind (an explicit ``unshard()`` prefetch, the ``no_grad`` forward of reentrant activation
checkpointing, the backward's re-gathers) and every all-gather and reduce-scatter of the
step use it. A job that has not stepped an optimizer over these parameters
(hand-written updates) ends a step where a forward or an all-gather finds the gradients
of a reduce-scatter cleared (``zero_grad()``, ``p.grad = None``; gradients zeroed in
place go unseen); its first optimizer step ends that rule for the job (a mark kept in
the decision, so that a resumed job keeps it).

``state.iter`` counts the steps that ended, and the running step is the one the decision
gave a method (:meth:`Decision.method_of`): both are in ``state.state_dict()``, so the
comms read the running method from the state (:class:`Switch`). A loaded state is
kept, in every order (``register`` then ``load_state_dict``, ``load_state_dict`` then
``register``, a pickled state): a checkpoint saved inside a step continues that step
with its method (an evaluation right after the resume computes what it did before the
save, bit for bit), one saved between steps starts the next one as the run that saved
would have; the period that spans the save goes unmeasured. A checkpoint loaded on some
ranks only raises on every rank at the next all-gather or reduce-scatter
(:mod:`hhook.schedule.load_check`): until then the loading rank runs the decision every
rank verified (:meth:`Decider.live`), so its collectives stay the others'.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..decision import Decision, Prober
from .modules import group_key

logger = logging.getLogger("hhook.fsdp")

#: The candidates, in probing order: ``register``'s, and ``register_hsdp``'s across replicas.
BOTH, RS, REPLICA, DENSE = "rs+ag", "rs", "ar", "dense"
CANDIDATES = (BOTH, RS, DENSE)
HSDP_CANDIDATES = (BOTH, RS, REPLICA, DENSE)
#: The decision's mark of a job whose steps end at its optimizer's steps.
OPTIMIZER_STEPS = "optimizer_steps"


class Switch:
    """What every comm of one registration reads at each call: the running step's method,
    and whether a reduce-scatter ran since the step started (:attr:`reduced`, set by the
    reduce-scatter)."""

    def __init__(self, decider: "Decider"):
        self.decider = decider
        self.reduced = False

    def begin(self) -> None:
        """The root's forward or an all-gather is about to run: a step starts here if none runs."""
        self.decider.begin()

    @property
    def method(self) -> str:
        return self.decider.method()

    @property
    def reduce_scatter_dense(self) -> bool:
        return self.method in (DENSE, REPLICA)

    @property
    def all_gather_dense(self) -> bool:
        return self.method != BOTH

    @property
    def all_reduce_dense(self) -> bool:
        return self.method == DENSE

    def loading(self, group) -> bool:
        """Whether this rank loaded a checkpoint that ``group``'s next exchange must check
        (:mod:`hhook.schedule.load_check`): until it does, the method is the one every
        rank verified (:meth:`Decider.live`)."""
        loaded = self.decider.state.pending_load
        return loaded is not None and loaded.shadow is not None and group in loaded.shards


class _Group:
    """What :class:`Prober` reads of a :class:`~hhook.THCState`: the group its reductions
    run on and the counters they are charged to."""

    def __init__(self, process_group, state):
        self.process_group = process_group
        self.counters = state.counters


class Decider:
    """The decision of one registration, over ``candidates``, timed over ``process_group``.
    ``state.decision``, ``state.prober`` and ``state.iter`` hold everything that lasts
    (module docstring); ``groups``: the FSDP param groups whose parameters an optimizer
    must hold for its step to end one of ours."""

    def __init__(self, state, process_group, device: torch.device, candidates, groups):
        self.state = state
        self.candidates = list(candidates)
        self.process_group = process_group
        self.device = device
        self.switch = Switch(self)
        self._groups = list(groups)
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> (params, holds ours)
        self.decision()
        if state.prober is None:
            state.prober = Prober()  # a load_state_dict drops it: built again at the next step
        method = weakref.WeakMethod(self.after_optimizer_step)

        def hook(optimizer, args, kwargs) -> None:
            bound = method()
            if bound is not None:
                bound(optimizer)

        handle = register_optimizer_step_post_hook(torch.compiler.disable(hook))
        weakref.finalize(self, handle.remove)

    def live(self):
        """The state whose decision and clock make this rank's collectives: ``state``, or,
        while a checkpoint loaded here waits for the next exchange to tell whether every
        rank loaded it, the state as every rank verified it (its shadow,
        :func:`hhook.state.checkpoint.shadow_of`): until then this rank makes the others'
        collectives, and that exchange carries the mark (:mod:`hhook.schedule.load_check`)."""
        loaded = self.state.pending_load
        return loaded.shadow if loaded is not None and loaded.shadow is not None else self.state

    def decision(self, state=None) -> Decision:
        """``state.decision`` (default: :meth:`live`'s), live: the state's own, or a
        checkpoint's plain data, where it decides between this registration's candidates;
        anything else starts afresh (one log line)."""
        state = self.live() if state is None else state
        decision = state.decision
        if isinstance(decision, Decision) and decision.options["candidates"] == self.candidates:
            return decision
        if isinstance(decision, dict) and decision.get("options", {}).get("candidates") == self.candidates:
            state.decision = Decision.from_state_dict(decision)
            return state.decision
        if decision is not None:
            logger.warning("hhook.fsdp: bits='auto' starts a new decision between %s: the state's decision is not one "
                           "between these candidates", ", ".join(self.candidates))
        state.decision = Decision(self.candidates)
        return state.decision

    def digest(self) -> int:
        """The decision's options (its candidates...), for the registration's handshake."""
        return 1 + self.decision().options_digest()

    def method(self) -> str:
        """The running step's method; between steps the last one's."""
        state = self.live()
        decision, step = self.decision(state), state.iter
        return decision.method_of(step) or decision.method_of(step - 1) or self.candidates[0]

    def begin(self) -> None:
        """Start a step where none runs (module docstring), never inside a backward."""
        if torch._C._current_graph_task_id() != -1:
            return  # a reentrant checkpoint's recomputation, a per-parameter optimizer's step: the step's own
        state = self.live()
        decision = self.decision(state)
        if decision.method_of(state.iter) is not None:  # a step runs
            if decision.marks.get(OPTIMIZER_STEPS) or not self._updated_by_hand():
                return
            self._end(state)
        prober = state.prober
        if prober is None:
            prober = state.prober = Prober()
        group = _Group(self.process_group, state)
        if not prober.verified:
            prober.verify(group, decision, self.device)
        prober.begin(group, decision, state.iter)
        self.switch.reduced = False

    def _end(self, state) -> None:
        """``state``'s running step ended: the periods measured so far are reduced now,
        behind the step's collectives (as the DDP hook's behind an iteration's last bucket)."""
        if state.prober is not None:
            state.prober.launch(_Group(self.process_group, state), self.decision(state), state.iter, self.device)
        state.iter += 1

    def _updated_by_hand(self) -> bool:
        """In a job that has not stepped an optimizer over these parameters: a reduce-scatter
        ran in this step and its gradients were cleared since (gradient accumulation and a
        second forward keep them)."""
        return self.switch.reduced and all(p.sharded_param.grad is None for g in self._groups for p in g.fsdp_params)

    def after_optimizer_step(self, optimizer) -> None:
        """torch's hook after any optimizer's step: it ends the running step if it holds our
        parameters; while a loaded checkpoint waits for its check (:meth:`live`), the
        loaded state's step too (its clock starts at its next step: no collective)."""
        if not self._holds(optimizer):
            return
        live = self.live()
        for state in (self.state,) if live is self.state else (live, self.state):
            decision = self.decision(state)
            decision.marks[OPTIMIZER_STEPS] = True
            if decision.method_of(state.iter) is not None:
                self._end(state)

    def _holds(self, optimizer) -> bool:
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        known = self._optimizers.get(optimizer)
        if known is None or known[0] != count:  # (a param group added since)
            ours = {id(p.sharded_param) for g in self._groups for p in g.fsdp_params}
            holds = any(id(p) in ours for g in optimizer.param_groups for p in g["params"])
            known = self._optimizers[optimizer] = (count, holds)
        return known[1]

    def attach(self, module) -> None:
        # prepended: before FSDP's own pre-forward (its all-gathers); eager under torch.compile too, as FSDP's hooks
        module.register_forward_pre_hook(torch.compiler.disable(lambda module, args: self.switch.begin()),
                                         prepend=True)


def decider(state, plan, candidates, over=None) -> Decider | None:
    """The :class:`Decider` of a ``bits="auto"`` registration of ``plan`` (``[(name,
    FSDPModule, param group, shard size, replicate size)]``) between ``candidates``, or
    None where it does not measure, said in one log line: a mesh with a replicate
    dimension (the replicas would have to agree on one choice over a group FSDP does not
    have) or modules sharded over different groups; a shard group of one rank exchanges
    nothing. ``over``: the group whose ranks decide together (default: the shard group;
    :func:`hhook.fsdp.register_hsdp` passes the whole world, whose step times its replica
    all-reduce couples)."""
    groups = {group_key(g.mesh_info.shard_process_group): g for _, _, g, _, _ in plan}
    why = None
    if any(replicate is not None for *_, replicate in plan):
        why = "its mesh has a replicate dimension"
    elif len(groups) > 1:
        why = "its modules are sharded over different groups"
    elif not groups or all(shard == 1 for _, _, _, shard, _ in plan):
        return None
    if why is not None:
        logger.warning("hhook.fsdp.register: bits='auto' compresses the reduce-scatter at the auto rule's width "
                       "without measuring: %s", why)
        return None
    group = next(iter(groups.values()))
    return Decider(state, group.mesh_info.shard_process_group if over is None else over, group.device, candidates,
                   [g for _, _, g, _, _ in plan])
