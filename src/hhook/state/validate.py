r"""The whole checkpoint of a :class:`~hhook.state.THCState`, checked before any of it is
applied: a dict in, the same dict out, or :class:`ValueError` naming the field, what it
must be and what it is. So a rejected load changes nothing: every later step of
:func:`hhook.state.checkpoint.load` (options, per-key state, counters, the two-level and
``bits="auto"`` parts) only ever sees data of the shapes checked here.

What is checked, at every level (a two-level ``inter`` state and each ``bits="auto"``
width is a checkpoint of its own): the format and codec versions; the options (through
:class:`~hhook.state.options.Options`); the node layout and origin records; every scale
policy's options and every key's fields, with the residual's and predicted scales'
dtype and shape for its length (:class:`~hhook.codec.THCCodec`'s blocks); the counters;
and ``bits="auto"``'s decision (:class:`hhook.decision.Decision`'s plain data, or the
record of a job that measured nothing). The fields of a decision are named here (this
layer does not import the decision's); tests/state/test_validate.py holds them equal.
"""

from __future__ import annotations

import math

import torch

from ..codec import THCCodec
from ..scales import ScalePolicy
from ..scales.policy import KeyState
from ..stats import Counters
from .options import NAMES, SCALE_MODES, Options

#: Version of the checkpoint's layout (pickles of older hhooks have none).
STATE_FORMAT = 1
#: The keys of :meth:`THCState.state_dict` besides the options.
FIELDS = ("format", "codec_version", "layout", "origin", "policies", "iter", "calls", "_stats", "inter", "_intra",
          "decision", "variants")
#: The fields of a :class:`hhook.decision.Decision`'s ``state_dict()`` (its ``_FIELDS`` is
#: this tuple); ``arrived`` and ``marks`` are newer than some saved states.
DECISION_FIELDS = ("options", "phase", "reason", "started", "queue", "current", "assigned", "samples", "dropped",
                   "plain", "choice", "reference", "baseline", "decided_at", "recent", "history", "last_probe",
                   "observed", "arrived", "decisions", "marks")
_DECISION_SINCE = ("arrived", "marks")
_LAYOUT_FIELDS = ("two_level", "world_size", "n_nodes", "ranks_per_node", "fingerprint")


def checked(saved, current: Options | None = None, live_decision=None) -> dict:
    """``saved`` when every field of it can be loaded into a state whose options are
    ``current`` (those a field left out keeps; default: a new state's) and whose
    ``bits="auto"`` decision is ``live_decision`` (None: none yet); else
    :class:`ValueError` naming the first bad field."""
    if not isinstance(saved, dict) or "bits" not in saved:
        raise ValueError(f"hhook: not a THCState.state_dict(): {type(saved).__name__} "
                         f"with keys {sorted(map(str, saved)) if isinstance(saved, dict) else '-'}")
    _state(saved, "", current if current is not None else Options(), live_decision)
    return saved


def _fail(path: str, expected: str, got) -> None:
    raise ValueError(f"hhook: the THCState checkpoint is not loaded (nothing was changed): {path or 'the dict'} "
                     f"must be {expected}, got {_show(got)}")


def _show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range
        return False


#: Integers a checkpoint holds are counters, sizes and ranks: int64 on every path they take.
INT_BOUND = 2**63
#: A residual holds at most one rounding step of its block's scale (docs/reliability.md):
#: no run's error feedback comes near this, and a larger one would decode every later step
#: finite and wrong (its rank's codes clip), so a checkpoint holding one is refused.
RESIDUAL_BOUND = 2.0**64
_DIGEST_BITS = 48  # hhook.codec.rng.digest's width


def _int(value, path: str, low: int | None = 0, high: int = INT_BOUND) -> None:
    if not _is_int(value) or (low is not None and value < low):
        _fail(path, "an integer" if low is None else f"an integer >= {low}", value)
    if abs(value) >= high:
        _fail(path, f"an integer below 2**{high.bit_length() - 1}", value)


def _dict(value, path: str) -> dict:
    if not isinstance(value, dict):
        _fail(path, "a dict", value)
    return value


def _state(saved: dict, path: str, current: Options, live_decision) -> None:
    """One state's checkpoint (``path``: where it sits in the whole one)."""
    at = (path + ".") if path else ""
    unknown = [key for key in saved if key not in FIELDS and key not in NAMES]
    if unknown:
        _fail(at + "keys", f"those of a THCState.state_dict() ({', '.join(NAMES + FIELDS)})", unknown)
    version = saved.get("format", STATE_FORMAT)
    _int(version, at + "format", 1)
    if version > STATE_FORMAT:
        raise ValueError(f"hhook: this THCState was saved by a newer hhook (format {version}, this one reads up to "
                         f"{STATE_FORMAT}); nothing was changed")
    _int(saved.get("codec_version", 0), at + "codec_version")
    options = _options(saved, at, current)
    _layout(saved.get("layout"), at + "layout")
    origin = saved.get("origin")
    if origin is not None:
        _dict(origin, at + "origin")
        _int(origin.get("rank"), at + "origin.rank")
        _int(origin.get("world_size"), at + "origin.world_size", 1)
        if origin["rank"] >= origin["world_size"]:
            _fail(at + "origin.rank", f"below origin.world_size ({origin['world_size']})", origin["rank"])
    for name in ("iter", "calls"):
        if name in saved:
            _int(saved[name], at + name)
    for name in ("_stats", "_intra"):
        if name in saved and not isinstance(saved[name], Counters):
            for field, value in _dict(saved[name], at + name).items():
                _int(value, f"{at}{name}.{field}")
    policies = saved.get("policies", {})
    if not isinstance(policies, dict):
        _fail(at + "policies", "a dict of scale policies by name", policies)
    for name, policy in policies.items():
        _policy(name, policy, f"{at}policies[{name!r}]")
    _parts(saved, at, options, live_decision)


def _options(saved: dict, at: str, current: Options) -> Options:
    """The options the state will hold: ``saved``'s, else ``current``'s."""
    merged = {name: saved.get(name, getattr(current, name)) for name in NAMES}
    try:
        return Options(**merged)
    except (ValueError, TypeError) as exc:
        bad = next((name for name in NAMES if str(exc).startswith(name)), "the options")
        raise ValueError(f"hhook: the THCState checkpoint is not loaded (nothing was changed): {at}{bad}: {exc}") \
            from None


def _layout(layout, path: str) -> None:
    """A node layout record (:meth:`hhook.schedule.topology.Topology.record`) or None."""
    if layout is None:
        return
    if not isinstance(layout, dict) or any(name not in layout for name in _LAYOUT_FIELDS):
        _fail(path, f"None or a node layout record (a dict of {', '.join(_LAYOUT_FIELDS)})", layout)
    if not isinstance(layout["two_level"], bool):
        _fail(path + ".two_level", "True or False", layout["two_level"])
    for name in ("world_size", "n_nodes", "ranks_per_node"):
        _int(layout[name], f"{path}.{name}", 1)
    if layout["world_size"] != layout["n_nodes"] * layout["ranks_per_node"]:
        _fail(path, "a layout of world_size == n_nodes * ranks_per_node",
              {name: layout[name] for name in ("world_size", "n_nodes", "ranks_per_node")})
    if not layout["two_level"] and layout["n_nodes"] != 1:
        _fail(path + ".n_nodes", "1 for a flat layout", layout["n_nodes"])
    _int(layout["fingerprint"], path + ".fingerprint", 0, 2**24)  # layout_fingerprint's width


def _parts(saved: dict, at: str, options: Options, live_decision) -> None:
    """The parts that are states of their own (``inter``, ``variants``) and the decision."""
    inter = saved.get("inter")
    if inter is not None:
        layout = saved.get("layout")
        if options.topology == "flat" or (layout is not None and not layout["two_level"]):
            _fail(at + "inter", "None for a flat node layout (only two-level states hold an inter-node state)",
                  "a state")
        _nested(inter, at + "inter")
    variants = saved.get("variants", {})
    if not isinstance(variants, dict):
        _fail(at + "variants", "a dict of bits='auto' widths' states by bits", variants)
    if variants and options.bits != "auto":
        _fail(at + "variants", f"empty for bits={options.bits!r} (only bits='auto' keeps widths)", variants)
    for bits, width in variants.items():
        if not _is_int(bits) or not 1 <= bits <= 8:
            _fail(f"{at}variants key", "a width in 1..8", bits)
        if isinstance(width, dict) and width.get("bits") != bits:
            _fail(f"{at}variants[{bits}].bits", str(bits), width.get("bits"))
        _nested(width, f"{at}variants[{bits}]")
    decision = saved.get("decision")
    if decision is not None:
        if options.bits != "auto":
            _fail(at + "decision", f"None for bits={options.bits!r} (only bits='auto' decides)", "a decision")
        _decision(decision, at + "decision", live_decision)


def _nested(value, path: str) -> None:
    """A state held by another: its own checkpoint, or (older pickles) the state itself,
    which its own unpickling checked."""
    if hasattr(value, "options") and callable(getattr(value, "state_dict", None)):
        return
    if not isinstance(value, dict) or "bits" not in value:
        _fail(path, "a THCState.state_dict()", value)
    _state(value, path, Options(), None)


def _policy(name, policy, path: str) -> None:
    """One scale policy (:meth:`ScalePolicy.state_dict`), or an older pickle's object."""
    mode, _, width = name.partition("@") if isinstance(name, str) else (name, "", "")
    if mode not in SCALE_MODES or (width and not (width.endswith("bits") and width[:-4].isdigit())):
        _fail(path.rsplit("[", 1)[0] + " key", f"a scale mode {SCALE_MODES}, or '<mode>@<bits>bits'", name)
    if isinstance(policy, ScalePolicy):
        return
    keys = _dict(policy, path).get("keys")
    if not isinstance(keys, dict):
        _fail(path + ".keys", "a dict of per-key states", keys)
    options = {option: policy[option] for option in ScalePolicy.OPTIONS if option in policy}
    try:
        codec = ScalePolicy(**options).codec(1)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"hhook: the THCState checkpoint is not loaded (nothing was changed): {path}: {exc}") from None
    for key, fields in keys.items():
        _key_state(fields, f"{path}.keys[{key!r}]", codec)


def _key_state(fields, path: str, codec: THCCodec) -> None:
    """One key's :class:`~hhook.scales.policy.KeyState`, its tensors sized for its length."""
    names = KeyState.__dataclass_fields__
    unknown = [name for name in _dict(fields, path) if name not in names]
    if unknown:
        _fail(path, f"a per-key state with fields {list(names)}", f"fields {unknown}")
    _int(fields.get("numel"), path + ".numel")
    _int(fields.get("world_size"), path + ".world_size", 1)
    _int(fields.get("digest", 0), path + ".digest", 0, 2**_DIGEST_BITS)
    _int(fields.get("steps", 0), path + ".steps")
    numel = fields["numel"]
    blocks, block = codec.n_blocks(numel), codec.block_for(numel)
    scales = fields.get("scales")
    if scales is not None and not (isinstance(scales, torch.Tensor) and scales.dtype == torch.float32
                                   and tuple(scales.shape) == (blocks,)):
        _fail(path + ".scales", f"None or a float32 tensor of shape ({blocks},) (numel {numel})", scales)
    _usable(scales, path + ".scales", "finite scales >= 0", lambda t: bool(((t >= 0) & t.isfinite()).all()))
    residual = fields.get("residual")
    if residual is not None and not (isinstance(residual, torch.Tensor) and residual.dtype == torch.float32
                                     and tuple(residual.shape) == (blocks, block)):
        _fail(path + ".residual", f"None or a float32 tensor of shape ({blocks}, {block}) (numel {numel})", residual)
    _usable(residual, path + ".residual", f"finite values below {RESIDUAL_BOUND:.3g} in magnitude",
            lambda t: bool((t.abs() < RESIDUAL_BOUND).all()))


def _usable(tensor, path: str, values: str, check) -> None:
    """A tensor a step can read and write as it is: dense, contiguous (no stride 0 of
    ``expand``), no autograd, on CPU or CUDA (not ``meta``), and ``values`` (``check``)."""
    if tensor is None:
        return
    if tensor.layout != torch.strided or tensor.is_sparse:
        _fail(path, "a dense tensor", f"a {tensor.layout} tensor")
    if tensor.device.type not in ("cpu", "cuda"):
        _fail(path, "a tensor on the CPU or a GPU", f"a tensor on {tensor.device}")
    if tensor.requires_grad:
        _fail(path, "a tensor without requires_grad", "one that requires grad")
    if not tensor.is_contiguous():  # an expanded one (stride 0) included
        _fail(path, "a contiguous tensor (not expanded)", f"a tensor of strides {tensor.stride()}")
    if not check(tensor.detach()):
        _fail(path, values, f"a tensor holding {_extremes(tensor)}")


def _extremes(tensor: torch.Tensor) -> str:
    flat = tensor.detach().reshape(-1).float()
    bad = flat[~flat.isfinite()]
    if bad.numel():
        return f"{bad.numel()} non-finite values (e.g. {bad[0].item()})"
    return f"values from {flat.min().item():.3g} to {flat.max().item():.3g}"


def _decision(decision, path: str, live_decision) -> None:
    """``bits="auto"``'s decision: a :class:`hhook.decision.Decision`'s plain data, or
    what a job that installed no hook saved (``{"not_measured": reason, "kept": ...}``)."""
    _dict(decision, path)
    if "not_measured" in decision:
        if set(decision) != {"not_measured", "kept"} or not isinstance(decision["not_measured"], str):
            _fail(path, "{'not_measured': a reason, 'kept': None or a decision}", decision)
        if decision["kept"] is None:
            return
        decision, path = _dict(decision["kept"], path + ".kept"), path + ".kept"
    missing = [name for name in DECISION_FIELDS if name not in decision and name not in _DECISION_SINCE]
    if missing:
        _fail(path, f"a bits='auto' decision (missing {missing})", decision)
    candidates = _decision_options(decision["options"], path + ".options")
    _decision_fields(decision, path, candidates)
    live = getattr(live_decision, "options", None)
    if isinstance(live, dict) and not set(live.get("candidates", ())) & set(candidates):
        _fail(path + ".options.candidates", f"candidates of this state's decision ({live.get('candidates')}); "
              "the checkpoint is of another integration's bits='auto'", candidates)


def _decision_options(options, path: str) -> list:
    _dict(options, path)
    candidates = options.get("candidates")
    if not isinstance(candidates, list) or not candidates or not all(isinstance(c, str) for c in candidates) \
            or len(set(candidates)) != len(candidates):
        _fail(path + ".candidates", "a list of distinct method names", candidates)
    for name, low in (("window", 2), ("redecide_every", 1), ("drift_window", 1)):
        _int(options.get(name), f"{path}.{name}", low)
    for name, low in (("drop_ratio", 1), ("drift", 0)):
        if not _is_number(options.get(name)) or not options[name] > low:
            _fail(f"{path}.{name}", f"a number > {low}", options.get(name))
    wire = options.get("wire_bits")
    if wire is not None and (not isinstance(wire, dict) or set(wire) != set(candidates)
                             or not all(_is_number(v) and v > 0 for v in wire.values())):
        _fail(path + ".wire_bits", "a positive number per candidate", wire)
    return candidates


def _decision_fields(decision: dict, path: str, candidates: list) -> None:
    """The running state of a decision, each field of the type :class:`Decision` reads."""
    def numbers(value) -> bool:
        return isinstance(value, list) and all(_is_number(v) for v in value)

    def method(value) -> bool:
        return value in candidates

    def optional(check):
        return lambda value: value is None or check(value)

    checks = {
        "phase": (lambda v: v in ("explore", "exploit"), "'explore' or 'exploit'"),
        "reason": (lambda v: isinstance(v, str), "a string"),
        "queue": (lambda v: isinstance(v, list) and all(map(method, v)), "a list of candidates"),
        "current": (optional(method), "None or a candidate"),
        "choice": (optional(method), "None or a candidate"),
        "samples": (lambda v: isinstance(v, dict) and all(map(numbers, v.values())), "a dict of lists of periods"),
        "dropped": (lambda v: isinstance(v, dict) and all(map(_is_number, v.values())), "a dict of periods"),
        "plain": (numbers, "a list of periods"),
        "recent": (numbers, "a list of periods"),
        "reference": (optional(_is_number), "None or a period"),
        "baseline": (optional(_is_number), "None or a period"),
        "history": (lambda v: isinstance(v, dict) and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], bool)
            for e in v.values()), "a dict of [method, measured]"),
        "arrived": (lambda v: isinstance(v, list) and all(
            isinstance(a, list) and len(a) == 2 and _is_int(a[0]) and _is_number(a[1]) for a in v),
            "a list of [iteration, period]"),
        "decisions": (lambda v: isinstance(v, list) and all(isinstance(d, dict) for d in v), "a list of dicts"),
        "marks": (lambda v: isinstance(v, dict), "a dict"),
    }
    for name in ("started", "assigned", "last_probe", "observed"):
        checks[name] = (lambda v: _is_int(v) and v >= -1, "an integer >= -1")
    checks["decided_at"] = (optional(_is_int), "None or an iteration")
    for name, (check, expected) in checks.items():
        if name in decision and not check(decision[name]):
            _fail(f"{path}.{name}", expected, decision[name])
