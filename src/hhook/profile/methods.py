r"""The method lists of ``hhook-profile allreduce`` and ``train``: one grammar, one parser.

A list is comma-separated entries ``KIND[:POSITIONAL...][:KEY=VALUE...]``, case-insensitive:
positional options first, in their order, then keyword options in any order, each once.
The kinds and their options::

    fp32, fp16, bf16, zlib                              none (train: fp32 and bf16 take ag=)
    powersgd[:RANK]
    thc[:BITS[:MODE]][:chunk=MB][:topology=T][:rounding=R][:ag=A]   BITS 1..8 or auto,
                                                        MODE agreed|predicted|gathered|auto,
                                                        T flat|auto|K, R correlated|independent
    ag=A (train --parallel fsdp): FSDP2's parameter all-gather, A 2..8 (hhook's compressed
    all-gather at that width) or bf16 (MixedPrecisionPolicy(param_dtype=torch.bfloat16), dense);
    params=bf16: MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    (with ag=A: quantized from bfloat16; thc compresses the bfloat16 gradients)
    sbc[:p=P][:delay=H], lgc[:k=K][:dense=N][:topk=N][:ae=N]   (hhook.baselines)
    diloco[:BITS|fp32][:h=H][:p=P][:overlap=T][:ef=0|1][:lr=LR]   (train: hhook.diloco's outer
                                                        synchronization across sites; H, P default to
                                                        train's --diloco and --fragments)

A subcommand passes the :class:`Kind` objects it accepts (its measurement knows how to
run them): ``allreduce`` runs the codec directly, so its THC takes BITS, and topology=
to time :func:`hhook.thc_allreduce` as a whole (:data:`THC_BITS`); ``train`` registers
hhook's DDP hook and takes every THC option (:data:`THC`), ``thc:auto`` included
(``hhook.register``'s default: the hook measures and picks THC's width or a dense
exchange, :mod:`hhook.decision`). THC's options are
:class:`hhook.THCState`'s (``bits``, ``scales``, ``chunk_mb``, ``topology``: flat, auto or
K ranks per node, ``rounding``) and are checked by it. A bad entry raises ValueError naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..baselines.harness import OPTIONS as BASELINE_OPTIONS
from ..baselines.harness import USAGE as BASELINE_USAGE
from ..baselines.harness import check as check_baseline


@dataclasses.dataclass(frozen=True)
class Method:
    """One entry of a method list: its canonical ``name`` (tables, JSON) and options."""

    name: str
    kind: str
    bits: int | str | None = None  # thc: 1..8 or "auto"
    scales: str | None = None  # thc: hhook's scales= (None: its default)
    rank: int | None = None  # powersgd's matrix approximation rank
    chunk_mb: float | None = None  # thc: hhook's chunk_mb= (None: its default)
    topology: str | int | None = None  # thc: hhook's topology= (None: not given, flat)
    rounding: str | None = None  # thc: hhook's rounding= (None: its default)
    all_gather: int | str | None = None  # --parallel fsdp's ag=: a width, "bf16", or None (fp32, dense)
    params: str | None = None  # --parallel fsdp's params=bf16: bfloat16 parameters (with ag=BITS: quantized from them)
    options: dict | None = dataclasses.field(default=None, compare=False, hash=False)  # sbc/lgc

    @property
    def exact(self) -> bool:
        """fp32: the reference every other method is measured against."""
        return self.kind == "fp32"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry split by the grammar: the options given, by name (positionals named by
    their place), as written."""

    raw: str
    kind: str
    given: dict[str, str]

    def error(self, why: str) -> ValueError:
        return ValueError(f"method {self.raw!r}: {why}")


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of method: its options and how an entry becomes a :class:`Method`."""

    name: str
    positional: tuple[str, ...] = ()  # names, in their order
    keywords: tuple[str, ...] = ()
    build: Callable[[Entry, "Kind", dict], Method] | None = None  # (entry, kind, defaults); None: no options
    usage: str = ""  # e.g. powersgd[:RANK]; default: the name
    auto: bool = False  # thc: BITS may be "auto" (the DDP hook decides)

    def __post_init__(self):
        if not self.usage:
            object.__setattr__(self, "usage", self.name)


def split(raw: str, kinds: dict[str, Kind]) -> Entry:
    """``raw`` -> :class:`Entry`, checked against its kind's option names (not values)."""
    text = raw.strip()
    name, *tokens = text.lower().split(":")
    kind = kinds.get(name)
    if kind is None:
        raise ValueError(f"unknown method {text!r} (known: {', '.join(k.usage for k in kinds.values())})")
    if tokens and not (kind.positional or kind.keywords):
        raise ValueError(f"method {text!r}: {name} takes no options")
    given: dict[str, str] = {}
    places = iter(kind.positional)
    keyword_seen = False
    for token in tokens:
        key, eq, value = token.partition("=")
        if eq:
            keyword_seen = True
            if key not in kind.keywords or key in given:
                raise ValueError(f"method {text!r}: expected {kind.usage}")
            given[key] = value
        else:
            place = next(places, None)
            if place is None or keyword_seen:  # too many, or after a keyword
                raise ValueError(f"method {text!r}: expected {kind.usage}")
            given[place] = token
    return Entry(text, name, given)


def parse(text: str, kinds, **defaults) -> list[Method]:
    """The comma-separated list ``text`` -> methods, each of one of ``kinds`` (:class:`Kind`);
    ``defaults`` are the subcommand's (``bits=`` for a bare ``thc``, ``powersgd_rank=``)."""
    by_name = {k.name: k for k in kinds}
    methods: list[Method] = []
    for raw in str(text).split(","):
        if not raw.strip():
            continue
        entry = split(raw, by_name)
        kind = by_name[entry.kind]
        m = kind.build(entry, kind, defaults) if kind.build else Method(kind.name, kind.name)
        if any(old.name == m.name for old in methods):
            raise ValueError(f"method {m.name!r} is listed twice")
        methods.append(m)
    if not methods:
        raise ValueError("--methods is empty")
    return methods


# -- the kinds ----------------------------------------------------------------------
def plain(name: str) -> Kind:
    """A kind without options (fp32, fp16, bf16, zlib)."""
    return Kind(name)


def _powersgd(entry: Entry, kind: Kind, defaults: dict) -> Method:
    text = entry.given.get("rank")
    if text is None:
        rank = defaults.get("powersgd_rank", 2)
        return Method(f"powersgd:{rank}", "powersgd", rank=rank)
    if not text.isdigit() or int(text) < 1:
        raise entry.error(f"expected {kind.usage} with RANK >= 1")
    return Method(entry.raw.lower(), "powersgd", rank=int(text))


def _topology(entry: Entry, text: str) -> str | int:
    if text in ("flat", "auto"):
        return text
    if text.isdigit():
        return int(text)
    raise entry.error(f"topology= takes flat, auto or K (ranks per node), got {text!r}")


def _all_gather(entry: Entry, kind: Kind) -> int | str | None:
    """``ag=``: a width of hhook's compressed all-gather or ``bf16`` (dense bfloat16 parameters)."""
    from ..codec.weights import WIDTHS

    text = entry.given.get("ag")
    if text is None or text == "bf16":
        return text
    if not text.isdigit() or int(text) not in WIDTHS:
        raise entry.error(f"ag= takes a width {WIDTHS[0]}..{WIDTHS[-1]} or bf16; expected {kind.usage}")
    return int(text)


def _params(entry: Entry) -> tuple[str | None, str]:
    """``params=bf16`` (FSDP2's ``param_dtype``), and its part of the method's name."""
    text = entry.given.get("params")
    if text not in (None, "bf16"):
        raise entry.error(f"params= takes bf16 (bfloat16 parameters for compute), got {text!r}")
    return text, "" if text is None else f":params={text}"


def _plain_ag(entry: Entry, kind: Kind, defaults: dict) -> Method:
    """fp32 or bf16 of ``train``, with ``ag=`` (FSDP2's parameter all-gather) and
    ``params=`` or without."""
    ag = _all_gather(entry, kind)
    params, suffix = _params(entry)
    return Method(kind.name + (f":ag={ag}" if ag is not None else "") + suffix, kind.name, all_gather=ag,
                  params=params)


def _thc(entry: Entry, kind: Kind, defaults: dict) -> Method:
    """THC's options, checked by :class:`hhook.THCState` before any communication. A bare
    ``thc`` takes the subcommand's ``bits=`` default and is then named ``thc``; otherwise
    the name spells the bits (``thc:4``) and every option given."""
    from ..state import SCALES, THCState

    given = entry.given
    if "bits" in given and not (given["bits"].isdigit() or (given["bits"] == "auto" and kind.auto)):
        raise entry.error(f"BITS must be an integer{' or auto' if kind.auto else ''}; expected {kind.usage}")
    bits = given["bits"] if given.get("bits") == "auto" else int(given["bits"]) if "bits" in given \
        else defaults.get("bits", 4)
    scales = given.get("scales")
    if scales is not None and scales not in SCALES:
        raise entry.error(f"unknown scale mode {scales!r} (known: {', '.join(SCALES)})")
    chunk = None
    if "chunk" in given:
        try:
            chunk = float(given["chunk"])
        except ValueError:
            raise entry.error(f"chunk= takes a number of megabytes; expected {kind.usage}") from None
    topology = _topology(entry, given["topology"]) if "topology" in given else None
    rounding = given.get("rounding")
    options = {"bits": bits, "scales": scales, "chunk_mb": chunk, "topology": topology, "rounding": rounding}
    try:  # hhook's own checks, before any communication
        THCState.validate(**{k: v for k, v in options.items() if v is not None})
    except (ValueError, TypeError) as e:
        raise entry.error(str(e)) from None
    named = "bits" in given or "bits" not in defaults
    name = "thc" + (f":{bits}" if named else "") + (f":{scales}" if scales else "") \
        + (f":chunk={chunk:g}" if chunk is not None else "") \
        + (f":topology={topology}" if topology is not None else "") \
        + (f":rounding={rounding}" if rounding is not None else "")
    ag = _all_gather(entry, kind) if "ag" in kind.keywords else None
    params, suffix = _params(entry)
    name += (f":ag={ag}" if ag is not None else "") + suffix
    return Method(name, "thc", bits=bits, scales=scales, chunk_mb=chunk, topology=topology, rounding=rounding,
                  all_gather=ag, params=params)


def _baseline(entry: Entry, kind: Kind, defaults: dict) -> Method:
    """SBC and LGC (:mod:`hhook.baselines.harness`: option types, defaults and checks)."""
    known = BASELINE_OPTIONS[kind.name]
    values = {name: default for name, (_, default) in known.items()}
    for name, text in entry.given.items():
        convert = known[name][0]
        try:
            values[name] = convert(text)
        except ValueError:
            raise entry.error(f"{name}= takes {'an integer' if convert is int else 'a number'}; "
                              f"expected {kind.usage}") from None
    try:
        check_baseline(kind.name, values)
    except ValueError as e:
        raise entry.error(str(e)) from None
    name = kind.name + "".join(f":{n}={values[n]:g}" for n in known if n in entry.given)
    return Method(name, kind.name, options=values)


def _diloco(entry: Entry, kind: Kind, defaults: dict) -> Method:
    """hhook.diloco's options (checked by :class:`hhook.diloco.DiLoCo` again when it is
    built): the exchange (THC's bits or fp32), H, P, the overlap, error feedback, the
    outer learning rate. The name spells the exchange and every option given."""
    given = entry.given
    text = given.get("bits", "4")
    if text != "fp32" and not text.isdigit():
        raise entry.error(f"the exchange is THC's BITS or fp32; expected {kind.usage}")
    values = {"bits": None if text == "fp32" else int(text), "every": defaults.get("diloco") or 50,
              "fragments": defaults.get("fragments") or 1, "overlap": 0, "error_feedback": False, "outer_lr": 0.7}
    for key, name, convert in (("h", "every", int), ("p", "fragments", int), ("overlap", "overlap", int),
                               ("ef", "error_feedback", int), ("lr", "outer_lr", float)):
        if key in given:
            try:
                values[name] = convert(given[key])
            except ValueError:
                raise entry.error(f"{key}= takes {'an integer' if convert is int else 'a number'}") from None
    values["error_feedback"] = bool(values["error_feedback"])
    if values["bits"] is not None:
        from ..state import THCState

        try:
            THCState.validate(bits=values["bits"], error_feedback=values["error_feedback"])
        except (ValueError, TypeError) as e:
            raise entry.error(str(e)) from None
    if values["every"] < values["fragments"] or not 0 <= values["overlap"] <= values["every"] // values["fragments"] \
            or values["fragments"] < 1 or values["outer_lr"] <= 0:
        raise entry.error(f"needs 1 <= p <= h, 0 <= overlap <= h/p and lr > 0 (h={values['every']}, "
                          f"p={values['fragments']}, overlap={values['overlap']}, lr={values['outer_lr']:g})")
    name = f"diloco:{text}:h={values['every']}" + (f":p={values['fragments']}" if values["fragments"] > 1 else "") \
        + "".join(f":{k}={given[k]}" for k in ("overlap", "ef", "lr") if k in given)
    return Method(name, "diloco", bits=values["bits"], options=values)


FP32, FP16, BF16, ZLIB = plain("fp32"), plain("fp16"), plain("bf16"), plain("zlib")
POWERSGD = Kind("powersgd", positional=("rank",), build=_powersgd, usage="powersgd[:RANK]")
THC = Kind("thc", positional=("bits", "scales"), keywords=("chunk", "topology", "rounding", "ag", "params"),
           build=_thc, usage="thc[:BITS|auto[:agreed|predicted|gathered|auto]][:chunk=MB][:topology=flat|auto|K]"
                             "[:rounding=correlated|independent][:ag=BITS|bf16][:params=bf16]", auto=True)
#: train's fp32 and bf16: ``ag=`` chooses FSDP2's parameter all-gather (--parallel fsdp only)
FP32_AG, BF16_AG = (Kind(name, keywords=("ag", "params"), build=_plain_ag, usage=f"{name}[:ag=BITS|bf16][:params=bf16]")
                    for name in ("fp32", "bf16"))
THC_BITS = Kind("thc", positional=("bits",), keywords=("topology", "rounding"), build=_thc,
                usage="thc[:BITS][:topology=flat|auto|K][:rounding=correlated|independent]")  # allreduce: the codec, or thc_allreduce with topology=
DILOCO = Kind("diloco", positional=("bits",), keywords=("h", "p", "overlap", "ef", "lr"), build=_diloco,
              usage="diloco[:BITS|fp32][:h=H][:p=P][:overlap=T][:ef=0|1][:lr=OUTER_LR]")
SBC, LGC = (Kind(name, keywords=tuple(BASELINE_OPTIONS[name]), build=_baseline, usage=BASELINE_USAGE[name])
            for name in ("sbc", "lgc"))
