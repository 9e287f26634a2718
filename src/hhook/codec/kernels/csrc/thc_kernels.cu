// Fused CUDA kernels for the hhook codec (hhook/codec/kernels/cuda.py launches them).
//
// The pure-torch codec (hhook/codec/: codec.py, rotation.py, quantization.py, lanes.py,
// rng.py, weights.py) is the specification; every kernel performs its float operations in
// its order, so a GPU rank decodes to the bits of a CPU rank (docs/guarantees.md). One
// kernel per stage, each reading its input once and writing its output once; none needs
// the host to read a device value:
//
//   hh_prepare_*   the bucket: sign diagonal D, Walsh-Hadamard butterflies, max |y| per
//                  block (times float32(1/sqrt B)), the 48-bit digest of the float32 bits;
//                  the last CUDA block to finish writes the header (and a copy of it for
//                  the transport) and zeroes the maxima if a block was non-finite.
//   hh_quantize_*  the bucket again (the rotation recomputed, cheaper than storing it), the
//                  residual, stochastic rounding onto the agreed scales, the codes packed
//                  into planar lane words in shared memory, written once; optionally the
//                  message prefix of hhook/scales/message.py. A header that says
//                  "non-finite" or "identical" gives zero words and the old residual.
//   hh_decode_*    the summed words: lane sums, dequantized mean, inverse rotation, stored
//                  in the output's dtype; NaN if the agreed header (or the summed message
//                  prefix, when given) says so, the source itself if "identical".
//   hh_wq_*        FSDP2's all-gather codec (hhook/codec/weights.py): encode and decode.
//
// The rotation, in registers: a warp holds a chunk of 1024 coordinates as a 32 x 32 tile,
// 32 values per thread. Phase A: each thread holds a row (coordinates 32 lane + r) and runs
// the butterflies of index bits 0-4 in registers; one transpose through shared memory;
// phase B: each thread holds a column (coordinates 32 r + lane), bits 5-9. Blocks of 2048
// and 4096 add phase C across the CUDA block's 4 warps (bits 10-11) through shared memory.
// So the butterflies run on strides 1, 2, ..., B/2 in ascending order, each an exact-rounded
// add and subtract, as hhook/codec/rotation.py specifies; max |y| and 1/sqrt(B) follow.
// Shared-memory tiles are XOR-swizzled (hh_sw): row reads and writes of 16 bytes, column
// reads and writes of 4, and the coalesced loads all run without bank conflicts.
//
// No #include on purpose: NVRTC (through CuPy) compiles this without host headers, and
// fp16/bf16 are raw 16-bit patterns (PTX cvt for fp16, bit arithmetic for bf16). Every
// float operation that must match the CPU is hh_add/hh_sub/hh_mul/hh_div: inline PTX with
// an explicit rounding mode and no .ftz, so it is never contracted into an FMA and keeps
// subnormals although CuPy appends -ftz=true (which makes the __f*_rn intrinsics flush);
// comparisons (hh_lt, hh_le, hh_eq), negation (hh_neg) and float-to-integer (hh_to_u32)
// likewise do not flush (tests/codec/test_cuda.py reads the PTX for any .ftz or FMA).
// Kernels take one argument, a struct by value (cuda_launches.py reads the structs from this
// file), so that a launch passes one pointer from Python. Each struct's fields that change
// from call to call come first, those of the bucket's shape after the marker line.

#define HH_HEADER 7
#define HH_PREFIX 12                 // hhook/codec/layout.py: PREFIX
#define HH_RANK_FAILED (1 << 20)     // hhook/codec/layout.py: RANK_FAILED
#define HH_WARPS 4
#define HH_THREADS (32 * HH_WARPS)
#define HH_CHUNK 1024                // a warp's coordinates: one 32 x 32 tile
#define HH_TILE (HH_CHUNK * HH_WARPS)  // a CUDA block's coordinates in prepare and decode
#define HH_WORD_BYTES 16384          // quantize's words in shared memory, per CUDA block
#define HH_SLOTS 32                  // prepare's digest: CUDA block b adds into slot b % HH_SLOTS
// At most HH_THREADS threads per CUDA block, and registers for HH_MIN_BLOCKS of them per SM.
#define HH_MIN_BLOCKS 4

typedef unsigned int hh_u32;
typedef unsigned long long hh_u64;
typedef long long hh_i64;
typedef unsigned short hh_u16;

// ---- float32 arithmetic that neither flushes subnormals nor contracts into FMA -----------
#ifndef HHOOK_HOST_EMULATION
#define HH_FLOP(NAME, OP)                                                   \
    __device__ __forceinline__ float NAME(float a, float b) {               \
        float r;                                                            \
        asm(OP ".rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));           \
        return r;                                                           \
    }
HH_FLOP(hh_add, "add")
HH_FLOP(hh_sub, "sub")
HH_FLOP(hh_mul, "mul")
HH_FLOP(hh_div, "div")
__device__ __forceinline__ float hh_half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short hh_float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#define HH_SETP(NAME, OP)                                                                      \
    __device__ __forceinline__ bool NAME(float a, float b) {                                   \
        hh_u32 r;                                                                              \
        asm("{ .reg .pred p; setp." OP ".f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b)); \
        return r != 0u;                                                                        \
    }
HH_SETP(hh_lt, "lt")  // a < b (false with a NaN, as in C)
HH_SETP(hh_le, "le")  // a <= b
HH_SETP(hh_eq, "eq")  // a == b
__device__ __forceinline__ hh_u32 hh_to_u32(float f) {  // (unsigned)f: truncation
    hh_u32 u;
    asm("cvt.rzi.u32.f32 %0, %1;" : "=r"(u) : "f"(f));
    return u;
}
#endif
__device__ __forceinline__ float hh_neg(float v) { return __uint_as_float(__float_as_uint(v) ^ 0x80000000u); }

__device__ __forceinline__ float hh_bf16_to_float(unsigned short h) { return __uint_as_float(((hh_u32)h) << 16); }
// Round to nearest even, NaN stays a quiet NaN: what torch does (c10::BFloat16).
__device__ __forceinline__ unsigned short hh_float_to_bf16(float f) {
    const hh_u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// An integer below 2^23 as a float, exactly, without a conversion instruction.
__device__ __forceinline__ float hh_small_to_float(hh_u32 c) {
    return hh_sub(__uint_as_float(0x4b000000u | c), 8388608.0f);
}

// Element types: a scalar, and PER16 consecutive elements in one aligned 16-byte access.
struct HhF32 {
    typedef float T;
    enum { PER16 = 4 };
    static __device__ __forceinline__ float load(const T* p, hh_i64 i) { return p[i]; }
    static __device__ __forceinline__ void store(T* p, hh_i64 i, float v) { p[i] = v; }
    static __device__ __forceinline__ void load16(const T* p, float* v) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    }
};
template <class Conv>
struct Hh16 {
    typedef unsigned short T;
    enum { PER16 = 8 };
    static __device__ __forceinline__ float load(const T* p, hh_i64 i) { return Conv::to_float(p[i]); }
    static __device__ __forceinline__ void store(T* p, hh_i64 i, float v) { p[i] = Conv::from_float(v); }
    static __device__ __forceinline__ void load16(const T* p, float* v) {
        const uint4 q = *reinterpret_cast<const uint4*>(p);
        const hh_u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = Conv::to_float((unsigned short)(w[k] & 0xffffu));
            v[2 * k + 1] = Conv::to_float((unsigned short)(w[k] >> 16));
        }
    }
};
struct HhHalfConv {
    static __device__ __forceinline__ float to_float(unsigned short h) { return hh_half_to_float(h); }
    static __device__ __forceinline__ unsigned short from_float(float f) { return hh_float_to_half(f); }
};
struct HhBF16Conv {
    static __device__ __forceinline__ float to_float(unsigned short h) { return hh_bf16_to_float(h); }
    static __device__ __forceinline__ unsigned short from_float(float f) { return hh_float_to_bf16(f); }
};
typedef Hh16<HhHalfConv> HhF16;
typedef Hh16<HhBF16Conv> HhBF16;

// ---- counter-based RNG, digest, signs: hhook/codec/rng.py, rotation.py --------------------
__device__ __forceinline__ hh_u32 hh_mix32(hh_u32 x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    x ^= x >> 15;
    return x;
}
// One term of rng.digest: mix32(bits + index * 0x9E3779B9 + 0x44696773).
__device__ __forceinline__ hh_u32 hh_digest_term(float v, hh_i64 index) {
    return hh_mix32(__float_as_uint(v) + (hh_u32)index * 0x9E3779B9u + 0x44696773u);
}
// Flip the sign of v where bit `bit` of mask is set (the diagonal D: exact).
__device__ __forceinline__ float hh_flip(float v, hh_u32 mask, int bit) {
    return __uint_as_float(__float_as_uint(v) ^ ((mask >> bit) << 31));
}
__device__ __forceinline__ hh_u32 hh_umax(hh_u32 a, hh_u32 b) { return a > b ? a : b; }
__device__ __forceinline__ bool hh_finite_bits(hh_u32 magnitude) { return magnitude < 0x7f800000u; }
// The bits of layout.overflow_limit(B) = 2^(126 - log2B): a block maximum at or above it
// (inf and NaN sort above) counts as non-finite, since its sums could overflow.
__device__ __forceinline__ hh_u32 hh_overflow_bits(int log2B) { return (hh_u32)(253 - log2B) << 23; }

// The agreed header's verdicts (layout.agreed_status), read by every thread.
__device__ __forceinline__ bool hh_nonfinite(const float* h) { return hh_lt(0.0f, h[0]); }
__device__ __forceinline__ bool hh_mismatch(const float* h) { return !hh_eq(h[1], hh_neg(h[2])); }
__device__ __forceinline__ bool hh_identical(const float* h) {
    return hh_eq(h[3], hh_neg(h[4])) && hh_eq(h[5], hh_neg(h[6]));
}

// ---- the 32 x 32 tile of a warp -----------------------------------------------------------
// Element (row, col) of a tile lives at hh_sw(row, col): 16-byte groups XOR-swizzled by the
// row, so that 8 lanes reading 16 bytes of 8 rows, or 32 lanes reading one column, hit 32
// distinct banks.
__device__ __forceinline__ int hh_sw(int row, int col) { return (row << 5) | (col ^ ((row & 7) << 2)); }

__device__ __forceinline__ void hh_row_read(const float* tile, int lane, float* v) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float4 q = *reinterpret_cast<const float4*>(tile + hh_sw(lane, 4 * k));
        v[4 * k] = q.x, v[4 * k + 1] = q.y, v[4 * k + 2] = q.z, v[4 * k + 3] = q.w;
    }
}
__device__ __forceinline__ void hh_row_write(float* tile, int lane, const float* v) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        float4 q;
        q.x = v[4 * k], q.y = v[4 * k + 1], q.z = v[4 * k + 2], q.w = v[4 * k + 3];
        *reinterpret_cast<float4*>(tile + hh_sw(lane, 4 * k)) = q;
    }
}
__device__ __forceinline__ void hh_col_read(const float* tile, int lane, float* v) {
#pragma unroll
    for (int r = 0; r < 32; ++r) v[r] = tile[hh_sw(r, lane)];
}
__device__ __forceinline__ void hh_col_write(float* tile, int lane, const float* v) {
#pragma unroll
    for (int r = 0; r < 32; ++r) tile[hh_sw(r, lane)] = v[r];
}

// Radix-2 butterflies of the bits [lo, hi) of the register index r, in ascending order:
// (v[r], v[r + 2^h]) -> (a + b, a - b) for every r whose bit h is clear.
__device__ __forceinline__ void hh_butterflies(float* v, int lo, int hi) {
#pragma unroll
    for (int h = 0; h < 5; ++h) {
        if (h >= lo && h < hi) {
#pragma unroll
            for (int r = 0; r < 32; ++r) {
                if (!(r & (1 << h))) {
                    const float a = v[r], b = v[r | (1 << h)];
                    v[r] = hh_add(a, b);
                    v[r | (1 << h)] = hh_sub(a, b);
                }
            }
        }
    }
}

// Phase C's layout: thread t of the CUDA block holds v[8 q + s] = coordinate
// 1024 q + 128 s + t of the 4096 in the warps' tiles (tile q, row 4 s + t / 32, column t % 32).
__device__ __forceinline__ void hh_c_read(const float* tiles, int t, float* v) {
#pragma unroll
    for (int k = 0; k < 32; ++k)
        v[k] = tiles[(k >> 3) * HH_CHUNK + hh_sw(((k & 7) << 2) | (t >> 5), t & 31)];
}
__device__ __forceinline__ int hh_c_coordinate(int k, int t) { return ((k >> 3) << 10) | ((k & 7) << 7) | t; }

// The signs of a row: bit r = D at position (u + 32 lane + r) mod B, for a chunk starting at u
// (u a multiple of min(B, 1024)). signs: bit p of word p / 32 set where D_p = -1.
__device__ __forceinline__ hh_u32 hh_row_signs(const hh_u32* signs, hh_i64 u, int lane, int log2B) {
    if (log2B >= 5) return signs[((hh_u32)(u & ((1ll << log2B) - 1)) >> 5) + (lane & ((1 << (log2B - 5)) - 1))];
    const hh_u32 w = signs[0];
    hh_u32 mask = 0;
    for (int i = 0; i < 32; ++i) mask |= ((w >> (i & ((1 << log2B) - 1))) & 1u) << i;
    return mask;
}
// Transpose a 32 x 32 bit matrix across the warp: lane i holds word i; returns, for this
// lane, bit r = bit `lane` of word r.
__device__ __forceinline__ hh_u32 hh_bit_transpose(hh_u32 word, int lane) {
    hh_u32 mine = 0;
#pragma unroll
    for (int b = 0; b < 32; ++b) {
        const hh_u32 m = __ballot_sync(0xffffffffu, (word >> b) & 1u);
        if (b == lane) mine = m;
    }
    return mine;
}
// The signs of a column (bit r = D at position (u + 32 r + lane) mod B, u a multiple of 1024)
// and of phase C's layout (bit k = D at position of hh_c_coordinate(k, t), B > 1024).
__device__ __forceinline__ hh_u32 hh_col_signs(const hh_u32* signs, int lane, int log2B) {
    if (log2B < 5) return ((signs[0] >> (lane & ((1 << log2B) - 1))) & 1u) ? 0xffffffffu : 0u;
    return hh_bit_transpose(signs[lane & ((1 << (log2B - 5)) - 1)], lane);
}
__device__ __forceinline__ hh_u32 hh_c_signs(const hh_u32* signs, int t, int log2B) {
    const int lane = t & 31;
    // lane k loads the word of the coordinates hh_c_coordinate(k, t) of this warp (the lane's
    // own bits 0-4 select the bit)
    return hh_bit_transpose(signs[(hh_c_coordinate(lane, t & ~31) & ((1 << log2B) - 1)) >> 5], lane);
}

// ---- loading a chunk ----------------------------------------------------------------------
// x[u, u + 1024) (zeros at and past `limit`) into a warp's tile with coalesced 16-byte loads
// where `vec` (the pointer is aligned) allows; returns the lane's part of the digest of the
// float32 bits when `digest`.
template <class E>
__device__ __forceinline__ void hh_put16(float* tile, int e, const float* v) {
#pragma unroll
    for (int q = 0; q < E::PER16; q += 4) {
        float4 f;
        f.x = v[q], f.y = v[q + 1], f.z = v[q + 2], f.w = v[q + 3];
        *reinterpret_cast<float4*>(tile + hh_sw((e + q) >> 5, (e + q) & 31)) = f;
    }
}
template <class E>
__device__ __forceinline__ hh_u64 hh_load_chunk(const typename E::T* x, hh_i64 u, hh_i64 limit, bool vec,
                                                float* tile, int lane, bool digest) {
    hh_u64 sum = 0;
    if (vec && (u % E::PER16) == 0 && u + HH_CHUNK <= limit) {  // the whole chunk, 16 bytes at a time
#pragma unroll
        for (int it = 0; it < HH_CHUNK / (32 * E::PER16); ++it) {
            const int e = (it * 32 + lane) * E::PER16;
            float v[E::PER16];
            E::load16(x + u + e, v);
            if (digest) {
                const hh_u32 index = (hh_u32)(u + e) * 0x9E3779B9u + 0x44696773u;  // rng.digest's index term
#pragma unroll
                for (int q = 0; q < E::PER16; ++q) sum += hh_mix32(__float_as_uint(v[q]) + index + q * 0x9E3779B9u);
            }
            hh_put16<E>(tile, e, v);
        }
        return sum;
    }
    for (int it = 0; it < HH_CHUNK / (32 * E::PER16); ++it) {  // the chunk's end, or an unaligned start
        const int e = (it * 32 + lane) * E::PER16;
        float v[E::PER16];
#pragma unroll
        for (int q = 0; q < E::PER16; ++q) {
            v[q] = u + e + q < limit ? E::load(x, u + e + q) : 0.0f;
            if (digest && u + e + q < limit) sum += hh_digest_term(v[q], u + e + q);
        }
        hh_put16<E>(tile, e, v);
    }
    return sum;
}

// A chunk's forward rotation up to phase B: load, D, bits 0-4 (row), transpose, bits 5-9
// (column). Leaves v in the column layout (v[r] = coordinate u + 32 r + lane), unnormalised,
// and the tile free. Blocks of B <= 32 are done after phase A; the transpose still runs, so
// that every caller reads columns.
template <class In>
__device__ __forceinline__ hh_u64 hh_forward_chunk(const typename In::T* x, const hh_u32* signs, hh_i64 u,
                                                   hh_i64 numel, bool vec, int log2B, float* tile, int lane,
                                                   bool digest, float* v) {
    __syncwarp();  // the tile's previous readers are done
    const hh_u64 sum = hh_load_chunk<In>(x, u, numel, vec, tile, lane, digest);
    const hh_u32 mask = hh_row_signs(signs, u, lane, log2B);
    __syncwarp();
    hh_row_read(tile, lane, v);
#pragma unroll
    for (int r = 0; r < 32; ++r) v[r] = hh_flip(v[r], mask, r);
    hh_butterflies(v, 0, log2B < 5 ? log2B : 5);
    hh_row_write(tile, lane, v);
    __syncwarp();
    hh_col_read(tile, lane, v);
    if (log2B > 5) hh_butterflies(v, 0, log2B < 10 ? log2B - 5 : 5);
    return sum;
}

// Phase C of a 4096-coordinate unit (B = 2048, 4096): every warp has its chunk in the column
// layout in v; afterwards v holds hh_c_read's layout. Called by all threads of the CUDA block.
__device__ __forceinline__ void hh_phase_c(float* tiles, int lane, int t, int log2B, float* v) {
    hh_col_write(tiles + (t >> 5) * HH_CHUNK, lane, v);
    __syncthreads();
    hh_c_read(tiles, t, v);
    hh_butterflies(v, 3, 3 + log2B - 10);
    __syncthreads();  // the tiles may be written again
}

// ---- stage 1: rotate, measure, digest -----------------------------------------------------
struct HhPrepareArgs {
    const void* x;
    const hh_u32* signs;
    float* scales;        // header + n_blocks maxima
    float* header;        // a copy of the header (this rank's own, kept from the MAX); may be null
    hh_u64* workspace;    // HH_SLOTS + 1 u64 of zeros per stream: digest slots, [blocks done, flag]
    int vec;
    // -- the same for every call of a shape:
    hh_i64 numel;
    hh_i64 total;         // n_blocks * B
    int log2B;
    float norm;
    float fingerprint;
};

// Write fl(max * norm) for block blk and say whether it is flagged.
__device__ __forceinline__ bool hh_put_max(float* scales, hh_i64 blk, hh_i64 n_blocks, hh_u32 bits, float norm,
                                           int log2B) {
    if (blk >= n_blocks) return false;
    const float m = hh_mul(__uint_as_float(bits), norm);  // max |h| * norm = max |h * norm|: rounding is monotonic
    scales[HH_HEADER + blk] = m;
    return (__float_as_uint(m) & 0x7fffffffu) >= hh_overflow_bits(log2B);
}

// Grid: at most one CUDA block of HH_THREADS per HH_TILE coordinates (at least one), each
// taking every gridDim.x-th tile. Shared memory: HH_TILE floats + 18 words.
template <class In>
__device__ void hh_prepare(const HhPrepareArgs& a) {
    extern __shared__ float hh_smem[];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    float* tile = hh_smem + warp * HH_CHUNK;
    hh_u32* red = (hh_u32*)(hh_smem + HH_TILE);  // [warp][2] maxima of phase C, then [last]
    const typename In::T* x = (const typename In::T*)a.x;
    const int log2B = a.log2B;
    const hh_i64 n_blocks = a.total >> log2B;
    bool flagged = false;
    hh_u64 digest = 0;
    float v[32];
    // Tiles blockIdx.x, + gridDim.x, ...: a grid of the CUDA blocks the GPU holds at once, so
    // that the atomics below are per CUDA block, not per tile.
    for (hh_i64 tile_at = blockIdx.x; tile_at == blockIdx.x || tile_at * HH_TILE < a.total; tile_at += gridDim.x) {
        const hh_i64 u0 = tile_at * HH_TILE, u = u0 + warp * HH_CHUNK;

        if (log2B <= 10) {  // a warp past the end (the last tile) loads zeros and writes nothing
            digest += hh_forward_chunk<In>(x, a.signs, u, a.numel, a.vec != 0, log2B, tile, lane, true, v);
            // A block is 2^bits consecutive values of a thread: of its row (B <= 32: the row
            // layout again, which hh_forward_chunk left in the tile), else of its column, the
            // block's max then over the warp. A tree over those bits, then one value per block.
            if (log2B <= 5) hh_row_read(tile, lane, v);
            const int bits = log2B <= 5 ? log2B : log2B - 5;
#pragma unroll
            for (int r = 0; r < 32; ++r) v[r] = __uint_as_float(__float_as_uint(v[r]) & 0x7fffffffu);
#pragma unroll
            for (int s = 0; s < 5; ++s)
                if (s < bits)
#pragma unroll
                    for (int r = 0; r < 32; r += 2 << s)
                        v[r] = __uint_as_float(hh_umax(__float_as_uint(v[r]), __float_as_uint(v[r + (1 << s)])));
#pragma unroll
            for (int r = 0; r < 32; ++r) {
                if ((r & ((1 << bits) - 1)) == 0) {
                    hh_u32 m = __float_as_uint(v[r]);
                    if (log2B > 5) {
                        for (int off = 16; off > 0; off >>= 1) m = hh_umax(m, __shfl_xor_sync(0xffffffffu, m, off));
                        if (lane == 0) flagged |= hh_put_max(a.scales, (u >> log2B) + (r >> bits), n_blocks, m, a.norm, log2B);
                    } else {
                        flagged |= hh_put_max(a.scales, (u + 32 * lane + r) >> log2B, n_blocks, m, a.norm, log2B);
                    }
                }
            }
        } else {
            digest += hh_forward_chunk<In>(x, a.signs, u, a.numel, a.vec != 0, log2B, tile, lane, true, v);
            hh_phase_c(hh_smem, lane, t, log2B, v);
            // B = 4096: one block; 2048: k < 16 and k >= 16
            hh_u32 m[2] = {0u, 0u};
#pragma unroll
            for (int k = 0; k < 32; ++k) {
                const int half = log2B == 11 ? k >> 4 : 0;
                m[half] = hh_umax(m[half], __float_as_uint(v[k]) & 0x7fffffffu);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                for (int off = 16; off > 0; off >>= 1) m[h] = hh_umax(m[h], __shfl_xor_sync(0xffffffffu, m[h], off));
                if (lane == 0) red[2 * warp + h] = m[h];
            }
            __syncthreads();
            if (t < (log2B == 11 ? 2 : 1)) {
                hh_u32 all = 0;
                for (int w = 0; w < HH_WARPS; ++w) all = hh_umax(all, red[2 * w + t]);
                flagged |= hh_put_max(a.scales, (u0 >> log2B) + t, n_blocks, all, a.norm, log2B);
            }
        }
        __syncthreads();  // red[] and the tiles are free for the next tile
    }

    // The digest: a warp sum, then the CUDA block's, one atomic into its slot (integer: order
    // independent; slots spread the atomics over addresses).
    hh_u64* sums = (hh_u64*)(red + 10);
    for (int off = 16; off > 0; off >>= 1) digest += __shfl_xor_sync(0xffffffffu, digest, off);
    if (lane == 0) sums[warp] = digest;
    __syncthreads();
    if (t == 0) {
        hh_u64 all = 0;
        for (int w = 0; w < HH_WARPS; ++w) all += sums[w];
        if (all) atomicAdd(&a.workspace[blockIdx.x % HH_SLOTS], all);
    }
    hh_u32* counters = (hh_u32*)&a.workspace[HH_SLOTS];  // [blocks done, flag]
    if (flagged) atomicOr(&counters[1], 1u);

    // Last block done: header, zeroed maxima if flagged, workspace back to zero. Thread 0
    // reads and resets the workspace; red[8] tells the others (0: not last, 1: last,
    // 2: last and some block was non-finite).
    __threadfence();
    __syncthreads();
    if (t == 0) {
        red[8] = 0u;
        if (atomicAdd(&counters[0], 1u) == gridDim.x - 1) {
            __threadfence();
            const bool nonfinite = atomicOr(&counters[1], 0u) != 0u;
            hh_u64 d = 0;
            for (int i = 0; i < HH_SLOTS; ++i) d += atomicAdd(&a.workspace[i], 0ull);
            d &= 0xFFFFFFFFFFFFull;
            const float lo = (float)(hh_u32)(d & 0xFFFFFFu), hi = (float)(hh_u32)(d >> 24);
            const float head[HH_HEADER] = {nonfinite ? 1.0f : 0.0f, a.fingerprint, hh_neg(a.fingerprint), lo, hh_neg(lo), hi,
                                           hh_neg(hi)};
            for (int i = 0; i < HH_HEADER; ++i) {
                a.scales[i] = head[i];
                if (a.header) a.header[i] = head[i];
            }
            for (int i = 0; i <= HH_SLOTS; ++i) a.workspace[i] = 0ull;
            red[8] = nonfinite ? 2u : 1u;
        }
    }
    __syncthreads();
    if (red[8] == 2u)
        for (hh_i64 b = t; b < n_blocks; b += HH_THREADS) a.scales[HH_HEADER + b] = 0.0f;
}

// ---- stage 3: rotation again, stochastic rounding straight into lane words ----------------
struct HhQuantizeArgs {
    const void* x;
    const hh_u32* signs;
    const float* agreed;      // header + n_blocks scales
    void* words;              // n_words words (W)
    const float* residual;    // may be null (no error feedback); may equal residual_out
    float* residual_out;
    void* prefix;             // the message prefix to write (HH_PREFIX words), or null
    const float* header;      // this rank's own header, for the prefix
    hh_u32 key;               // rng.Stream: key, shared, row, offset, strata_bits
    hh_u32 shared;
    hh_u32 row;
    hh_u32 offset;
    int strata_bits;
    int vec;
    int fp0;                  // the prefix's fingerprints (message.fingerprints)
    int fp1;
    // -- the same for every call of a shape:
    hh_i64 numel;
    hh_i64 total;
    hh_i64 n_words;
    int log2B;
    int levels;
    int width;
    int lanes;
    float norm;
};

// The message prefix (hhook/codec/layout.py: write_prefix): count 1, status (1 if this
// rank's header says non-finite), the fingerprints, and the four 12-bit chunks of the 48-bit
// digest in the header, each followed by its square.
template <class W>
__device__ __forceinline__ void hh_write_prefix(W* prefix, const float* header, int fp0, int fp1) {
    prefix[0] = 1;
    prefix[1] = hh_nonfinite(header) ? 1 : 0;
    prefix[2] = (W)fp0;
    prefix[3] = (W)fp1;
    const hh_u32 halves[2] = {hh_to_u32(header[3]), hh_to_u32(header[5])};
    for (int i = 0; i < 4; ++i) {
        const W c = (W)((i & 1) ? halves[i >> 1] >> 12 : halves[i >> 1] & 0xFFFu);
        prefix[4 + 2 * i] = c;
        prefix[5 + 2 * i] = c * c;
    }
}

// A block's rounding constants (quantization.inverse_steps / steps): one division each per
// block. inv is 0 where it is not finite (M == 0, or M so small that (L - 1) / 2M overflows),
// which makes every code of the block 0.
struct HhBlock {
    float m, inv, step;
};
__device__ __forceinline__ HhBlock hh_block(const float* agreed, hh_i64 n_blocks, hh_i64 blk, float top) {
    HhBlock c;
    c.m = blk < n_blocks ? agreed[HH_HEADER + blk] : 0.0f;
    const float twice = hh_mul(c.m, 2.0f);
    const float i = hh_div(top, twice);
    c.inv = hh_finite_bits(__float_as_uint(i) & 0x7fffffffu) ? i : 0.0f;
    c.step = hh_div(twice, top);
    return c;
}
__device__ __forceinline__ HhBlock hh_shfl_block(HhBlock c, int src) {
    c.m = __shfl_sync(0xffffffffu, c.m, src);
    c.inv = __shfl_sync(0xffffffffu, c.inv, src);
    c.step = __shfl_sync(0xffffffffu, c.step, src);
    return c;
}

// Where a chunk's codes go: coordinates u + off for off in [lo, hi) are this CUDA block's, in
// lane `shift`, at words_s[off - lo].
template <class W>
struct HhTarget {
    W* words_s;
    const float* residual;  // at u; null without error feedback
    float* residual_out;    // at u
    hh_u32 index;           // (u + key) mod 2^32: the rounding stream's counter base
    hh_u32 within;          // u mod B
    hh_i64 block;           // u / B
    int lo, hi, shift;
};

// The rounding of coordinate u + off (quantization.quantize_into's float operations in
// order) into its lane of its word in shared memory; h is the rotated value before 1/sqrt(B).
template <class W>
__device__ __forceinline__ void hh_round(const HhQuantizeArgs& a, const hh_u16* table, const HhTarget<W>& d, int off,
                                         float h, const HhBlock& c) {
    const int L = a.strata_bits;
    float y = hh_mul(h, a.norm);
    if (d.residual) y = hh_add(y, d.residual[off]);
    // rng.thresholds: U = p << (24 - L) | mix32(index + key) >> (8 + L), times 2^-24 (exact)
    hh_u32 U = hh_mix32(d.index + off) >> (8 + L);
    if (L) {
        const hh_u32 b = (hh_u32)(d.block + ((d.within + off) >> a.log2B));
        const hh_u32 p = (hh_u32)table[(d.within + off) & ((1u << a.log2B) - 1)] + (hh_mix32(b + a.row) >> (32 - L)) + a.offset;
        U |= (p & ((1u << L) - 1u)) << (24 - L);
    }
    const float t = hh_add(hh_mul(hh_add(y, c.m), c.inv), hh_mul((float)U, 5.9604644775390625e-8f));
    // c = min(max(floor(t), 0), L - 1), NaN to 0, from t's bits: for 1 <= t < L - 1 (exponent
    // field e in [127, 134]) the integer part is the significand shifted right by 150 - e;
    // below 1, negative or NaN the shift (capped at 31) leaves 0.
    const hh_u32 bits = __float_as_uint(t);
    const hh_u32 drop = 150u - (bits >> 23);
    const hh_u32 code = hh_le((float)(a.levels - 1), t) ? (hh_u32)(a.levels - 1)
                                                   : ((bits & 0x7fffffu) | 0x800000u) >> (drop < 31u ? drop : 31u);
    atomicOr(&d.words_s[off - d.lo], ((W)code) << d.shift);
    if (d.residual) d.residual_out[off] = hh_sub(y, hh_sub(hh_mul(hh_small_to_float(code), c.step), c.m));
}

// Grid: one CUDA block per HH_WORD_BYTES of words (S words, W's size). A CUDA block owns words
// [w0, w0 + S): for each lane j the coordinates j n_words + [w0, w0 + S), rotated in whole
// blocks (chunks of 1024 from the block that holds the first; units of 4096 for B > 1024).
// Shared memory: HH_WORD_BYTES + HH_TILE floats + B u16 (the correlated strata table).
template <class In, class W>
__device__ void hh_quantize(const HhQuantizeArgs& a) {
    extern __shared__ float hh_smem[];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int S = HH_WORD_BYTES / (int)sizeof(W);
    W* words_s = (W*)hh_smem;
    float* tiles = hh_smem + HH_WORD_BYTES / 4;
    hh_u16* table = (hh_u16*)(tiles + HH_TILE);
    const typename In::T* x = (const typename In::T*)a.x;
    W* words = (W*)a.words;
    const int log2B = a.log2B, L = a.strata_bits;
    const hh_i64 w0 = (hh_i64)blockIdx.x * S;
    const int span = (int)(a.n_words - w0 < S ? a.n_words - w0 : S);

    if (a.prefix && blockIdx.x == 0 && t == 0) hh_write_prefix<W>((W*)a.prefix, a.header, a.fp0, a.fp1);
    if (hh_nonfinite(a.agreed) || hh_identical(a.agreed)) {
        // Nothing to send: zero words (decode ignores them); the residual stays as it was.
        for (int i = t; i < span; i += HH_THREADS) words[w0 + i] = 0;
        if (a.residual && a.residual != a.residual_out)
            for (int j = 0; j < a.lanes; ++j)
                for (int i = t; i < span; i += HH_THREADS) {
                    const hh_i64 g = (hh_i64)j * a.n_words + w0 + i;
                    if (g < a.total) a.residual_out[g] = a.residual[g];
                }
        return;
    }
    for (int i = t; i < span; i += HH_THREADS) words_s[i] = 0;
    if (L)  // rng.Stream.table: mix32(i + shared) >> (32 - L), one per position in a block
        for (int i = t; i < (1 << log2B); i += HH_THREADS) table[i] = (hh_u16)(hh_mix32((hh_u32)i + a.shared) >> (32 - L));
    __syncthreads();

    const float top = (float)(a.levels - 1);
    const hh_i64 n_blocks = a.total >> log2B;
    float v[32];
    int item = 0;
    for (int j = 0; j < a.lanes; ++j) {
        const hh_i64 lo = (hh_i64)j * a.n_words + w0;
        const hh_i64 hi = lo + span < a.total ? lo + span : a.total;
        if (lo >= hi) break;  // this and later lanes are padding: code 0
        const hh_i64 first = (lo >> log2B) << log2B;
        const int step = log2B <= 10 ? HH_CHUNK : HH_TILE;
        for (hh_i64 u = first; u < hi; u += step, ++item) {
            if (log2B <= 10 && item % HH_WARPS != warp) continue;  // a warp's chunk; B > 1024: all warps
            const hh_i64 w = log2B <= 10 ? u : u + warp * HH_CHUNK;
            hh_forward_chunk<In>(x, a.signs, w, a.numel, a.vec != 0, log2B, tiles + warp * HH_CHUNK, lane, false, v);
            HhTarget<W> d;
            d.words_s = words_s;
            d.residual = a.residual ? a.residual + u : 0;
            d.residual_out = a.residual_out + u;
            d.index = (hh_u32)u + a.key;
            d.within = (hh_u32)(u & ((1ll << log2B) - 1));
            d.block = u >> log2B;
            d.lo = (int)(lo - u);  // in (-S, B)
            d.hi = (int)(hi - u);
            d.shift = j * a.width;
            if (log2B > 10) {
                // phase C through the tiles, then the unit's coordinates t + 128 i from them (a
                // rolled loop: B > 1024 is rare, and one unrolled rounding per path is compile time)
                hh_col_write(tiles + warp * HH_CHUNK, lane, v);
                __syncthreads();
                hh_c_read(tiles, t, v);
                hh_butterflies(v, 3, 3 + log2B - 10);
                __syncthreads();
#pragma unroll
                for (int k = 0; k < 32; ++k)
                    tiles[(k >> 3) * HH_CHUNK + hh_sw(((k & 7) << 2) | (t >> 5), t & 31)] = v[k];
                __syncthreads();
                for (int k = 0; k < 32; ++k) {
                    const int off = hh_c_coordinate(k, t);
                    if (off >= d.lo && off < d.hi)
                        hh_round<W>(a, table, d, off, tiles[(k >> 3) * HH_CHUNK + hh_sw(((k & 7) << 2) | (t >> 5), t & 31)],
                                    hh_block(a.agreed, n_blocks, d.block + (off >> log2B), top));
                }
                __syncthreads();  // the tiles are free again
            } else if (log2B >= 5) {
                // the chunk's 1024 / B <= 32 blocks: lane i holds block i's constants
                const int blocks = log2B >= 10 ? 1 : 1 << (10 - log2B);
                const HhBlock mine = hh_block(a.agreed, n_blocks, d.block + (lane & (blocks - 1)), top);
#pragma unroll
                for (int r = 0; r < 32; ++r) {
                    const int off = 32 * r + lane;
                    const HhBlock c = log2B >= 10 ? mine : hh_shfl_block(mine, r >> (log2B - 5));
                    if (off >= d.lo && off < d.hi) hh_round<W>(a, table, d, off, v[r], c);
                }
            } else {
                // B < 32: more blocks than lanes; the column through the tile, a block at a time
                float* tile = tiles + warp * HH_CHUNK;
                hh_col_write(tile, lane, v);
                hh_i64 cur = -1;
                HhBlock c = {0.0f, 0.0f, 0.0f};
                for (int r = 0; r < 32; ++r) {
                    const int off = 32 * r + lane;
                    const hh_i64 b = d.block + (off >> log2B);
                    if (b != cur) cur = b, c = hh_block(a.agreed, n_blocks, b, top);
                    if (off >= d.lo && off < d.hi) hh_round<W>(a, table, d, off, tile[hh_sw(r, lane)], c);
                }
            }
        }
    }
    __syncthreads();
    for (int i = t; i < span; i += HH_THREADS) words[w0 + i] = words_s[i];
}

// ---- stage 5: unpack, dequantize, inverse rotation, crop ----------------------------------
struct HhDecodeArgs {
    const void* words;        // the summed words (W)
    const hh_u32* signs;
    const float* agreed;
    void* out;
    const void* source;       // read when every rank's input was identical
    const void* prefix;       // the summed message prefix to check (W), or null
    int* flags;               // [bad, non-finite] of that prefix, written here; may be null
    // -- the same for every call of a shape:
    int source_dtype;         // its dtype: 0 float32, 1 float16, 2 bfloat16
    hh_i64 numel;
    hh_i64 total;
    hh_i64 n_words;
    hh_i64 expect_count;      // what the summed prefix must hold (layout.prefix_verdict)
    hh_i64 expect_fp0;
    hh_i64 expect_fp1;
    int log2B;
    int levels;
    int world;
    int width;
    int lanes;
    float norm;
};

// The lane sums of coordinates u + 32 r + lane, dequantized (S * ((M * 2 / (L - 1)) / n) - M,
// in fp32 as quantization.dequantize; zeros past total) into the tile's columns.
template <class W>
__device__ __forceinline__ void hh_dequantize_chunk(const HhDecodeArgs& a, const W* words, hh_i64 u, int lane,
                                                    float* tile) {
    const W mask = (W)((((hh_u64)1) << a.width) - 1u);
    const float top = (float)(a.levels - 1);
    const int log2B = a.log2B;
    // lane j of coordinate g (g / n_words) at u: the lanes whose first coordinate is at most u;
    // then advance as g grows
    hh_i64 j = __popc(__ballot_sync(0xffffffffu, lane > 0 && lane < a.lanes && lane * a.n_words <= u));
    const W* row = words + (u - j * a.n_words);  // the words of lane j, at u
    hh_i64 left = (j + 1) * a.n_words - u;       // coordinates of lane j from u on
    const int valid = (int)(a.total - u < HH_CHUNK ? a.total - u : HH_CHUNK);
    hh_i64 cur = -1;
    float scale = 0.0f, m = 0.0f;
    for (int r = 0; r < 32; ++r) {
        const int off = 32 * r + lane;
        float value = 0.0f;
        if (off < valid) {
            while (off >= left) ++j, row -= a.n_words, left += a.n_words;
            const hh_u32 sum = (hh_u32)((row[off] >> (j * a.width)) & mask);
            const hh_i64 b = (u + off) >> log2B;
            if (b != cur) {
                cur = b;
                m = a.agreed[HH_HEADER + b];
                scale = hh_div(hh_div(hh_mul(m, 2.0f), top), (float)a.world);
            }
            value = hh_sub(hh_mul((float)sum, scale), m);
        }
        tile[hh_sw(r, lane)] = value;
    }
}

// Grid and tile as hh_prepare. Shared memory: HH_TILE floats.
// An element of the source, whose dtype is an argument (it is read only on the rare identical path).
__device__ __forceinline__ float hh_load_any(const void* p, int dtype, hh_i64 i) {
    if (dtype == 0) return HhF32::load((const float*)p, i);
    if (dtype == 1) return HhF16::load((const unsigned short*)p, i);
    return HhBF16::load((const unsigned short*)p, i);
}

template <class W, class Out>
__device__ void hh_decode(const HhDecodeArgs& a) {
    extern __shared__ float hh_smem[];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    float* tile = hh_smem + warp * HH_CHUNK;
    const W* words = (const W*)a.words;
    typename Out::T* out = (typename Out::T*)a.out;
    const int log2B = a.log2B;
    const hh_i64 u0 = (hh_i64)blockIdx.x * HH_TILE, u = u0 + warp * HH_CHUNK;

    bool bad = false;
    if (a.prefix) {  // layout.prefix_verdict, on the words as signed integers
        const W* p = (const W*)a.prefix;
        hh_i64 q[4];
        for (int i = 0; i < 4; ++i) q[i] = sizeof(W) == 4 ? (hh_i64)(int)(hh_u32)p[i] : (hh_i64)p[i];
        bad = q[0] != a.expect_count || q[1] >= HH_RANK_FAILED || q[2] != a.expect_fp0 || q[3] != a.expect_fp1;
        if (a.flags && blockIdx.x == 0 && t == 0) {
            a.flags[0] = bad ? 1 : 0;
            a.flags[1] = q[1] % HH_RANK_FAILED > 0 ? 1 : 0;  // layout.any_nonfinite
        }
    }
    if (bad || hh_nonfinite(a.agreed) || hh_mismatch(a.agreed) || hh_identical(a.agreed)) {
        const bool nan = bad || hh_nonfinite(a.agreed) || hh_mismatch(a.agreed);
        for (hh_i64 g = u0 + t; g < u0 + HH_TILE && g < a.numel; g += HH_THREADS)
            Out::store(out, g, nan ? __uint_as_float(0x7fc00000u) : hh_load_any(a.source, a.source_dtype, g));
        return;
    }

    float v[32];
    if (log2B <= 10) {
        const hh_u32 mask = hh_col_signs(a.signs, lane, log2B);  // a warp past the end writes nothing
        hh_dequantize_chunk<W>(a, words, u, lane, tile);
        __syncwarp();
        hh_row_read(tile, lane, v);
        hh_butterflies(v, 0, log2B < 5 ? log2B : 5);
        hh_row_write(tile, lane, v);
        __syncwarp();
        hh_col_read(tile, lane, v);
        if (log2B > 5) hh_butterflies(v, 0, log2B < 10 ? log2B - 5 : 5);
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            const hh_i64 g = u + 32 * r + lane;
            if (g < a.numel) Out::store(out, g, hh_flip(hh_mul(v[r], a.norm), mask, r));
        }
    } else {
        const hh_u32 mask = hh_c_signs(a.signs, t, log2B);
        hh_dequantize_chunk<W>(a, words, u, lane, tile);
        __syncwarp();
        hh_row_read(tile, lane, v);
        hh_butterflies(v, 0, 5);
        hh_row_write(tile, lane, v);
        __syncwarp();
        hh_col_read(tile, lane, v);
        hh_butterflies(v, 0, 5);
        hh_phase_c(hh_smem, lane, t, log2B, v);
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const hh_i64 g = u0 + hh_c_coordinate(k, t);
            if (g < a.numel) Out::store(out, g, hh_flip(hh_mul(v[k], a.norm), mask, k));
        }
    }
}

// ---- FSDP2's all-gather codec: hhook/codec/weights.py -------------------------------------
// Blocks of B (8..1024) float32 values; per block a float32 scale M (its max |y|, the sign bit
// set where the block is rotated) and round-to-nearest codes c = trunc(clamp(y q / M + q + 1/2,
// 0, 2q + 1/2)) packed by weights.pack. The packing as lanes: k planes of P = N / k codes
// (k = 8 / bits for 2 and 4 bits, 4 for 6, else 1), position j of every plane in one word
// (lane i at bit width * i, width 6 for 6 bits) written as weights.pack lays it out.
struct HhWeightArgs {
    const float* blocks;      // encode: the n_blocks x B values
    float* out;               // decode: the n_blocks x B values
    void* payload;            // 4 n_blocks bytes of scales, then the codes
    const hh_u32* signs;
    int* nonfinite;           // encode: set where a scale is not finite (zeroed by the caller)
    int vec;                  // blocks is 16-byte aligned
    // -- the same for every call of a shape:
    hh_i64 n_blocks;
    hh_i64 plane;             // P
    int planes;               // k
    int log2B;
    int bits;
    int rotate;               // 0 never, 1 always, 2 "auto"
    float norm;
};

// The lane width of a code in a plane word, and a code's bits.
__device__ __forceinline__ int hh_wq_width(int bits) { return bits == 6 ? 6 : bits; }

// trunc(t) of 0 <= t < 2^23 from its bits (0 below 1); NaN gives 0.
__device__ __forceinline__ hh_u32 hh_trunc_small(float t) {
    const hh_u32 bits = __float_as_uint(t);
    const hh_u32 drop = 150u - (bits >> 23);
    return ((bits & 0x7fffffu) | 0x800000u) >> (drop < 31u ? drop : 31u);
}

// Per block of a chunk (at most 128: B >= 8): what encode decided, in the warp's arrays at
// constant offsets from one base.
struct HhWeightBlocks {
    float* base;
    __device__ __forceinline__ hh_u32& plain(int b) const { return ((hh_u32*)base)[b]; }  // max |x| bits
    __device__ __forceinline__ float& rms2(int b) const { return base[128 + b]; }  // 2 rms, then q / M
    __device__ __forceinline__ hh_u32& turned(int b) const { return ((hh_u32*)base)[256 + b]; }  // max |rotated|
    __device__ __forceinline__ float& scale(int b) const { return base[384 + b]; }  // the signed scale
};

// Max |v| bits and the sum of squares (weights._rms) of each block in the row layout (v[r] =
// coordinate 32 lane + r of the chunk): a tree over adjacent pairs in the thread, then lanes
// 2l and 2l + 1, and so on; the block's first lane writes the warp's arrays.
__device__ __forceinline__ void hh_wq_row_stats(const float* v, int lane, int log2B, float norm, HhWeightBlocks w) {
    const int levels = log2B < 5 ? log2B : 5;
    float s[32];
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {  // 0: max |v|, 1: the sum of squares
#pragma unroll
        for (int r = 0; r < 32; ++r)
            s[r] = pass ? hh_mul(v[r], v[r]) : __uint_as_float(__float_as_uint(v[r]) & 0x7fffffffu);
#pragma unroll
        for (int h = 0; h < 5; ++h)
            if (h < levels)
#pragma unroll
                for (int r = 0; r < 32; r += 2 << h)
                    s[r] = pass ? hh_add(s[r], s[r + (1 << h)])
                                : __uint_as_float(hh_umax(__float_as_uint(s[r]), __float_as_uint(s[r + (1 << h)])));
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            if ((r & ((1 << levels) - 1)) == 0) {
                float x = s[r];
                for (int off = 1; off < (1 << log2B) >> 5; off <<= 1) {  // B > 32: lanes 2l and 2l + 1, ...
                    const float y = __shfl_xor_sync(0xffffffffu, x, off);
                    x = pass ? hh_add(x, y) : __uint_as_float(hh_umax(__float_as_uint(x), __float_as_uint(y)));
                }
                const int b = (32 * lane + r) >> log2B;
                if (((32 * lane + r) & ((1 << log2B) - 1)) == 0) {
                    if (pass) {
                        float root;
#ifndef HHOOK_HOST_EMULATION
                        asm("sqrt.rn.f32 %0, %1;" : "=f"(root) : "f"(x));
#else
                        root = std::sqrt(x);
#endif
                        w.rms2(b) = hh_mul(hh_mul(root, norm), 2.0f);
                    } else {
                        w.plain(b) = __float_as_uint(x);
                    }
                }
            }
        }
    }
}

// Max |v| bits of each block in the column layout (B >= 32), into turned[].
__device__ __forceinline__ void hh_col_maxima(const float* v, int lane, int log2B, hh_u32* turned) {
    const int per = log2B - 5 < 5 ? log2B - 5 : 5;
    hh_u32 m[32];
#pragma unroll
    for (int r = 0; r < 32; ++r) m[r] = __float_as_uint(v[r]) & 0x7fffffffu;
#pragma unroll
    for (int h = 0; h < 5; ++h)
        if (h < per)
#pragma unroll
            for (int r = 0; r < 32; r += 2 << h) m[r] = hh_umax(m[r], m[r + (1 << h)]);
#pragma unroll
    for (int r = 0; r < 32; ++r) {
        if ((r & ((1 << per) - 1)) == 0) {
            for (int off = 16; off > 0; off >>= 1) m[r] = hh_umax(m[r], __shfl_xor_sync(0xffffffffu, m[r], off));
            if (lane == 0) turned[r >> per] = m[r];
        }
    }
}

// Encode. Grid: one CUDA block per HH_WQ_SPAN plane positions. Shared memory: HH_WQ_SPAN words,
// two tiles per warp (the values as loaded, and the rotation's), 128 blocks' state per warp.
#define HH_WQ_SPAN 2048
__device__ void hh_wq_encode(const HhWeightArgs& a) {
    extern __shared__ float hh_smem[];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    hh_u32* words_s = (hh_u32*)hh_smem;
    float* plain_tile = hh_smem + HH_WQ_SPAN + warp * HH_CHUNK;
    float* turn_tile = hh_smem + HH_WQ_SPAN + HH_TILE + warp * HH_CHUNK;
    float* state = hh_smem + HH_WQ_SPAN + 2 * HH_TILE + warp * 4 * 128;
    const HhWeightBlocks w = {state};
    const int log2B = a.log2B, B = 1 << log2B, width = hh_wq_width(a.bits);
    const float q = (float)((1 << (a.bits - 1)) - 1);
    const hh_i64 N = a.n_blocks << log2B, j0 = (hh_i64)blockIdx.x * HH_WQ_SPAN;
    const int span = (int)(a.plane - j0 < HH_WQ_SPAN ? a.plane - j0 : HH_WQ_SPAN);
    float* scales = (float*)a.payload;
    unsigned char* codes = (unsigned char*)a.payload + 4 * a.n_blocks;

    for (int i = t; i < span; i += HH_THREADS) words_s[i] = 0;
    __syncthreads();
    float v[32];
    int item = 0;
    for (int i = 0; i < a.planes; ++i) {
        const hh_i64 lo = i * a.plane + j0, hi = lo + span;
        for (hh_i64 u = (lo >> log2B) << log2B; u < hi; u += HH_CHUNK, ++item) {
            if (item % HH_WARPS != warp) continue;
            __syncwarp();  // the tiles' and arrays' previous readers are done
            hh_load_chunk<HhF32>(a.blocks, u, N, a.vec != 0, plain_tile, lane, false);
            __syncwarp();
            hh_row_read(plain_tile, lane, v);
            hh_wq_row_stats(v, lane, log2B, a.norm, w);
            __syncwarp();  // each block's stats were written by its first lane: read by lane b below
            // which blocks of the chunk are tried rotated
            const int nb = HH_CHUNK >> log2B;
            bool any = false;
            for (int b = lane; b < nb; b += 32)
                any |= a.rotate == 1 || (a.rotate == 2 && hh_lt(w.rms2(b), __uint_as_float(w.plain(b))));
            __syncwarp();
            any = __ballot_sync(0xffffffffu, any) != 0;
            if (any) {
                const hh_u32 mask = hh_row_signs(a.signs, u, lane, log2B);
#pragma unroll
                for (int r = 0; r < 32; ++r) v[r] = hh_flip(v[r], mask, r);
                hh_butterflies(v, 0, log2B < 5 ? log2B : 5);
                if (log2B < 5) {  // done: whole blocks in the row
#pragma unroll
                    for (int r = 0; r < 32; ++r) v[r] = hh_mul(v[r], a.norm);
                    for (int b = 0; b < 32 >> log2B; ++b) {
                        hh_u32 m = 0;
#pragma unroll
                        for (int r = 0; r < 32; ++r)
                            if ((r >> log2B) == b) m = hh_umax(m, __float_as_uint(v[r]) & 0x7fffffffu);
                        w.turned(lane * (32 >> log2B) + b) = m;
                    }
                }
                hh_row_write(turn_tile, lane, v);
                __syncwarp();
                hh_col_read(turn_tile, lane, v);
                if (log2B >= 5) {
                    if (log2B > 5) hh_butterflies(v, 0, log2B - 5);
#pragma unroll
                    for (int r = 0; r < 32; ++r) v[r] = hh_mul(v[r], a.norm);
                    hh_col_maxima(v, lane, log2B, &w.turned(0));
                }
            }
            __syncwarp();
            // the choice (weights._choose), the scales of the blocks whose first value is ours,
            // and q / M (0 where not finite), in rms2's place
            for (int b = lane; b < nb; b += 32) {
                const float plain = __uint_as_float(w.plain(b));
                const bool turn = a.rotate == 1 || (a.rotate == 2 && hh_lt(w.rms2(b), plain) && any
                                                    && hh_lt(__uint_as_float(w.turned(b)), plain));
                const float scale = turn ? __uint_as_float(w.turned(b) | 0x80000000u) : plain;
                w.scale(b) = scale;
                const float inv = hh_div(q, __uint_as_float(__float_as_uint(scale) & 0x7fffffffu));
                w.rms2(b) = hh_finite_bits(__float_as_uint(inv) & 0x7fffffffu) ? inv : 0.0f;
                const hh_i64 first = u + ((hh_i64)b << log2B), blk = first >> log2B;
                if (first >= lo && first < hi && blk < a.n_blocks) {
                    scales[blk] = scale;
                    if (!hh_finite_bits(__float_as_uint(scale) & 0x7fffffffu)) atomicOr((hh_u32*)a.nonfinite, 1u);
                }
            }
            __syncwarp();
            const int from = (int)(lo - u), to = (int)(hi - u);  // ours: offsets [from, to) of the chunk
            const float half = hh_add(q, 0.5f), top = hh_add(hh_mul(q, 2.0f), 0.5f);
#pragma unroll
            for (int r = 0; r < 32; ++r) {
                const int off = 32 * r + lane;
                if (off >= from && off < to) {
                    const int b = off >> log2B;
                    const float y = __float_as_uint(w.scale(b)) >> 31 ? v[r] : plain_tile[hh_sw(r, lane)];
                    float tq = hh_add(hh_mul(y, w.rms2(b)), half);
                    tq = hh_le(0.0f, tq) ? (hh_le(tq, top) ? tq : top) : 0.0f;
                    const hh_u32 code = hh_trunc_small(tq);
                    if (a.planes > 1) atomicOr(&words_s[off - from], code << (width * i));
                    else words_s[off - from] = code;
                }
            }
        }
    }
    __syncthreads();
    // weights.pack's layouts
    if (a.bits == 8 || a.bits == 4 || a.bits == 2) {
        for (int i = t; i < span; i += HH_THREADS) codes[j0 + i] = (unsigned char)words_s[i];
    } else if (a.bits == 6) {
        for (int i = t; i < span; i += HH_THREADS)
            for (int k = 0; k < 3; ++k) codes[k * a.plane + j0 + i] = (unsigned char)(words_s[i] >> (8 * k));
    } else {  // 8 codes in `bits` bytes, little-endian; j0 and span are multiples of 8
        for (int g = t; g < span / 8; g += HH_THREADS) {
            hh_u64 word = 0;
            for (int k = 0; k < 8; ++k) word |= (hh_u64)words_s[8 * g + k] << (a.bits * k);
            for (int k = 0; k < a.bits; ++k) codes[(j0 / 8 + g) * a.bits + k] = (unsigned char)(word >> (8 * k));
        }
    }
    (void)B;
}

// The code of value c (weights.unpack's layouts).
__device__ __forceinline__ hh_u32 hh_wq_code(const HhWeightArgs& a, const unsigned char* codes, hh_i64 c) {
    const hh_u32 mask = (1u << a.bits) - 1u;
    if (a.bits == 8) return codes[c];
    if (a.bits == 4 || a.bits == 2) {
        const hh_i64 i = c / a.plane;
        return (codes[c - i * a.plane] >> (a.bits * i)) & mask;
    }
    if (a.bits == 6) {
        const hh_i64 i = c / a.plane, j = c - i * a.plane;
        const hh_u32 word = codes[j] | (hh_u32)codes[a.plane + j] << 8 | (hh_u32)codes[2 * a.plane + j] << 16;
        return (word >> (6 * i)) & mask;
    }
    const hh_i64 bit = (c >> 3) * 8 * a.bits + (c & 7) * a.bits;  // in the little-endian stream of 8-code groups
    const hh_u32 two = codes[bit >> 3] | (hh_u32)codes[(bit >> 3) + 1] << 8;
    return (two >> (bit & 7)) & mask;
}

// Decode. Grid and tile as hh_decode. Shared memory: two tiles per warp.
__device__ void hh_wq_decode(const HhWeightArgs& a) {
    extern __shared__ float hh_smem[];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    float* plain_tile = hh_smem + warp * HH_CHUNK;
    float* turn_tile = hh_smem + HH_TILE + warp * HH_CHUNK;
    const int log2B = a.log2B;
    const float q = (float)((1 << (a.bits - 1)) - 1);
    const hh_i64 N = a.n_blocks << log2B, u = (hh_i64)blockIdx.x * HH_TILE + warp * HH_CHUNK;
    const float* scales = (const float*)a.payload;
    const unsigned char* codes = (const unsigned char*)a.payload + 4 * a.n_blocks;
    // y = (c - q) * (|M| / q) into the column layout, and whether any block is rotated
    bool any = false;
    hh_i64 cur = -1;
    float factor = 0.0f;
    for (int r = 0; r < 32; ++r) {
        const hh_i64 c = u + 32 * r + lane;
        float y = 0.0f;
        if (c < N) {
            const hh_i64 b = c >> log2B;
            if (b != cur) {
                cur = b;
                const float s = scales[b];
                any |= a.rotate == 1 || (a.rotate == 2 && (__float_as_uint(s) >> 31));
                factor = hh_div(__uint_as_float(__float_as_uint(s) & 0x7fffffffu), q);
            }
            y = hh_mul(hh_sub(hh_small_to_float(hh_wq_code(a, codes, c)), q), factor);
        }
        plain_tile[hh_sw(r, lane)] = y;
    }
    any = __ballot_sync(0xffffffffu, any) != 0;
    __syncwarp();
    float v[32];
    hh_u32 mask = 0;
    if (any) {
        mask = hh_col_signs(a.signs, lane, log2B);
        hh_row_read(plain_tile, lane, v);
        hh_butterflies(v, 0, log2B < 5 ? log2B : 5);
        hh_row_write(turn_tile, lane, v);
        __syncwarp();
        hh_col_read(turn_tile, lane, v);
        if (log2B > 5) hh_butterflies(v, 0, log2B - 5);
    }
#pragma unroll
    for (int r = 0; r < 32; ++r) {
        const hh_i64 c = u + 32 * r + lane;
        if (c < N) {
            const bool turn = a.rotate == 1 || (a.rotate == 2 && (__float_as_uint(scales[c >> log2B]) >> 31));
            a.out[c] = turn ? hh_flip(hh_mul(v[r], a.norm), mask, r) : plain_tile[hh_sw(r, lane)];
        }
    }
}

// ---- entry points (names used by hhook/codec/kernels/cuda.py) -----------------------------
#define HH_ENTRY(NAME, ARGS, BODY) \
    extern "C" __global__ void __launch_bounds__(HH_THREADS, HH_MIN_BLOCKS) NAME(const ARGS a) { BODY(a); }

HH_ENTRY(hh_prepare_f32, HhPrepareArgs, hh_prepare<HhF32>)
HH_ENTRY(hh_prepare_f16, HhPrepareArgs, hh_prepare<HhF16>)
HH_ENTRY(hh_prepare_bf16, HhPrepareArgs, hh_prepare<HhBF16>)

#define HH_QUANTIZE(NAME, IN, W) HH_ENTRY(NAME, HhQuantizeArgs, (hh_quantize<IN, W>))
HH_QUANTIZE(hh_quantize_f32_i32, HhF32, hh_u32)
HH_QUANTIZE(hh_quantize_f32_i64, HhF32, hh_u64)
HH_QUANTIZE(hh_quantize_f16_i32, HhF16, hh_u32)
HH_QUANTIZE(hh_quantize_f16_i64, HhF16, hh_u64)
HH_QUANTIZE(hh_quantize_bf16_i32, HhBF16, hh_u32)
HH_QUANTIZE(hh_quantize_bf16_i64, HhBF16, hh_u64)

#define HH_DECODE(NAME, W, OUT) HH_ENTRY(NAME, HhDecodeArgs, (hh_decode<W, OUT>))
HH_DECODE(hh_decode_i32_f32, hh_u32, HhF32)
HH_DECODE(hh_decode_i32_f16, hh_u32, HhF16)
HH_DECODE(hh_decode_i32_bf16, hh_u32, HhBF16)
HH_DECODE(hh_decode_i64_f32, hh_u64, HhF32)
HH_DECODE(hh_decode_i64_f16, hh_u64, HhF16)
HH_DECODE(hh_decode_i64_bf16, hh_u64, HhBF16)

extern "C" __global__ void __launch_bounds__(HH_THREADS, 3) hh_wq_encode_f32(const HhWeightArgs a) {
    hh_wq_encode(a);
}
extern "C" __global__ void __launch_bounds__(HH_THREADS, HH_MIN_BLOCKS) hh_wq_decode_f32(const HhWeightArgs a) {
    hh_wq_decode(a);
}
