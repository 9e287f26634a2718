r"""FSDP2's parameter all-gather, compressed: :class:`THCAllGather`, an ``AllGather`` comm
for ``FSDPModule.set_custom_all_gather`` (torch >= 2.11).

Why the comm and not the tensor-subclass hooks (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, torchao's float8): the hooks need the parameters replaced by a
subclass before ``fully_shard`` (the optimizer then updates subclass tensors), and for a
parameter whose dim 0 does not divide by the world size FSDP requires every all-gather
input of the hook to have the padded shard's shape, which leaves no room for per-block
scales (torchao sends one tensor-wide scale, agreed beforehand). The comm gets the flat
buffer of the whole param group, after FSDP's copy-in, and writes the gathered buffer
FSDP's copy-out reads: nothing else in FSDP changes, and it can be set after
``fully_shard``, like hhook's reduce-scatter.

One call, on every rank of the shard group:

1. Encode this rank's input (its flat buffer: the padded shards of the group's
   parameters, in FSDP's order, :class:`Layout`) into one payload: a 16-byte header
   (options fingerprint, status), the parameters that stay dense as they are, then the
   quantized ones (:class:`hhook.codec.weights.WeightCodec`: one float32 scale per block,
   rotation blocks inside each parameter's shard).
2. An all-gather of the uint8 payloads (equal lengths on every rank).
3. Read every rank's header: a different fingerprint raises ``ConfigMismatchError`` and
   a rank that failed to encode ``RankFailedError`` (its own exception on that rank) on
   every rank (the status word is the failure protocol of every exchange,
   :func:`hhook.scales.message.status_word`); if any rank's quantized parameters held
   inf/NaN, the call re-runs as a plain all-gather of the input, so every rank gets
   exactly what plain FSDP2 gives.
4. Decode every rank's payload into FSDP's output, this rank's own included: all ranks
   compute with the same unsharded parameters, bit for bit.

Registration ends with the options handshake on every shard group
(:mod:`hhook.schedule.handshake`, one for the reduce-scatter's state and the all-gather:
:func:`fields` says what the all-gather adds, its options and a digest of every module's
plan): ranks that would quantize different parameters, or send payloads of different
lengths, raise ``ConfigMismatchError`` there, on every rank, naming what differs, instead
of meeting in one all-gather with different lengths or another collective.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib

import torch

from ..codec import rng
from ..codec.weights import WeightCodec
from ..errors import ConfigMismatchError, RankFailedError
from ..scales import message
from ..schedule import load_check
from ..schedule.membership import all_gather_flat
from ..stats import Counters
from .modules import param_groups, group_key

try:  # torch >= 2.6
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # pragma: no cover
    AllGather = object

logger = logging.getLogger(__name__)

#: Input dtypes the comm quantizes; any other (float64, or uint8 when FSDP mixes dtypes
#: in one buffer) is all-gathered as it is.
QUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADER_BYTES = 16  # int32 [fingerprint, status word, loaded, 0]; keeps the scales 4-byte aligned
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


@dataclasses.dataclass(frozen=True)
class AllGatherOptions:
    """The compressed all-gather's options (the same on every rank).

    ``bits``: 8 by default, 6 and 4 narrower. ``block_size``: values per float32 scale
    (and per rotation block). ``rotate``: ``"auto"`` rotates each block with the codec's
    randomized Hadamard rotation where that lowers its max, ``True`` every block, ``False``
    none (:mod:`hhook.codec.weights`; docs/fsdp.md has the measurements). ``min_numel``:
    the dense rule, :meth:`quantizes`."""

    bits: int = 8
    block_size: int = 256
    rotate: bool | str = "auto"
    seed: int = 0
    min_numel: int = 4096

    def __post_init__(self):
        WeightCodec(self.bits, self.block_size, self.rotate, self.seed)  # validates
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"all_gather_min_numel must be a non-negative integer, got {self.min_numel!r}")

    @property
    def codec(self) -> WeightCodec:
        return WeightCodec(self.bits, self.block_size, self.rotate, self.seed)

    def quantizes(self, shape: torch.Size) -> bool:
        """The dense rule: a parameter is quantized when it has at least two dimensions
        (weights, embeddings) and ``min_numel`` elements. Biases and norms' scales (1-D)
        stay dense: they are sensitive (a shift of every activation) and weigh nothing."""
        return len(shape) >= 2 and shape.numel() >= self.min_numel


@dataclasses.dataclass(frozen=True)
class Segment:
    name: str
    offset: int  # in this rank's flat all-gather input
    numel: int  # the padded shard's
    block: int  # first block of its quantized values; -1: dense


@dataclasses.dataclass(frozen=True)
class Layout:
    """The flat all-gather input of one param group (FSDP's ``foreach_all_gather``: each
    parameter's padded shard in ``fsdp_params`` order) and which parameters are quantized."""

    segments: tuple[Segment, ...]
    n_blocks: int

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @property
    def dense_numel(self) -> int:
        return sum(s.numel for s in self.segments if s.block < 0)

    def payload_nbytes(self, codec: WeightCodec, dtype: torch.dtype) -> int:
        dense = -(-self.dense_numel * dtype.itemsize // 4) * 4
        return -(-(HEADER_BYTES + dense + codec.nbytes(self.n_blocks)) // 16) * 16

    def digest(self) -> int:
        h = rng.mix32(len(self.segments))
        for s in self.segments:
            for value in (s.offset, s.numel, s.block):
                h = rng.mix32(h ^ (value & rng.MASK32))
        return h


def layout_of(fsdp_params, options: AllGatherOptions) -> Layout:
    """The :class:`Layout` of a param group's SHARDED all-gather input."""
    segments, offset, block = [], 0, 0
    for p in fsdp_params:
        numel = p.padded_sharded_param_size.numel()
        name = p._module_info.param_name
        if options.quantizes(p._orig_size):
            segments.append(Segment(name, offset, numel, block))
            block += options.codec.n_blocks(numel)
        else:
            segments.append(Segment(name, offset, numel, -1))
        offset += numel
    return Layout(tuple(segments), block)


class AllGatherState:
    """What every compressed all-gather of one ``register`` shares: the options and the
    counters (``stats()``: ``dense_bytes`` what plain FSDP2 would have all-gathered, in
    its dtype; ``wire_bytes`` what was handed to collectives, handshakes included)."""

    def __init__(self, options: AllGatherOptions):
        self.options = options
        self.counters = Counters()
        self._logged: set = set()
        self._workspace: torch.Tensor | None = None
        self.switch = None  # bits="auto" (hhook.fsdp.auto.Switch): dense while it says so

    def workspace(self, n_blocks: int, device: torch.device) -> torch.Tensor:
        """A float32 ``(n_blocks, B)`` buffer. On CPU it is kept and reused (sized for the
        largest param group's shard; why: docs/fsdp.md); elsewhere a fresh tensor (the
        caching allocator reuses memory)."""
        B = self.options.block_size
        if device.type != "cpu":
            return torch.empty(n_blocks, B, dtype=torch.float32, device=device)
        if self._workspace is None or self._workspace.numel() < n_blocks * B:
            self._workspace = torch.empty(n_blocks * B, dtype=torch.float32)
        return self._workspace[: n_blocks * B].view(n_blocks, B)

    def count(self, kind, dense_bytes: int, wire_bytes: int) -> None:
        self.counters.add(kind, dense_bytes, wire_bytes)

    def stats(self) -> dict:
        return self.counters.snapshot()

    def log_once(self, key, message: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message, *args)


class THCAllGather(AllGather):
    """FSDP2's ``AllGather`` comm for one param group: quantized payloads all-gathered,
    decoded into FSDP's output (module docstring). A call it cannot serve (an input
    dtype outside :data:`QUANTIZED_DTYPES`, an input that is not the group's SHARDED
    layout) is a plain all-gather, logged once per reason."""

    def __init__(self, state: AllGatherState, layout: Layout, name: str):
        self.state = state
        self.layout = layout
        self.name = name
        self.codec = state.options.codec

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def fingerprint(self, dtype: torch.dtype) -> int:
        h = rng.mix32(self.codec.fingerprint() ^ self.layout.digest() ^ (self.state.options.min_numel & rng.MASK32))
        return rng.mix32(h ^ _DTYPE_CODES[dtype])

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        switch, said = self.state.switch, None
        if switch is not None:
            switch.begin()  # bits="auto": a step's method is fixed before its first all-gather (a prefetch too)
            said = load_check.said(switch.decider.state, group, "all-gather")  # every rank numbers every one alike
            if switch.loading(group):  # this rank loaded a checkpoint: did every rank?
                self._loaded_check(output_tensor, input_tensor, group, said)
                return self(output_tensor, input_tensor, group, async_op)  # every rank did: the loaded method
        loaded = self._gather(output_tensor, input_tensor, group, said is not None and switch.all_gather_dense)
        if loaded:  # some rank loaded a checkpoint since the handshake, this one did not
            raise load_check.named_error(said)
        return None

    def _gather(self, output_tensor, input_tensor, group, dense: bool, mark: bool = False) -> int:
        """The all-gather (``dense``: FSDP's own; ``mark``: this rank says it loaded a
        checkpoint, :meth:`_loaded_check`, and counts nothing): how many ranks said so
        (read under ``bits="auto"`` only, whose ranks alone say it)."""
        reads = self.state.switch is not None
        reason = None if dense else self._unservable(output_tensor, input_tensor, group)
        if dense or reason is not None:
            if reason is not None:
                self.state.log_once((self.name, reason), "hhook.fsdp: %s: all-gathered dense (%s)", self.name, reason)
            return self._dense(output_tensor, input_tensor, group, "dense_calls", mark, reads)
        world, rank = group.size(), group.rank()
        fp = self.fingerprint(input_tensor.dtype)
        payload, failure = self._encode(input_tensor, fp, mark)
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
        all_gather_flat(gathered, payload, group=group)
        rows = gathered.view(world, -1)
        headers = rows[:, :HEADER_BYTES].view(torch.int32)[:, :3].tolist()  # a host read (free on CPU)
        if not mark:
            self.state.count("compressed_calls", output_tensor.nbytes, gathered.nbytes)
        self._check(headers, fp, rank, failure)
        loaded = sum(said for *_, said in headers) if reads else 0
        if loaded or mark:
            return loaded
        if any(message.any_nonfinite(status) for _, status, _ in headers):
            return self._dense(output_tensor, input_tensor, group, "nonfinite_calls")
        out = output_tensor.view(world, -1)
        for j in range(world):
            self._decode(rows[j], out[j])
        return 0

    def _loaded_check(self, output_tensor, input_tensor, group, said) -> None:
        """This rank loaded a checkpoint since the handshake: the all-gather every rank
        verified (:meth:`hhook.fsdp.auto.Decider.live`'s method), saying so, with every
        rank's count (:func:`hhook.schedule.load_check.settled`: returns where every rank
        loaded, else raises naming each rank's options). A dense all-gather that cannot
        carry the count (:func:`~hhook.schedule.load_check.marks_fit`: on a GPU, float16)
        is not made: the loaded options' handshake runs at the next reduce-scatter, as
        before this check existed."""
        state = self.state.switch.decider.state
        dense = self.state.switch.all_gather_dense
        if dense and not load_check.marks_fit(input_tensor):
            load_check.handshook(state, group)
            return
        load_check.settled(state, group, self._gather(output_tensor, input_tensor, group, dense, mark=True), said)

    def _unservable(self, output_tensor, input_tensor, group) -> str | None:
        if input_tensor.dtype not in QUANTIZED_DTYPES:
            return f"its all-gather buffer is {input_tensor.dtype}, not a float32/bfloat16/float16 buffer"
        if input_tensor.numel() != self.layout.numel or output_tensor.numel() != group.size() * self.layout.numel:
            return (f"its all-gather input has {input_tensor.numel()} elements, not the {self.layout.numel} of "
                    "its sharded parameters")
        return None

    def _dense(self, output_tensor, input_tensor, group, kind: str, mark: bool = False, read: bool = False) -> int:
        """FSDP2's own all-gather of the input, counted as ``kind`` (``mark``: this rank says
        it loaded a checkpoint, counted nowhere): how many ranks said so, where ``read``
        (:func:`hhook.schedule.load_check.dense_all_gather`)."""
        loaded = load_check.dense_all_gather(output_tensor, input_tensor, group, mark, read)
        if not mark:
            self.state.count(kind, output_tensor.nbytes, output_tensor.nbytes)
        return loaded

    def _encode(self, input_tensor: torch.Tensor, fp: int, loaded: bool = False) -> tuple[torch.Tensor,
                                                                                          BaseException | None]:
        """This rank's payload (``loaded``: its header says this rank loaded a checkpoint),
        and the exception that stopped its encoding (then the payload is a header saying
        so, and the rank still joins the all-gather)."""
        dtype, codec = input_tensor.dtype, self.codec
        payload = torch.zeros(self.layout.payload_nbytes(codec, dtype), dtype=torch.uint8, device=input_tensor.device)
        status, failure = 0, None
        try:
            src = input_tensor.detach()
            dense_end = HEADER_BYTES + self.layout.dense_numel * dtype.itemsize
            dense = payload[HEADER_BYTES:dense_end].view(dtype)
            blocks = self.state.workspace(self.layout.n_blocks, src.device)
            flat, at = blocks.view(-1), 0
            for s in self.layout.segments:
                if s.block < 0:
                    dense[at:at + s.numel].copy_(src[s.offset:s.offset + s.numel])
                    at += s.numel
                else:  # the shard, then zeros to the end of its last block
                    start, end = s.block * codec.block_size, (s.block + codec.n_blocks(s.numel)) * codec.block_size
                    flat[start:start + s.numel].copy_(src[s.offset:s.offset + s.numel])
                    flat[start + s.numel:end].zero_()
            if not codec.encode(blocks, self._codec_bytes(payload, dtype)):
                status = message.status_word(True, False)  # dense parameters carry their own inf/NaN
        except Exception as exc:  # noqa: BLE001 - said in the header, raised after the all-gather on every rank
            status, failure = message.status_word(False, True), exc
        payload[:12].view(torch.int32).copy_(torch.tensor([rng._to_int32(fp), status, int(loaded)], dtype=torch.int32))
        return payload, failure

    def _codec_bytes(self, payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        start = HEADER_BYTES + -(-self.layout.dense_numel * dtype.itemsize // 4) * 4
        return payload[start:start + self.codec.nbytes(self.layout.n_blocks)]

    def _check(self, headers: list, fp: int, rank: int, failure: BaseException | None) -> None:
        if failure is not None:
            raise failure
        failed = [j for j, (_, status, _) in enumerate(headers) if message.any_failed(status)]
        if failed:
            raise RankFailedError(f"hhook.fsdp: rank(s) {failed} of the shard group failed while encoding the "
                                  f"parameters of {self.name} for the all-gather (their own exception is raised there)")
        others = [j for j, (f, *_) in enumerate(headers) if f != rng._to_int32(fp)]
        if others:
            raise ConfigMismatchError(f"hhook.fsdp: rank(s) {others} sent all-gather payloads of other options or "
                                      f"layouts than rank {rank}'s for {self.name}")

    def _decode(self, row: torch.Tensor, out: torch.Tensor) -> None:
        """One rank's payload ``row`` into its slice ``out`` of FSDP's output."""
        dtype, codec = out.dtype, self.codec
        dense = row[HEADER_BYTES:HEADER_BYTES + self.layout.dense_numel * dtype.itemsize].view(dtype)
        values = codec.decode(self._codec_bytes(row, dtype), self.layout.n_blocks,
                              self.state.workspace(self.layout.n_blocks, row.device)).view(-1)
        at = 0
        for s in self.layout.segments:
            if s.block < 0:
                out[s.offset:s.offset + s.numel].copy_(dense[at:at + s.numel])
                at += s.numel
            else:
                start = s.block * codec.block_size
                out[s.offset:s.offset + s.numel].copy_(values[start:start + s.numel])


def _dense_reason(module, group, layout: Layout) -> str | None:
    """Why a module's all-gather stays plain (documented in docs/fsdp.md), or None."""
    if len(param_groups(module)) > 1:
        return "several param groups (shard_placement_fn with per-parameter meshes): FSDP refuses a custom all-gather"
    if group.post_forward_mesh_info is not None and group.post_forward_mesh_info is not group.mesh_info:
        return "reshard_after_forward is an int: the backward all-gathers over a smaller group and another layout"
    for p in group.fsdp_params:
        if not p.sharded_param.dtype.is_floating_point:
            return f"parameter {p._module_info.param_name!r} is {p.sharded_param.dtype}"
        if p.is_dtensor:
            return (f"parameter {p._module_info.param_name!r} is a DTensor on a mesh of its own (tensor or expert "
                    "parallelism: several mesh dimensions)")
    if layout.n_blocks == 0:
        return "no parameter with two dimensions and at least all_gather_min_numel elements"
    return None


def plan(entries, state: AllGatherState | None) -> tuple[list, dict]:
    """``([(name, module, comm or None, why dense)], {group key: (shard group, digest)})``
    for ``entries`` of ``(name, FSDPModule, param group)``: the comms (none without a
    ``state``: no compressed all-gather) and, per shard group, a digest of its modules'
    plans for the registration's handshake (:func:`fields`). Raises before anything
    changes: ``RuntimeError`` when this torch has no ``set_custom_all_gather``,
    ``ValueError`` when a module's all-gather is customised already."""
    out, groups = [], {}
    for name, module, group in entries:
        pg = group.mesh_info.shard_process_group
        h = groups.get(group_key(pg), (pg, rng.mix32(len(entries))))[1]
        if state is not None:
            if not hasattr(module, "set_custom_all_gather"):
                raise RuntimeError("hhook.fsdp: this torch's FSDP2 has no FSDPModule.set_custom_all_gather (torch >= "
                                   f"2.11 has it; this is torch {torch.__version__}): the all-gather cannot be "
                                   "compressed. Leave all_gather unset to compress the reduce-scatter only")
            comm = getattr(group, "_all_gather_comm", None)
            if comm is not None and type(comm).__name__ != "DefaultAllGather":
                raise ValueError(f"hhook.fsdp: {name} ({type(module).__name__}) already has a custom all-gather "
                                 f"({type(comm).__name__}); hhook cannot combine with it")
            layout = layout_of(group.fsdp_params, state.options)
            reason = _dense_reason(module, group, layout)
            out.append((name, module, None if reason else THCAllGather(state, layout, name), reason))
            dtypes = [_DTYPE_CODES.get(_gathered_dtype(p, group), 0) for p in group.fsdp_params]
            for value in (zlib.crc32(name.encode()), reason is None, layout.digest(), *dtypes):
                h = rng.mix32(h ^ (int(value) & rng.MASK32))
        groups[group_key(pg)] = (pg, h)
    return out, groups


def fields(state: AllGatherState | None, digest: int) -> tuple:
    """What a shard group's handshake compares of the all-gather
    (:func:`hhook.schedule.handshake.agree`): whether it is compressed, its options, and
    ``digest`` of the plans of the group's modules (:func:`plan`)."""
    if state is None:
        return (("all_gather", "plain"),)
    o = state.options
    return (("all_gather", "compressed"), ("ag_bits", o.bits), ("ag_block_size", o.block_size),
            ("ag_rotate", o.rotate), ("ag_seed", o.seed), ("ag_min_numel", o.min_numel), ("ag_plans", digest))


def _gathered_dtype(fsdp_param, group) -> torch.dtype:
    """The dtype FSDP all-gathers a parameter in (its policy's ``param_dtype`` for floats;
    FSDP sets ``fsdp_param.param_dtype`` only at its lazy init, after registration)."""
    dtype, param_dtype = fsdp_param.sharded_param.dtype, group.mp_policy.param_dtype
    return param_dtype if param_dtype is not None and dtype.is_floating_point else dtype


def apply(planned, switch=None) -> None:
    """Set the planned comms (``switch``: bits="auto"'s, :mod:`hhook.fsdp.auto`); one log
    line names the modules that stay dense, and why."""
    dense = []
    for name, module, comm, reason in planned:
        if comm is None:
            dense.append(f"{name} ({reason})")
        else:
            comm.state.switch = switch
            module.set_custom_all_gather(comm)
    if dense:
        logger.warning("hhook.fsdp: the parameter all-gather stays dense for %s", "; ".join(dense))


def find_state(module) -> AllGatherState | None:
    """The :class:`AllGatherState` of the compressed all-gathers set on ``module``'s FSDP modules."""
    for m in module.modules():
        for group in param_groups(m) if hasattr(m, "_get_fsdp_state") else ():
            comm = getattr(group, "_all_gather_comm", None)
            if isinstance(comm, THCAllGather):
                return comm.state
    return None
