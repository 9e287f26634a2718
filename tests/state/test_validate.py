"""A malformed checkpoint is refused whole (src/hhook/state/validate.py): ``load_state_dict``
raises ``ValueError`` naming the field and what it must be, and the state is left exactly
as it was (its ``state_dict()`` equal, tensor for tensor); the fixtures of earlier hhooks
still pass. The 2-rank form, with training after each refusal, is
tests/reliability/test_bad_input.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import hhook
from hhook.decision import Decision
from hhook.state import validate
from tests.support.plain_data import round_trip, same

pytestmark = pytest.mark.quick  # the state and its validation: the quick tier

LAYOUT = (("w", (4, 25), "torch.float32"),)


def _trained_like(bits=4, scales="predicted") -> hhook.THCState:
    """A state holding what a run leaves: a key with a residual and predicted scales,
    counters, an origin and layout record."""
    state = hhook.THCState(bits=bits, scales=scales, error_feedback=True)
    key = state.policy(scales, world_size=2).key_state(0, 100, 2, layout=LAYOUT)
    key.residual = torch.randn(1, 128)
    key.scales = torch.rand(1)
    key.steps = 3
    state.iter, state.counters.calls = 5, 7
    state.counters.add("compressed_calls", 400, 70)
    return state


def _auto_state() -> hhook.THCState:
    state = hhook.THCState(bits="auto")
    state.decision = Decision(["thc:4", "bf16", "fp32"])
    state.decision.plain.append(0.25)
    state.variants = {4: _trained_like(4, "agreed")}
    return state




def _set(path: str, value):
    """A mutation of a state dict: ``path`` (dotted; ``[k]`` for dict keys) set to ``value``."""
    def apply(saved: dict) -> None:
        parts = path.split(".")
        node = saved
        for part in parts[:-1]:
            node = node[_key(part)]
        node[_key(parts[-1])] = value(node.get(_key(parts[-1]))) if callable(value) else value
    return apply


def _key(part: str):
    return int(part) if part.isdigit() else part


KEY = "policies.predicted.keys.0"
#: (what, the state, the mutation, words the message must hold)
CASES = [
    ("layout a string", _trained_like, _set("layout", "flat"), "layout must be None or a node layout record"),
    ("layout without fields", _trained_like, _set("layout", {"two_level": False}), "layout must be None or a node layout record"),
    ("format a string", _trained_like, _set("format", "1"), "format must be an integer"),
    ("format newer", _trained_like, _set("format", 99), "newer hhook"),
    ("codec_version a string", _trained_like, _set("codec_version", "3"), "codec_version must be an integer"),
    ("policies an int", _trained_like, _set("policies", 3), "policies must be a dict"),
    ("a policy without keys", _trained_like, lambda s: s["policies"]["predicted"].pop("keys"),
     "policies['predicted'].keys must be a dict"),
    ("a policy of another mode", _trained_like, lambda s: s["policies"].update(bogus=s["policies"]["predicted"]),
     "policies key must be a scale mode"),
    ("a policy's bits", _trained_like, _set("policies.predicted.bits", 12), "bits must be an integer in 1..8"),
    ("a policy's headroom", _trained_like, _set("policies.predicted.headroom", -1.0), "headroom must be a positive number"),
    ("iter a string", _trained_like, _set("iter", "x"), "iter must be an integer"),
    ("calls negative", _trained_like, _set("calls", -1), "calls must be an integer >= 0"),
    ("counters a string", _trained_like, _set("_stats", "x"), "_stats must be a dict"),
    ("a counter a string", _trained_like, _set("_stats.wire_bytes", "70"), "_stats.wire_bytes must be an integer"),
    ("an intra counter a float", _trained_like, _set("_intra.dense_calls", 1.5), "_intra.dense_calls"),
    ("bits out of range", _trained_like, _set("bits", 99), "bits: bits must be an integer in 1..8"),
    ("scales unknown", _trained_like, _set("scales", "bogus"), "scales: scales must be one of"),
    ("block_size not a power of two", _trained_like, _set("block_size", 1000), "block_size"),
    ("error feedback without plain iterations", _trained_like, _set("start_iter", 0), "error_feedback"),
    ("an unknown field", _trained_like, _set("polices", {}), "keys must be those of a THCState.state_dict()"),
    ("origin's rank a string", _trained_like, _set("origin", {"rank": "0", "world_size": 2}), "origin.rank"),
    ("a residual of another shape", _trained_like, _set(KEY + ".residual", torch.zeros(2, 64)),
     "residual must be None or a float32 tensor of shape (1, 128)"),
    ("a residual of another dtype", _trained_like, _set(KEY + ".residual", torch.zeros(1, 128, dtype=torch.float64)),
     "residual must be None or a float32 tensor"),
    ("predicted scales of another length", _trained_like, _set(KEY + ".scales", torch.ones(3)),
     "scales must be None or a float32 tensor of shape (1,)"),
    ("a key's numel a string", _trained_like, _set(KEY + ".numel", "100"), "numel must be an integer"),
    ("a key's unknown field", _trained_like, _set(KEY + ".residuals", None), "must be a per-key state"),
    ("inter of a flat state", _trained_like, _set("inter", {"bits": 4}), "inter must be None for a flat"),
    ("widths of fixed bits", _trained_like, _set("variants", {4: {"bits": 4}}), "variants must be empty"),
    ("a decision of fixed bits", _trained_like, _set("decision", Decision(["fp32"]).state_dict()),
     "decision must be None for bits=4"),
    ("a decision without fields", _auto_state, lambda s: s["decision"].pop("queue"), "missing ['queue']"),
    ("a decision's phase", _auto_state, _set("decision.phase", "done"), "decision.phase must be 'explore'"),
    ("a decision's candidates", _auto_state, _set("decision.options.candidates", "thc:4"), "candidates must be"),
    ("a decision's current not a candidate", _auto_state, _set("decision.current", "thc:9"), "decision.current"),
    ("a decision's periods", _auto_state, _set("decision.plain", ["x"]), "decision.plain must be a list"),
    ("a one-host record without kept", _auto_state, _set("decision", {"not_measured": "one host"}),
     "decision must be {'not_measured'"),
    ("a one-host record keeping junk", _auto_state, _set("decision", {"not_measured": "x", "kept": {"phase": 1}}),
     "decision.kept must be a bits='auto' decision"),
    ("a width of another bits", _auto_state, _set("variants.4.bits", 3), "variants[4].bits must be 4"),
    ("a width's residual", _auto_state, _set("variants.4.policies.agreed.keys.0.residual", torch.zeros(5)),
     "variants[4].policies['agreed'].keys[0].residual"),
]




@pytest.mark.parametrize("what,make,mutate,words", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_checkpoint_is_refused_whole_and_changes_nothing(what, make, mutate, words):
    saved = round_trip(make().state_dict())
    mutate(saved)
    state = _trained_like() if make is _trained_like else _auto_state()
    before = copy.deepcopy(state.state_dict())
    keys, counters, decision = state.keys, state.counters, state.decision
    with pytest.raises(ValueError) as info:
        state.load_state_dict(saved)
    assert words in str(info.value), str(info.value)
    assert same(state.state_dict(), before), what
    assert state.keys is keys and state.counters is counters and state.decision is decision


def test_a_pickled_state_is_checked_too():
    state = _trained_like()
    buf = io.BytesIO()
    torch.save(state, buf)
    good = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert good.iter == 5 and good.keys.policies["predicted"].keys[0].residual.shape == (1, 128)
    saved = state.state_dict()
    saved["iter"] = "x"
    with pytest.raises(ValueError, match="iter must be an integer"):
        hhook.THCState.__new__(hhook.THCState).__setstate__(saved)


def test_the_fields_of_a_decision_are_the_decision_s():
    assert validate.DECISION_FIELDS == Decision._FIELDS
    assert set(validate._DECISION_SINCE) == set(Decision._SINCE)


def test_a_live_decision_takes_a_checkpoint_of_a_job_that_measured_nothing():
    """One host to many: a measuring state loads what a job on one host saved (nothing
    measured: a new decision; something kept: that one), and the reverse keeps it."""
    live = Decision(["thc:4", "bf16", "fp32"], wire_bits={"thc:4": 5.0, "bf16": 16.0, "fp32": 32.0})
    live.method_for(3)
    live.load_state_dict({"not_measured": "one host", "kept": None})
    assert live.state_dict() == Decision(**live.options).state_dict()
    earlier = Decision(["thc:4", "bf16", "fp32"])
    earlier.plain.append(0.5)
    live.load_state_dict({"not_measured": "one host", "kept": earlier.state_dict()})
    assert live.plain == [0.5]


def test_another_integration_s_decision_is_refused():
    """An FSDP2 state's decision (rs+ag, rs, dense) and a DDP checkpoint's share no candidate."""
    state = hhook.THCState(bits="auto")
    state.decision = Decision(["rs+ag", "rs", "dense"])
    ddp = _auto_state().state_dict()
    with pytest.raises(ValueError, match="another integration"):
        state.load_state_dict(ddp)
    assert state.decision.options["candidates"] == ["rs+ag", "rs", "dense"]


def _residual_like(make):
    return lambda r: make(r.shape)


#: What a step needs of a checkpoint's tensors and integers (issue 58): (what, the
#: mutation of key ``0`` of the state's policy (``{key}``), words the message must hold).
STEP_CASES = [
    ("a residual all NaN", "{key}.residual", _residual_like(lambda s: torch.full(s, float("nan"))), "non-finite"),
    ("a residual all inf", "{key}.residual", _residual_like(lambda s: torch.full(s, float("inf"))), "non-finite"),
    ("a residual of 1e30", "{key}.residual", _residual_like(lambda s: torch.full(s, 1e30)), "below 1.84e+19"),
    ("a residual expanded", "{key}.residual", _residual_like(lambda s: torch.zeros(1, 1).expand(s)),
     "contiguous tensor (not expanded)"),
    ("a residual strided", "{key}.residual", _residual_like(lambda s: torch.zeros(s[0], 2 * s[1])[:, ::2]),
     "contiguous"),
    ("a residual requiring grad", "{key}.residual", _residual_like(lambda s: torch.zeros(s, requires_grad=True)),
     "without requires_grad"),
    ("a residual on meta", "{key}.residual", _residual_like(lambda s: torch.zeros(s, device="meta")),
     "on the CPU or a GPU"),
    ("a residual sparse", "{key}.residual", _residual_like(lambda s: torch.zeros(s).to_sparse()), "a dense tensor"),
    ("predicted scales NaN", "{key}.scales", lambda s: torch.full(s.shape, float("nan")), "finite scales >= 0"),
    ("predicted scales negative", "{key}.scales", lambda s: -torch.ones(s.shape), "finite scales >= 0"),
    ("predicted scales inf", "{key}.scales", lambda s: torch.full(s.shape, float("inf")), "finite scales >= 0"),
    ("a digest of 70 bits", "{key}.digest", 2**70, "digest must be an integer below 2**48"),
    ("steps of 80 bits", "{key}.steps", 2**80, "steps must be an integer below 2**63"),
    ("a numel of 80 bits", "{key}.numel", 2**80, "numel must be an integer below 2**63"),
    ("iter of 80 bits", "iter", 2**80, "iter must be an integer below 2**63"),
    ("calls of 80 bits", "calls", 2**80, "calls must be an integer below 2**63"),
    ("a counter of 80 bits", "_stats.wire_bytes", 2**80, "_stats.wire_bytes must be an integer below 2**63"),
    ("a layout of 1 rank on 5 nodes of 7", "layout",
     {"two_level": True, "world_size": 1, "n_nodes": 5, "ranks_per_node": 7, "fingerprint": 5},
     "world_size == n_nodes * ranks_per_node"),
    ("a flat layout of 2 nodes", "layout",
     {"two_level": False, "world_size": 4, "n_nodes": 2, "ranks_per_node": 2, "fingerprint": 5}, "n_nodes must be 1"),
    ("a layout fingerprint of 40 bits", "layout",
     {"two_level": False, "world_size": 2, "n_nodes": 1, "ranks_per_node": 2, "fingerprint": 2**40}, "fingerprint"),
    ("origin's rank beyond its world", "origin", {"rank": 2, "world_size": 2}, "origin.rank must be below"),
]


@pytest.mark.parametrize("scales", ["agreed", "predicted"])
@pytest.mark.parametrize("what,path,value,words", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_a_checkpoint_a_step_cannot_use_is_refused_and_changes_nothing(scales, what, path, value, words):
    """Fields that loaded before and then corrupted every step (a NaN residual decoded
    finite and wrong), refused in both scale modes with nothing changed."""
    saved = round_trip(_trained_like(scales=scales).state_dict())
    _set(path.format(key=f"policies.{scales}.keys.0"), value)(saved)
    state = _trained_like(scales=scales)
    before = copy.deepcopy(state.state_dict())
    with pytest.raises(ValueError) as info:
        state.load_state_dict(saved)
    assert words in str(info.value) and "nothing was changed" in str(info.value), str(info.value)
    assert same(state.state_dict(), before), what


def test_a_checkpoint_at_the_bounds_loads():
    saved = round_trip(_trained_like().state_dict())
    key = saved["policies"]["predicted"]["keys"][0]
    key.update(digest=2**48 - 1, residual=torch.full((1, 128), 1e18), scales=torch.zeros(1))
    saved.update(iter=2**63 - 1, calls=2**63 - 1)
    state = _trained_like()
    state.load_state_dict(saved)
    assert state.iter == 2**63 - 1
