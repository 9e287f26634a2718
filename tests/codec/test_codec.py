"""The reference codec on one process: n ranks simulated by local MAX and SUM."""

import math

import pytest
import torch

from hhook.codec import lanes, quantization, rng, rotation
from hhook.codec.kernels.backend import FORCE_REFERENCE_ENV
from hhook.simulation import heavy_tailed, simulate_allreduce, vnmse
from hhook.codec import HEADER, ConfigMismatchError, THCCodec
from hhook.codec import agreed_status as codec_status


pytestmark = pytest.mark.quick  # the codec against its specification: the quick tier


@pytest.fixture(autouse=True)
def reference_codec(monkeypatch):
    """These tests specify the torch reference (tests/codec/test_cpu_kernels.py checks the fused
    CPU path against it), so the reference is forced even where a compiler exists."""
    monkeypatch.setenv("HHOOK_FORCE_REFERENCE", "1")


# -- counter-based RNG ---------------------------------------------------------
@pytest.mark.parametrize("count", [1, 7, 64, 1001])  # vectorized loops and their scalar tails
@pytest.mark.parametrize("start", [0, 2**31 - 5, 2**32 - 3])  # across the int32 sign and wrap
def test_tensor_hash_matches_exact_scalar_hash(count, start):
    key = rng.stream_key(7, 3, 11)
    got = (rng.hash_range(key, start, count).long() & rng.MASK32).tolist()
    assert got == [rng.mix32(start + i + key) for i in range(count)]
    u = rng.uniform(key, start, count)
    assert u.tolist() == [(rng.mix32(start + i + key) >> 8) * 2.0**-24 for i in range(count)]


def test_uniform_is_chunk_invariant_and_in_range():
    whole = rng.uniform(123, 0, 10_000)
    parts = torch.cat([rng.uniform(123, s, 1000) for s in range(0, 10_000, 1000)])
    assert torch.equal(whole, parts)
    assert whole.min() >= 0 and whole.max() < 1
    assert abs(whole.mean().item() - 0.5) < 0.01
    assert abs(whole.var().item() - 1 / 12) < 0.005


def test_rank_streams_are_uncorrelated():
    a = rng.uniform(rng.stream_key(0, 0, 5), 0, 100_000)
    b = rng.uniform(rng.stream_key(0, 1, 5), 0, 100_000)
    c = rng.uniform(rng.stream_key(0, 0, 6), 0, 100_000)
    for other in (b, c):
        assert abs(torch.corrcoef(torch.stack([a, other]))[0, 1].item()) < 0.01


# -- rotation --------------------------------------------------------------------
@pytest.mark.parametrize("block", [1, 2, 8, 32, 128, 1024])
def test_rotation_is_the_randomized_hadamard_matrix(block):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    d = torch.diag(rotation.signs(5, block, torch.device("cpu")).double())
    x = torch.randn(3, block)
    expected = (h @ d @ x.double().T / math.sqrt(block)).T
    assert torch.allclose(rotation.rotate(x, 5).double(), expected, atol=1e-5)
    assert torch.allclose(rotation.unrotate(rotation.rotate(x, 5), 5), x, atol=1e-5)


def test_bad_block_sizes_are_rejected():
    for bad in (0, 3, 1000, 1 << 17, 2.0):
        with pytest.raises(ValueError):
            THCCodec(block_size=bad)


# -- lanes -----------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_lanes_never_overflow_with_every_rank_sending_the_largest_code(bits):
    levels = 1 << bits
    for n in range(1, 17):
        layout = lanes.choose_layout(n, levels)
        assert n * (levels - 1) < 1 << layout.width <= 2 * n * (levels - 1) + 1
        count = 3 * layout.lanes + 1
        codes = lanes.code_buffer(count, layout)
        codes[:count] = levels - 1
        words = lanes.pack(codes, layout)
        total = words.clone()
        for _ in range(n - 1):
            total += words  # wraps like the collectives do
        assert lanes.unpack(total, layout, count, torch.int64).tolist() == [n * (levels - 1)] * count


def test_layout_matches_design_table():
    # n=4, L=16: lane sums reach 4*15 = 60 -> ceil(log2(61)) = 6 bits, 5 per int32, 6.4 bits/coordinate
    layout = lanes.choose_layout(4, 16)
    assert (layout.width, layout.lanes, layout.word_dtype) == (6, 5, torch.int32)
    assert lanes.choose_layout(8, 16).bits_per_code < 8  # int64 packs 9 lanes of 7 bits
    with pytest.raises(ValueError):
        lanes.choose_layout(1 << 17, 256)


def test_pack_unpack_roundtrip():
    layout = lanes.choose_layout(3, 8)
    codes = lanes.code_buffer(1001, layout)
    values = torch.randint(0, 8, (1001,))
    codes[:1001] = values
    assert torch.equal(lanes.unpack(lanes.pack(codes, layout), layout, 1001, torch.int64), values)


# -- quantization and the whole codec --------------------------------------------
@pytest.mark.parametrize("rounding", ["correlated", "independent"])
def test_codec_is_unbiased(rounding, monkeypatch):
    """The mean of many independent decodes converges to the true mean.

    A biased rounding (u = 1/2, round to nearest) is run through the same check and must fail it.
    """
    codec = THCCodec(bits=2, block_size=64, world_size=2, rounding=rounding)
    inputs = heavy_tailed(4096, 2, seed=1)
    mean = inputs.mean(0)

    def averaged_error(trials):
        avg = sum(simulate_allreduce(codec, inputs, step) for step in range(trials)) / trials
        return float((avg - mean).pow(2).sum() / mean.pow(2).sum())

    single = averaged_error(1)
    unbiased = averaged_error(200)
    assert unbiased < 3 * single / 200

    monkeypatch.setenv(FORCE_REFERENCE_ENV, "1")  # the patched thresholds reach the reference only
    monkeypatch.setattr(rng, "thresholds", lambda stream, start, count, block, device=None: torch.full((count,), 0.5))
    biased = averaged_error(200)
    assert biased > 3 * single / 200


def test_quality_on_heavy_tailed_gradients():
    inputs = heavy_tailed(1 << 20, 4, seed=2)
    assert vnmse(simulate_allreduce(THCCodec(4, 1024, 0, 4), inputs), inputs) <= 2e-2
    assert vnmse(simulate_allreduce(THCCodec(8, 1024, 0, 4), inputs), inputs) <= 1e-4


def test_wire_ratio_at_four_bits_and_four_ranks():
    numel = 25 << 18
    assert 4 * numel / THCCodec(4, 1024, 0, 4).wire_bytes(numel) >= 4.9


@pytest.mark.parametrize("numel", [1, 2, 3, 15, 16, 17, 1023, 1025, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_any_length_and_dtype(numel, dtype):
    codec = THCCodec(bits=8, block_size=1024, world_size=3)
    inputs = torch.randn(3, numel).to(dtype)
    prepared = [codec.prepare(x) for x in inputs]
    agreed = torch.stack([p.scales for p in prepared]).amax(0)
    total = sum(codec.quantize(p, agreed, r) for r, p in enumerate(prepared))
    out = codec.decode(prepared[1], agreed, total, torch.empty_like(inputs[1]))
    assert out.dtype == dtype and out.shape == (numel,)
    exact = inputs.float().mean(0)
    tol = 0.02 * inputs.float().abs().max().item() + (0.01 if dtype != torch.float32 else 0)
    assert (out.float() - exact).abs().max().item() < tol


def test_zero_tensor_decodes_to_exact_zero():
    codec = THCCodec(world_size=2)
    z = torch.zeros(3000)
    assert torch.equal(simulate_allreduce(codec, torch.stack([z, z])), z)


def test_small_tensors_use_small_blocks():
    codec = THCCodec(bits=4, block_size=1024, world_size=4)
    assert codec.block_for(10) == 16 and codec.block_for(1) == 1 and codec.block_for(5000) == 1024
    assert codec.wire_bytes(100) < 400  # less than the fp32 tensor itself


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_nonfinite_rank_makes_every_result_nonfinite(bad):
    codec = THCCodec(world_size=2)
    inputs = torch.randn(2, 2048)
    inputs[1, 77] = bad
    prepared = [codec.prepare(x) for x in inputs]
    agreed = torch.stack([p.scales for p in prepared]).amax(0)
    residual = torch.randn(2, 2048)
    for r, p in enumerate(prepared):
        old = residual[r].clone()
        words = codec.quantize(p, agreed, r, residual[r].view(2, 1024))
        assert torch.equal(residual[r], old)  # a skipped step leaves the residual alone
        assert codec.decode(p, agreed, words, torch.empty(2048)).isnan().all()


def test_mismatched_configuration_is_detected():
    a, b = THCCodec(4, 1024, 0, 2), THCCodec(4, 1024, 1, 2)
    x = torch.randn(4096)
    pa, pb = a.prepare(x), b.prepare(x)
    agreed = torch.maximum(pa.scales, pb.scales)
    with pytest.raises(ConfigMismatchError, match="disagree"):
        a.verify(agreed, x.numel())
    a.verify(torch.maximum(pa.scales, a.prepare(-x).scales), x.numel())
    # Without the check, the result is NaN, never a wrong mean.
    words = a.quantize(pa, agreed, 0) + b.quantize(pb, agreed, 1)
    assert a.decode(pa, agreed, words, torch.empty(4096)).isnan().all()


def test_error_feedback_residual_is_own_rounding_error():
    codec = THCCodec(bits=2, block_size=256, world_size=1)
    x = torch.randn(1000)
    prepared = codec.prepare(x)
    agreed = torch.cat([codec.header(x.numel()), prepared.scales[HEADER:]])  # digest unknown
    residual = torch.zeros_like(prepared.blocks)
    words = codec.quantize(prepared, agreed, 9, residual)
    own = codec.decode(prepared, agreed, words, torch.empty(1000))
    padded = torch.zeros(1024)
    padded[:1000] = x - own
    # The residual lives in the rotated domain; cropped padding coordinates aside it is x - decode(x).
    back = rotation.unrotate(residual, 0).view(-1)
    assert torch.allclose(back[:1000], padded[:1000], atol=1e-5)


def test_unsupported_inputs_are_rejected():
    with pytest.raises(TypeError, match="float64"):
        THCCodec().prepare(torch.zeros(10, dtype=torch.float64))
    for bad in (0, 9, 4.0):
        with pytest.raises(ValueError, match="bits"):
            THCCodec(bits=bad)
    with pytest.raises(ValueError, match="seed"):
        THCCodec(seed=-1)


def test_vanishing_scale_gives_zero_codes_not_garbage():
    codes = torch.full((8,), -1, dtype=torch.int32)
    blocks = torch.full((2, 4), 1e-39)
    quantization.quantize_into(codes, blocks, torch.tensor([1e-39, 0.0]), 16, 3)
    assert codes.tolist() == [0] * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_identical_inputs_come_back_exact_and_keep_the_residual(dtype):
    """A tensor that is the same on every rank (an already averaged gradient) must not
    pick up rounding noise each time it is reduced again."""
    codec = THCCodec(bits=2, block_size=256, world_size=3)
    x = torch.randn(1000).to(dtype)
    prepared = [codec.prepare(x.clone()) for _ in range(3)]
    agreed = torch.stack([p.scales for p in prepared]).amax(0)
    residual = torch.randn(3, 4, 256)
    before = residual.clone()
    total = sum(codec.quantize(p, agreed, r, residual[r]) for r, p in enumerate(prepared))
    assert torch.equal(residual, before)
    out = codec.decode(prepared[0], agreed, total, torch.empty_like(x))
    assert torch.equal(out, x)


def test_one_flipped_bit_is_not_identical():
    codec = THCCodec(bits=4, block_size=256, world_size=2)
    x = torch.randn(5000)
    y = x.clone()
    y.view(torch.int32)[1234] ^= 1  # one ulp apart
    agreed = torch.maximum(codec.prepare(x).scales, codec.prepare(y).scales)
    assert not bool(codec_status(agreed)[2])
    assert bool(codec_status(torch.maximum(codec.prepare(x).scales, codec.prepare(x.clone()).scales))[2])


def test_digest_is_chunk_invariant_and_matches_python():
    bits = torch.randint(-(2**31), 2**31 - 1, (3000,), dtype=torch.int32)
    expected = 0
    for i, b in enumerate(bits.tolist()):
        expected += rng.mix32((b + i * 0x9E3779B9 + 0x44696773) & rng.MASK32)
    expected &= (1 << 48) - 1
    assert int(rng.digest(bits)) == expected == int(rng.digest(bits, chunk=7))


# -- one specification of the float operations -------------------------------------
def _spec_rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """docs/guarantees.md's rotation, written out with numpy float32 scalars' arithmetic:
    sign flip, butterflies on strides 1, 2, ..., B/2, then float32(1/sqrt(B))."""
    import numpy as np

    block = x.shape[1]
    v = (x * rotation.signs(seed, block, torch.device("cpu"))).numpy().astype(np.float32)
    h = 1
    while h < block:
        for i in range(0, block, 2 * h):
            for j in range(i, i + h):
                a, b = v[:, j].copy(), v[:, j + h].copy()
                v[:, j], v[:, j + h] = a + b, a - b
        h *= 2
    return torch.from_numpy(v * np.float32(1 / math.sqrt(block)))


@pytest.mark.parametrize("block", [1, 2, 8, 32, 128, 512])
def test_rotation_performs_the_specified_float_operations(block):
    x = torch.randn(5, block) * torch.logspace(-3, 3, block)
    assert torch.equal(rotation.rotate(x, 7).view(torch.int32), _spec_rotate(x, 7).view(torch.int32))
    y = rotation.rotate(x, 7)
    d0, d7 = (rotation.signs(seed, block, torch.device("cpu")) for seed in (0, 7))
    back = _spec_rotate(y * d0, 0) * d7  # D H y / sqrt(B): D_0 D_0 = 1 undoes _spec_rotate's signs
    assert torch.equal(rotation.unrotate(y, 7).view(torch.int32), back.view(torch.int32))


# -- the default dtype (issue 42) ---------------------------------------------------
def dtype_probe(switch=lambda: None) -> dict:
    """Every output of the codec's stages on fixed inputs: ``THCCodec`` through the
    reference and the fused CPU path (error feedback on), ``WeightCodec``; ``switch()`` runs
    between stages (tests change the default dtype there)."""
    import os

    from hhook.codec.weights import WeightCodec

    g = torch.Generator().manual_seed(42)
    xs = [torch.randn(5000, generator=g, dtype=torch.float32) * 3 for _ in range(3)]
    out = {}
    saved = os.environ.get(FORCE_REFERENCE_ENV)
    try:
        for name, force in (("reference", "1"), ("fused", "0")):
            os.environ[FORCE_REFERENCE_ENV] = force
            codec = THCCodec(4, 512, 3, 3)
            prepared = [codec.prepare(x) for x in xs]
            switch()
            agreed = torch.stack([p.scales for p in prepared]).amax(0)
            residual = torch.zeros(3, codec.n_blocks(5000), 512, dtype=torch.float32)
            words = [codec.quantize(p, agreed, codec.stream(r, 9), residual[r]) for r, p in enumerate(prepared)]
            switch()
            total = sum(words)
            decoded = codec.decode(prepared[0], agreed, total, torch.empty(5000, dtype=torch.float32))
            out[name] = (agreed, torch.stack(words), residual, decoded)
            switch()
    finally:
        if saved is None:
            os.environ.pop(FORCE_REFERENCE_ENV, None)
        else:
            os.environ[FORCE_REFERENCE_ENV] = saved
    weights = WeightCodec(bits=4, block_size=256)
    blocks = torch.randn(6, 256, generator=g, dtype=torch.float32) ** 3  # heavy tails: "auto" rotates some
    payload = torch.empty(weights.nbytes(6), dtype=torch.uint8)
    weights.encode(blocks.clone(), payload)
    switch()
    out["weights"] = (payload, weights.decode(payload, 6))
    return out


def _flat(probe: dict) -> list[torch.Tensor]:
    return [t for name in sorted(probe) for t in probe[name]]


def _same_bits(a: dict, b: dict) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(_flat(a), _flat(b), strict=True))


def test_results_do_not_depend_on_the_default_dtype(monkeypatch):
    base = dtype_probe()
    assert all(t.dtype in (torch.float32, torch.int32, torch.uint8) for t in _flat(base))
    defaults = iter([torch.bfloat16, torch.float64, torch.float32] * 10)
    try:
        torch.set_default_dtype(torch.bfloat16)
        under = dtype_probe()
        torch.set_default_dtype(torch.float32)
        switching = dtype_probe(lambda: torch.set_default_dtype(next(defaults)))
    finally:
        torch.set_default_dtype(torch.float32)
    assert _same_bits(base, under) and _same_bits(base, switching)


def test_a_first_use_under_bfloat16_gives_the_same_bits(tmp_path):
    """The caches (signs, norms, kernels) are filled by the first use: in a fresh process."""
    import subprocess
    import sys

    from tests.support.distributed import subprocess_env

    script = ("import torch; torch.set_default_dtype(torch.bfloat16)\n"
              "from tests.codec.test_codec import dtype_probe\n"
              f"torch.save(dtype_probe(), {str(tmp_path / 'probe.pt')!r})\n")
    done = subprocess.run([sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _same_bits(dtype_probe(), torch.load(tmp_path / "probe.pt", weights_only=True))


@pytest.mark.parametrize("fused", ["0", "1"], ids=["fused", "reference"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 2.0**126])
def test_a_nonfinite_residual_sets_the_flag_like_a_nonfinite_input(monkeypatch, fused, bad):
    """What a rank encodes is the rotated tensor plus its residual: a NaN there rounded to
    code 0 and decoded finite and wrong (issue 58); now the flag covers the residual, in
    the reference and the fused CPU kernel alike, and a finite residual changes nothing."""
    monkeypatch.setenv(FORCE_REFERENCE_ENV, "1" if fused == "0" else "0")
    codec = THCCodec(bits=4, block_size=64)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    clean = codec.prepare(x)
    fine = codec.prepare(x, torch.full((16, 64), 1e3))
    assert torch.equal(fine.scales, clean.scales) and torch.equal(fine.header, clean.header)
    residual = torch.zeros(16, 64)
    residual[9, 17] = bad
    spoilt = codec.prepare(x, residual)
    assert spoilt.scales[0] == 1 and spoilt.header[0] == 1 and not spoilt.scales[HEADER:].any()
    assert bool(codec_status(spoilt.scales)[0])
    with pytest.raises(ValueError, match="residual"):
        codec.prepare(x, torch.zeros(3, 64))
