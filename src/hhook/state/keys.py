r"""THCState's per-key state: one scale policy per scale mode and width in use, each
holding its keys' error-feedback residuals, predicted scales and layouts
(:class:`hhook.scales.KeyState`)."""

from __future__ import annotations

import logging

from ..scales import ScalePolicy
from .options import Options

logger = logging.getLogger(__name__)


class KeyStore:
    """The scale policies of one state, by name: the mode (``"agreed"``, ``"predicted"``),
    or ``"<mode>@<bits>bits"`` for messages summed over another world size than the
    state's (FSDP's shard groups, which ``bits="auto"`` sizes for)."""

    __slots__ = ("policies",)

    def __init__(self, policies: dict | None = None):
        self.policies: dict[str, ScalePolicy] = dict(policies or {})

    def policy(self, options: Options, mode: str, bits: int, state_bits: int) -> ScalePolicy:
        """The policy of ``mode`` at ``bits`` (the state's own width: ``state_bits``),
        built on first use; one saved under another rounding starts afresh (one log line)."""
        name = mode if bits == state_bits else f"{mode}@{bits}bits"
        policy = self.policies.get(name)
        if policy is not None and getattr(policy, "rounding", "independent") != options.rounding:
            logger.warning(
                "hhook: per-key state saved under rounding=%r, this state rounds %r: its residuals and "
                "scales start afresh", getattr(policy, "rounding", "independent"), options.rounding,
            )
            policy = None
        if policy is None:
            policy = self.policies[name] = ScalePolicy(
                bits, options.block_size, options.seed, options.error_feedback, predict=mode == "predicted",
                rounding=options.rounding, gather=mode == "gathered",
            )
        return policy

    def drop_residuals(self) -> int:
        """Forget every error-feedback residual (this rank's own); returns how many."""
        dropped = 0
        for policy in self.policies.values():
            for key_state in policy.keys.values():
                if key_state.residual is not None:
                    key_state.residual = None
                    dropped += 1
        return dropped

    def state_dict(self) -> dict:
        """The policies that hold keys (one made for a context that never sent a tensor,
        e.g. a two-level or ``bits="auto"`` parent's, is not saved: it carries nothing)."""
        return {name: policy.state_dict() for name, policy in self.policies.items() if policy.keys}

    @classmethod
    def from_saved(cls, saved: dict) -> "KeyStore":
        """From :meth:`state_dict`, or an older hhook's pickled policies (live objects)."""
        return cls({name: p if isinstance(p, ScalePolicy) else ScalePolicy.from_state_dict(p)
                    for name, p in saved.items()})


def drop_residuals(state) -> int:
    """Forget the error-feedback residuals of ``state``, its inter-node state and its
    widths (this rank's own rounding errors); returns how many."""
    return sum(s.keys.drop_residuals() for s in (state, state.inter, *state.variants.values()) if s is not None)


def start_afresh(state, why: str) -> None:
    """Drop what a checkpoint carried per key (residuals, predicted scales, the
    two-level shards' state, ``bits="auto"``'s widths and measurements), with one log
    line: options and counters stay. Nothing carried is then used on a tensor it does
    not describe."""
    logger.warning("hhook: the THC state from the checkpoint starts afresh (residuals, predicted scales, "
                   "bits='auto' measurements): %s", why)
    state.keys, state.inter, state.variants, state.decision = KeyStore(), None, {}, None
