r"""``bits="auto"`` for FSDP2 (:func:`hhook.fsdp.register`'s default): measure, per job,
which of three exchanges makes the step fastest, and keep it.

* ``rs+ag``: THC's reduce-scatter (at the auto rule's width for the shard group) and the
  compressed parameter all-gather (8 bits unless ``all_gather`` says otherwise);
* ``rs``: THC's reduce-scatter, FSDP's own all-gather;
* ``dense``: plain FSDP2, whatever its ``MixedPrecisionPolicy`` says (bf16 parameters
  and reduce when the policy is bf16).

The decision is the DDP hook's (:class:`hhook.decision.Decision`, measured by
:class:`hhook.decision.Prober`), not a second copy: the candidates take turns of a few
training steps in lockstep, each rank times the period between successive step starts,
the slowest rank's periods reach every rank through one MAX all-reduce (with the
decision's fingerprint: ranks whose decisions differ raise on every rank), and the argmin
of those numbers is the choice, the same on every rank. A candidate two of whose steps
take 1.5x the best so far is dropped early; the choice is re-measured every 1000 steps and
when its step time drifts by half. So the job is never slower than plain FSDP2 by more
than the DDP hook's margin: the turns of the slower candidates while measuring, and the
noise of five steps per turn.

A step is what one optimizer step costs, gradient accumulation included: it starts at the
first training forward of the root after a reduce-scatter (the first one of the job
included). Microbatches whose gradients are not synchronized
(``set_requires_gradient_sync(False)``) run no reduce-scatter, so their forwards stay in
the running step; so do a second forward before one backward (a siamese or contrastive
loss). The method changes only at a step's start: every all-gather of a step, the
backward's re-gather included, and its reduce-scatter use one method. Forwards without
gradients (evaluation) keep the running method and start no step.

The step counter is the state's ``iter`` and the decision is the state's
(``state.decision``), so a resumed job (:meth:`hhook.THCState.load_state_dict`) continues
the saved decision at the saved step; the period that spans the save goes unmeasured.

The comms (:class:`~hhook.fsdp.THCReduceScatter`, :class:`~hhook.fsdp.all_gather.THCAllGather`)
are set on every module at registration and read the running method from one
:class:`Switch`: its dense path is the collective plain FSDP2 runs on the same buffers
(a SUM reduce-scatter divided by the group's size, as FSDP's division is switched off;
an all-gather of the input as it is). Each reduce-scatter, dense or compressed, marks the
switch, which is how the next step's start is known.
"""

from __future__ import annotations

import logging

import torch

from ..decision import Decision, Prober
from .modules import group_key

logger = logging.getLogger("hhook.fsdp")

#: The candidates, in probing order.
BOTH, RS, DENSE = "rs+ag", "rs", "dense"
CANDIDATES = (BOTH, RS, DENSE)


class Switch:
    """The running method, read by every comm of one registration at each call, and
    whether a reduce-scatter ran since the running step started."""

    def __init__(self, method: str = BOTH):
        self.method = method
        self.reduced = True  # the first training forward starts a step

    @property
    def reduce_scatter_dense(self) -> bool:
        return self.method == DENSE

    @property
    def all_gather_dense(self) -> bool:
        return self.method != BOTH


class _Group:
    """What :class:`Prober` reads of a :class:`~hhook.THCState`: the group its reductions
    run on and the counters they are charged to."""

    def __init__(self, process_group, state):
        self.process_group = process_group
        self.counters = state.counters


class Decider:
    """The decision of one :func:`hhook.fsdp.register`: a forward pre-hook on the root
    module (it runs before FSDP's own, prepended) sets :attr:`switch` at each step's start
    from ``state.decision``, timed by ``state.prober`` over ``process_group``, counting
    steps in ``state.iter`` (all three checkpointed or rebuilt with the state)."""

    def __init__(self, state, process_group, device: torch.device, candidates=CANDIDATES):
        self.switch = Switch(candidates[0])
        self.state = state
        state.decision = Decision(list(candidates))
        state.prober = Prober()  # a load_state_dict drops it: built again at the next step
        self.group = _Group(process_group, state)
        self.device = device

    def digest(self) -> int:
        """The decision's options (its candidates...), for the registration's handshake."""
        return 1 + self.state.decision.options_digest()

    def pre_forward(self, module, args) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return  # evaluation: the running method, not a step
        if not self.switch.reduced:
            return  # no reduce-scatter since the step started: another microbatch of it
        self.switch.reduced = False
        state = self.state
        decision = state.decision
        if isinstance(decision, dict):  # a checkpoint loaded before the first step
            decision = state.decision = Decision.from_state_dict(decision)
        prober = state.prober
        if prober is None:
            prober = state.prober = Prober()
        if not prober.verified:
            prober.verify(self.group, decision, self.device)
        self.switch.method = prober.begin(self.group, decision, state.iter)
        prober.launch(self.group, decision, state.iter, self.device)
        state.iter += 1

    def attach(self, module) -> None:
        # eager under torch.compile too, as FSDP's own hooks are (a clock and collectives)
        module.register_forward_pre_hook(torch.compiler.disable(self.pre_forward), prepend=True)


def decider(state, plan, with_all_gather: bool, over=None) -> Decider | None:
    """The :class:`Decider` of a ``bits="auto"`` registration of ``plan`` (``[(name,
    FSDPModule, param group, shard size, replicate size)]``), or None where it does not
    measure, said in one log line: a mesh with a replicate dimension (the replicas would
    have to agree on one choice over a group FSDP does not have) or modules sharded over
    different groups; a shard group of one rank exchanges nothing. ``over``: the group
    whose ranks decide together (default: the shard group; :func:`hhook.fsdp.register_hsdp`
    passes the whole world, whose step times its replica all-reduce couples)."""
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
    return Decider(state, group.mesh_info.shard_process_group if over is None else over, group.device,
                   CANDIDATES if with_all_gather else (RS, DENSE))
