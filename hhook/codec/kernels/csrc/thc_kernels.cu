// Fused CUDA kernels for the hhook THC codec (hhook/cuda_kernels.py launches them).
//
// The pure-torch codec (hhook/codec.py, rotation.py, quantization.py, lanes.py, rng.py) is
// the specification. Three stages, one kernel each per call; no stage needs the host to
// read a device value, and no stage stores the rotated tensor:
//
//   hh_prepare_*   read the input once: sign diagonal D, Walsh-Hadamard transform, scale by
//                  1/sqrt(B), max|y| per block into the scale vector; the 48-bit digest of
//                  the input's float32 bits; the header (flag, fingerprint, digest). The last
//                  CUDA block to finish writes the header and zeroes the maxima if any was
//                  inf/NaN (a per-stream workspace holds the running digest and counters).
//   hh_quantize_*  read the input again and recompute the rotation (cheaper than writing
//                  and re-reading it), add the error-feedback residual, round stochastically
//                  onto the agreed scales with the counter-based RNG, pack the codes into
//                  planar lane words, write the new residual. A header that says
//                  "non-finite" or "identical" turns it into zero words and a copy of the old
//                  residual.
//   hh_decode_*    NaN if the header says non-finite or mismatch; the input itself if it
//                  says identical; otherwise unpack the summed words, dequantize to the mean,
//                  inverse rotation, crop, store in the output dtype.
//
// No #include on purpose: NVRTC (through CuPy) compiles this without host headers, and
// fp16/bf16 are handled as raw 16-bit patterns (PTX cvt for fp16, bit arithmetic for bf16).
// Every float operation that must match the CPU bit for bit is hh_add/hh_sub/hh_mul/hh_div/
// hh_floor: inline PTX with an explicit rounding mode and no .ftz, so it is never contracted
// into an FMA and keeps subnormals although CuPy appends -ftz=true (which makes the __f*_rn
// intrinsics flush them).
//
// The Walsh-Hadamard transform is the specification's (hhook/codec/rotation.py): butterflies
// on strides 1, 2, 4, ..., B/2 in that order, then one multiply by float32(1/sqrt B). It works
// on whole blocks of B = 2^log2B floats in shared memory, in passes of up to HH_LOG2R index
// bits from bit 0 up (the leftover log2B mod HH_LOG2R bits first); within a pass, bits in
// ascending order. Shared memory is padded by one float every 32 against bank conflicts.

#define HH_LOG2R 3
#define HH_R (1 << HH_LOG2R)
#define HH_HEADER 7
#define HH_MAX_WORDS_PER_THREAD 8  // hh_quantize keeps a thread's words in registers
// Register caps (launch bounds): at most HH_THREADS threads per CUDA block, and few enough
// registers for HH_MIN_BLOCKS of them per SM: prepare and decode <= 42 registers (75%
// occupancy), quantize <= 64 (50%; it holds a thread's words in registers). Radix 8 rather
// than 16 in the transform is what keeps them free of spills (ptxas -v, sm_80 and sm_90).
#define HH_THREADS 512
#define HH_MIN_BLOCKS 3
#define HH_MIN_BLOCKS_QUANTIZE 2

typedef unsigned int hh_u32;
typedef unsigned long long hh_u64;
typedef long long hh_i64;

// ---- 16-bit float patterns ----------------------------------------------------------
#ifndef HHOOK_HOST_EMULATION
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

// Exact-rounded float32 arithmetic that neither flushes subnormals nor contracts into FMA.
__device__ __forceinline__ float hh_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float hh_sub(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float hh_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float hh_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float hh_floor(float a) {
    float r;
    asm("cvt.rmi.f32.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
#endif

__device__ __forceinline__ float hh_bf16_to_float(unsigned short h) {
    return __uint_as_float(((hh_u32)h) << 16);
}
// Round to nearest even, NaN stays a quiet NaN: what torch does (c10::BFloat16).
__device__ __forceinline__ unsigned short hh_float_to_bf16(float f) {
    const hh_u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Element types: scalar load/store, and 4 consecutive elements at once (one 16- or
// 8-byte access) where the caller knows they are aligned and in range.
struct HhF32 {
    typedef float T;
    static __device__ __forceinline__ float load(const T* p, hh_i64 i) { return p[i]; }
    static __device__ __forceinline__ void store(T* p, hh_i64 i, float v) { p[i] = v; }
    static __device__ __forceinline__ void load4(const T* p, hh_i64 i, float* v) {
        const float4 q = *reinterpret_cast<const float4*>(p + i);
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    }
    static __device__ __forceinline__ void store4(T* p, hh_i64 i, const float* v) {
        float4 q;
        q.x = v[0], q.y = v[1], q.z = v[2], q.w = v[3];
        *reinterpret_cast<float4*>(p + i) = q;
    }
};
template <class Conv>
struct Hh16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(const T* p, hh_i64 i) { return Conv::to_float(p[i]); }
    static __device__ __forceinline__ void store(T* p, hh_i64 i, float v) { p[i] = Conv::from_float(v); }
    static __device__ __forceinline__ void load4(const T* p, hh_i64 i, float* v) {
        const ushort4 q = *reinterpret_cast<const ushort4*>(p + i);
        v[0] = Conv::to_float(q.x), v[1] = Conv::to_float(q.y);
        v[2] = Conv::to_float(q.z), v[3] = Conv::to_float(q.w);
    }
    static __device__ __forceinline__ void store4(T* p, hh_i64 i, const float* v) {
        ushort4 q;
        q.x = Conv::from_float(v[0]), q.y = Conv::from_float(v[1]);
        q.z = Conv::from_float(v[2]), q.w = Conv::from_float(v[3]);
        *reinterpret_cast<ushort4*>(p + i) = q;
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

// 4 elements from index g (a multiple of 4): one vector access when `vec` (the base
// pointer is aligned) and all 4 are below n; element by element otherwise, 0 past n.
template <class E>
__device__ __forceinline__ void hh_load4(const typename E::T* p, hh_i64 g, hh_i64 n, bool vec, float* v) {
    if (vec && g + 3 < n) {
        E::load4(p, g, v);
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = g + q < n ? E::load(p, g + q) : 0.0f;
    }
}
template <class E>
__device__ __forceinline__ void hh_store4(typename E::T* p, hh_i64 g, hh_i64 n, bool vec, const float* v) {
    if (vec && g + 3 < n) {
        E::store4(p, g, v);
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (g + q < n) E::store(p, g + q, v[q]);
    }
}

// ---- counter-based RNG and digest: hhook/rng.py --------------------------------------
__device__ __forceinline__ hh_u32 hh_mix32(hh_u32 x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    x ^= x >> 15;
    return x;
}

// rng.thresholds: U = p << (24 - L) | mix32(index + key) >> (8 + L), times 2^-24 (exact), with
// p = ((mix32(i + shared) >> (32 - L)) + (mix32(b + row) >> (32 - L)) + offset) mod 2^L and
// index = b * B + i.
// L = 0: independent rounding (the top 24 bits of the hash).
__device__ __forceinline__ float hh_threshold(hh_u32 key, hh_u32 shared, hh_u32 row, int L, hh_u32 offset,
                                              int log2B, hh_i64 index) {
    hh_u32 u = hh_mix32((hh_u32)index + key) >> (8 + L);
    if (L) {
        const hh_u32 p = (hh_mix32((hh_u32)(index & ((1ll << log2B) - 1)) + shared) >> (32 - L))
                         + (hh_mix32((hh_u32)(index >> log2B) + row) >> (32 - L)) + offset;
        u |= (p & ((1u << L) - 1u)) << (24 - L);
    }
    return hh_mul((float)u, 5.9604644775390625e-8f);
}

// One term of rng.digest: mix32(bits + index * 0x9E3779B9 + 0x44696773).
__device__ __forceinline__ hh_u32 hh_digest_term(float v, hh_i64 index) {
    return hh_mix32(__float_as_uint(v) + (hh_u32)index * 0x9E3779B9u + 0x44696773u);
}

// Entry p of the sign diagonal D (rotation.signs) is -1 where bit p of the host-computed
// table is set; applied by flipping the sign bit (exact, like torch's multiply by -1).
__device__ __forceinline__ float hh_apply_sign(const hh_u32* signs, int p, float v) {
    return __uint_as_float(__float_as_uint(v) ^ (((signs[p >> 5] >> (p & 31)) & 1u) << 31));
}

__device__ __forceinline__ bool hh_finite_bits(hh_u32 magnitude) { return magnitude < 0x7f800000u; }
// The bits of layout.overflow_limit(B) = 2^(126 - log2B): a block maximum at or above it
// (inf and NaN sort above) counts as non-finite, since its sums could overflow.
__device__ __forceinline__ hh_u32 hh_overflow_bits(int log2B) { return (hh_u32)(253 - log2B) << 23; }
__device__ __forceinline__ hh_u32 hh_umax(hh_u32 a, hh_u32 b) { return a > b ? a : b; }
__device__ __forceinline__ int hh_pad(int i) { return i + (i >> 5); }

// The agreed header's verdicts (codec.agreed_status), read by every thread.
__device__ __forceinline__ bool hh_nonfinite(const float* h) { return h[0] > 0.0f; }
__device__ __forceinline__ bool hh_mismatch(const float* h) { return h[1] != -h[2]; }
__device__ __forceinline__ bool hh_identical(const float* h) { return h[3] == -h[4] && h[5] == -h[6]; }

// Quantization constants of a block (quantization.inverse_steps / steps): one division each
// per block, not per coordinate. inv is 0 where it is not finite (M == 0, or M so small that
// (L - 1) / 2M overflows), which makes every code of the block 0.
__device__ __forceinline__ void hh_block_constants(float m, float top, float* inv, float* step) {
    const float twice = hh_mul(m, 2.0f);
    const float i = hh_div(top, twice);
    *inv = hh_finite_bits(__float_as_uint(i) & 0x7fffffffu) ? i : 0.0f;
    *step = hh_div(twice, top);
}

// ---- Walsh-Hadamard transform of the blocks in s[0, n) --------------------------------
// n is a multiple of max(B, HH_R). The butterflies of bit h (stride 2^h) for h = 0, 1, ...,
// log2B - 1 in that order. Natural (Sylvester) order, unnormalised:
// y[i] = sum_j (-1)^popcount(i & j) x[j], as rotation._hadamard. The caller syncs before;
// this ends with __syncthreads().
__device__ void hh_fwht(float* s, int n, int log2B) {
    const int groups = n >> HH_LOG2R;
    const int first = log2B % HH_LOG2R ? log2B % HH_LOG2R : HH_LOG2R;
    for (int lo = 0, nb = first; lo < log2B; lo += nb, nb = HH_LOG2R) {
        // index bits [lo, lo + nb) are transformed in this pass: the leftover bits first, at
        // bit 0, so that every pass's HH_R values (bits [lo, lo + HH_LOG2R)) lie in the tile
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            const int base = ((g >> lo) << (lo + HH_LOG2R)) | (g & ((1 << lo) - 1));
            float v[HH_R];
#pragma unroll
            for (int r = 0; r < HH_R; ++r) v[r] = s[hh_pad(base | (r << lo))];
#pragma unroll
            for (int h = 0; h < HH_LOG2R; ++h) {
                if (h < nb) {
#pragma unroll
                    for (int r = 0; r < HH_R; ++r) {
                        if (!(r & (1 << h))) {
                            const float a = v[r], b = v[r | (1 << h)];
                            v[r] = hh_add(a, b);
                            v[r | (1 << h)] = hh_sub(a, b);
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < HH_R; ++r) s[hh_pad(base | (r << lo))] = v[r];
        }
        __syncthreads();
    }
}

// Load source[a, a + n) into s with the sign diagonal applied (zeros past numel), 4
// consecutive elements per access. a and n are multiples of 4. Returns this thread's
// part of the digest when `digest` is set. The caller syncs after.
template <class In>
__device__ __forceinline__ hh_u64 hh_load_signed(const typename In::T* x, const hh_u32* signs, float* s,
                                                 hh_i64 a, int n, hh_i64 numel, int log2B, bool vec,
                                                 bool digest) {
    const int B = 1 << log2B;
    hh_u64 sum = 0;
    for (int e = 4 * threadIdx.x; e < n; e += 4 * blockDim.x) {
        float v[4];
        hh_load4<In>(x, a + e, numel, vec, v);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (digest && a + e + q < numel) sum += hh_digest_term(v[q], a + e + q);
            s[hh_pad(e + q)] = hh_apply_sign(signs, (e + q) & (B - 1), v[q]);
        }
    }
    return sum;
}

// The tile of coordinates a CUDA block of stages 1 and 3 holds: T threads of HH_R
// coordinates each in s (shared memory), tile_blocks blocks of B, from base; n_blocks
// blocks in the whole padded tensor.
#define HH_TILE(total, log2B)                                  \
    extern __shared__ float hh_smem[];                         \
    const int T = blockDim.x, t = threadIdx.x;                 \
    const int tile = HH_R * T;                                 \
    const int B = 1 << (log2B);                                \
    const int tile_blocks = tile >> (log2B);                   \
    float* s = hh_smem;                                        \
    const hh_i64 base = (hh_i64)blockIdx.x * tile;             \
    const hh_i64 n_blocks = (total) >> (log2B)

// ---- stage 1: rotate, measure, digest ---------------------------------------------------
// Grid: one CUDA block per tile of HH_R * blockDim.x coordinates (a multiple of B); at
// least one block, also for an empty tensor. Dynamic shared memory:
// (hh_pad(tile) + tile / B + 1) * 4 bytes. workspace: 2 x u64 of zeros per stream,
// [digest sum, (blocks done | flag << 32)]; the last block leaves it zeroed again.
template <class In>
__device__ void hh_prepare(const typename In::T* x, const hh_u32* signs, float* scales, hh_u64* workspace,
                           hh_i64 numel, hh_i64 total, int log2B, float norm, float fingerprint, int vec) {
    HH_TILE(total, log2B);
    hh_u32* smax = (hh_u32*)(hh_smem + hh_pad(tile));
    hh_u32* last = smax + tile_blocks;

    for (int b = t; b < tile_blocks; b += T) smax[b] = 0u;
    hh_u64 digest = hh_load_signed<In>(x, signs, s, base, tile, numel, log2B, vec != 0, true);
    __syncthreads();
    hh_fwht(s, tile, log2B);

    // max |y| per block. |y| as unsigned bits orders like the floats, NaN above inf. A
    // thread takes HH_R consecutive coordinates (one block when B >= HH_R): its own max,
    // then one reduction over the lanes that share the block.
    const int lane = t & 31;
    if (log2B >= HH_LOG2R) {
        hh_u32 m = 0u;
#pragma unroll
        for (int r = 0; r < HH_R; ++r)
            m = hh_umax(m, __float_as_uint(hh_mul(s[hh_pad(t * HH_R + r)], norm)) & 0x7fffffffu);
        const int seg = (B >> HH_LOG2R) < 32 ? (B >> HH_LOG2R) : 32;
        for (int off = 1; off < seg; off <<= 1) m = hh_umax(m, __shfl_xor_sync(0xffffffffu, m, off));
        if ((lane & (seg - 1)) == 0) atomicMax(&smax[(t * HH_R) >> log2B], m);
    } else {
        for (int r = 0; r < HH_R; ++r) {
            const int e = t * HH_R + r;
            atomicMax(&smax[e >> log2B], __float_as_uint(hh_mul(s[hh_pad(e)], norm)) & 0x7fffffffu);
        }
    }
    // The digest: a warp sum, one atomic per warp (integer: order independent).
    for (int off = 16; off > 0; off >>= 1) digest += __shfl_xor_sync(0xffffffffu, digest, off);
    if (lane == 0 && digest) atomicAdd(&workspace[0], digest);
    __syncthreads();

    bool flagged = false;
    for (int b = t; b < tile_blocks; b += T) {
        const hh_i64 blk = (base >> log2B) + b;
        if (blk < n_blocks) {
            scales[HH_HEADER + blk] = __uint_as_float(smax[b]);
            flagged |= smax[b] >= hh_overflow_bits(log2B);
        }
    }
    hh_u32* counters = (hh_u32*)&workspace[1];  // [blocks done, flag]
    if (flagged) atomicOr(&counters[1], 1u);

    // Last block done: header, zeroed maxima if flagged, workspace back to zero. Thread 0
    // reads and resets the workspace; *last tells the others (0: not last, 1: last,
    // 2: last and some block was non-finite).
    __threadfence();
    __syncthreads();
    if (t == 0) {
        *last = 0u;
        if (atomicAdd(&counters[0], 1u) == gridDim.x - 1) {
            __threadfence();
            const bool nonfinite = atomicOr(&counters[1], 0u) != 0u;
            const hh_u64 d = atomicAdd(&workspace[0], 0ull) & 0xFFFFFFFFFFFFull;
            const float lo = (float)(hh_u32)(d & 0xFFFFFFu), hi = (float)(hh_u32)(d >> 24);
            scales[0] = nonfinite ? 1.0f : 0.0f;
            scales[1] = fingerprint;
            scales[2] = -fingerprint;
            scales[3] = lo;
            scales[4] = -lo;
            scales[5] = hi;
            scales[6] = -hi;
            workspace[0] = 0ull;
            workspace[1] = 0ull;
            *last = nonfinite ? 2u : 1u;
        }
    }
    __syncthreads();
    if (*last == 2u)
        for (hh_i64 b = t; b < n_blocks; b += T) scales[HH_HEADER + b] = 0.0f;
}

// ---- stage 3: rotation again, stochastic rounding straight into lane words --------------
// A CUDA block owns words [w0, w0 + Q * blockDim.x) (Q = words_per_thread <= 16, kept in
// registers). Lane j of word i holds code j * n_words + i, codes past `total` are zero. For
// each lane it rotates the whole blocks covering that lane's codes (a window of at most
// Q * blockDim.x + G coordinates, G = max(B, HH_R)), then rounds its codes: float
// operations in quantization.quantize_into's order. Dynamic shared memory:
// (hh_pad(Q * blockDim.x + G) + 3 * ((Q * blockDim.x + G) >> log2B)) * 4 bytes. Q * blockDim.x
// must be a multiple of G.
// agreed: header + n_blocks scales. residual may equal residual_out (in place).
template <class In, class W>
__device__ void hh_quantize(const typename In::T* x, const hh_u32* signs, const float* agreed, W* words,
                            const float* residual, float* residual_out, int has_residual, hh_i64 numel,
                            hh_i64 total, hh_i64 n_words, int log2B, int levels, int width, int lanes,
                            hh_u32 key, hh_u32 shared, hh_u32 row, int strata_bits, hh_u32 offset, float norm,
                            int words_per_thread, int vec) {
    extern __shared__ float hh_smem[];
    const int T = blockDim.x, t = threadIdx.x;
    const int span = words_per_thread * T;
    const int G = log2B > HH_LOG2R ? 1 << log2B : HH_R;
    const int window_blocks = (span + G) >> log2B;
    float* s = hh_smem;
    float* inv_of = hh_smem + hh_pad(span + G);
    float* step_of = inv_of + window_blocks;
    float* max_of = step_of + window_blocks;
    const hh_i64 w0 = (hh_i64)blockIdx.x * span;
    const float top = (float)(levels - 1);
    const float* maxima = agreed + HH_HEADER;
    const hh_i64 n_blocks = total >> log2B;

    if (hh_nonfinite(agreed) || hh_identical(agreed)) {
        // Nothing to send: zero words (decode ignores them; never memory left by others on
        // the wire); the residual stays as it was.
        for (int q = 0; q < words_per_thread; ++q) {
            const hh_i64 i = w0 + t + q * T;
            if (i < n_words) words[i] = 0;
        }
        if (has_residual && residual != residual_out)
            for (int j = 0; j < lanes; ++j)
                for (int q = 0; q < words_per_thread; ++q) {
                    const hh_i64 i = w0 + t + q * T, idx = (hh_i64)j * n_words + i;
                    if (i < n_words && idx < total) residual_out[idx] = residual[idx];
                }
        return;
    }

    W word[HH_MAX_WORDS_PER_THREAD];
#pragma unroll
    for (int q = 0; q < HH_MAX_WORDS_PER_THREAD; ++q) word[q] = 0;
    const hh_i64 w1 = w0 + span < n_words ? w0 + span : n_words;
    for (int j = 0; j < lanes; ++j) {
        const hh_i64 c0 = (hh_i64)j * n_words + w0;
        if (c0 >= total) break;  // this and later lanes are padding: code 0
        const hh_i64 c1 = (hh_i64)j * n_words + w1;
        const hh_i64 a = c0 / G * G;
        const int n = (int)((c1 + G - 1) / G * G - a);
        const hh_i64 first_block = a >> log2B;
        for (int b = t; b < (n >> log2B); b += T) {
            const float m = first_block + b < n_blocks ? maxima[first_block + b] : 0.0f;
            hh_block_constants(m, top, &inv_of[b], &step_of[b]);
            max_of[b] = m;
        }
        hh_load_signed<In>(x, signs, s, a, n, numel, log2B, vec != 0, false);
        __syncthreads();
        hh_fwht(s, n, log2B);
#pragma unroll
        for (int q = 0; q < HH_MAX_WORDS_PER_THREAD; ++q) {
            const hh_i64 i = w0 + t + q * T, idx = (hh_i64)j * n_words + i;
            if (q < words_per_thread && i < n_words && idx < total) {
                const int e = (int)(idx - a);
                float y = hh_mul(s[hh_pad(e)], norm);
                if (has_residual) y = hh_add(y, residual[idx]);
                const int b = e >> log2B;
                const float m = max_of[b];
                const float u = hh_threshold(key, shared, row, strata_bits, offset, log2B, idx);
                const float tt = hh_add(hh_mul(hh_add(y, m), inv_of[b]), u);
                float c = hh_floor(tt);
                c = c >= 0.0f ? c : 0.0f;  // NaN: code 0, as every backend
                c = c > top ? top : c;
                word[q] |= ((W)c) << (j * width);
                if (has_residual) residual_out[idx] = hh_sub(y, hh_sub(hh_mul(c, step_of[b]), m));
            }
        }
        __syncthreads();  // the next lane reuses s and the tables
    }
#pragma unroll
    for (int q = 0; q < HH_MAX_WORDS_PER_THREAD; ++q) {
        const hh_i64 i = w0 + t + q * T;
        if (q < words_per_thread && i < n_words) words[i] = word[q];
    }
}

// ---- stage 5: unpack, dequantize, inverse rotation, crop ------------------------------
// Grid and tile as hh_prepare. Dynamic shared memory: (hh_pad(tile) + 2 * tile / B) * 4.
// mean = S * ((M * 2 / (L - 1)) / n) - M, in fp32 as quantization.dequantize; then
// x = D H mean / sqrt(B), cropped to numel and stored in Out's dtype. The header decides
// first: NaN (non-finite or mismatch), or the source itself (identical).
template <class W, class Out, class In>
__device__ void hh_decode(const W* words, const hh_u32* signs, const float* agreed, typename Out::T* out,
                          const typename In::T* source, hh_i64 numel, hh_i64 total, hh_i64 n_words,
                          int log2B, int levels, int world, int width, float norm, int vec_out,
                          int vec_in) {
    HH_TILE(total, log2B);
    float* mul = hh_smem + hh_pad(tile);
    float* sub = mul + tile_blocks;
    const float* maxima = agreed + HH_HEADER;

    if (hh_nonfinite(agreed) || hh_mismatch(agreed) || hh_identical(agreed)) {
        const bool nan = hh_nonfinite(agreed) || hh_mismatch(agreed);
        for (int e = 4 * t; e < tile; e += 4 * T) {
            float v[4];
            if (nan) {
                v[0] = v[1] = v[2] = v[3] = __uint_as_float(0x7fc00000u);
            } else {
                hh_load4<In>(source, base + e, numel, vec_in != 0, v);
            }
            hh_store4<Out>(out, base + e, numel, vec_out != 0, v);
        }
        return;
    }

    for (int b = t; b < tile_blocks; b += T) {
        const hh_i64 blk = (base >> log2B) + b;
        const float m = blk < n_blocks ? maxima[blk] : 0.0f;
        const float step = hh_div(hh_mul(m, 2.0f), (float)(levels - 1));
        mul[b] = hh_div(step, (float)world);
        sub[b] = m;
    }
    __syncthreads();

    const W mask = (W)((((hh_u64)1) << width) - 1u);
    // Lane j of coordinate g is g / n_words: one division, then advance as g grows.
    hh_i64 j = (base + t) / n_words;
    hh_i64 lane_start = j * n_words;
    for (int k = 0; k < HH_R; ++k) {
        const int e = t + k * T;
        const hh_i64 g = base + e;
        float v = 0.0f;
        if (g < total) {
            while (g - lane_start >= n_words) {
                ++j;
                lane_start += n_words;
            }
            const W w = words[g - lane_start];
            const float sum = (float)((w >> (j * width)) & mask);
            const int b = e >> log2B;
            v = hh_sub(hh_mul(sum, mul[b]), sub[b]);
        }
        s[hh_pad(e)] = v;
    }
    __syncthreads();
    hh_fwht(s, tile, log2B);

    for (int e = 4 * t; e < tile; e += 4 * T) {
        float v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = hh_apply_sign(signs, (e + q) & (B - 1), hh_mul(s[hh_pad(e + q)], norm));
        hh_store4<Out>(out, base + e, numel, vec_out != 0, v);
    }
}

// ---- entry points (names used by hhook/cuda_kernels.py) --------------------------------
#define HH_PREPARE(NAME, IN)                                                                    \
    extern "C" __global__ void __launch_bounds__(HH_THREADS, HH_MIN_BLOCKS) NAME(const IN::T* x, const hh_u32* signs, float* scales,         \
                                    hh_u64* workspace, hh_i64 numel, hh_i64 total, int log2B,   \
                                    float norm, float fingerprint, int vec) {                   \
        hh_prepare<IN>(x, signs, scales, workspace, numel, total, log2B, norm, fingerprint, vec); \
    }
HH_PREPARE(hh_prepare_f32, HhF32)
HH_PREPARE(hh_prepare_f16, HhF16)
HH_PREPARE(hh_prepare_bf16, HhBF16)

#define HH_QUANTIZE(NAME, IN, W)                                                                   \
    extern "C" __global__ void __launch_bounds__(HH_THREADS, HH_MIN_BLOCKS_QUANTIZE) NAME(const IN::T* x, const hh_u32* signs, const float* agreed,      \
                                    W* words, const float* residual, float* residual_out,          \
                                    int has_residual, hh_i64 numel, hh_i64 total, hh_i64 n_words,  \
                                    int log2B, int levels, int width, int lanes, hh_u32 key,       \
                                    hh_u32 shared, hh_u32 row, int strata_bits, hh_u32 offset,     \
                                    float norm, int words_per_thread, int vec) {                   \
        hh_quantize<IN, W>(x, signs, agreed, words, residual, residual_out, has_residual, numel,   \
                           total, n_words, log2B, levels, width, lanes, key, shared, row,         \
                           strata_bits, offset, norm, words_per_thread, vec);                      \
    }
HH_QUANTIZE(hh_quantize_f32_i32, HhF32, hh_u32)
HH_QUANTIZE(hh_quantize_f32_i64, HhF32, hh_u64)
HH_QUANTIZE(hh_quantize_f16_i32, HhF16, hh_u32)
HH_QUANTIZE(hh_quantize_f16_i64, HhF16, hh_u64)
HH_QUANTIZE(hh_quantize_bf16_i32, HhBF16, hh_u32)
HH_QUANTIZE(hh_quantize_bf16_i64, HhBF16, hh_u64)

#define HH_DECODE(NAME, W, OUT, IN)                                                                \
    extern "C" __global__ void __launch_bounds__(HH_THREADS, HH_MIN_BLOCKS) NAME(const W* words, const hh_u32* signs, const float* agreed,       \
                                    OUT::T* out, const IN::T* source, hh_i64 numel, hh_i64 total,   \
                                    hh_i64 n_words, int log2B, int levels, int world, int width,    \
                                    float norm, int vec_out, int vec_in) {                          \
        hh_decode<W, OUT, IN>(words, signs, agreed, out, source, numel, total, n_words, log2B,      \
                              levels, world, width, norm, vec_out, vec_in);                         \
    }
// Output dtype x source dtype (the source is read only when every rank's input was identical).
#define HH_DECODE_OUT(W, WN, OUT, ON)                                        \
    HH_DECODE(hh_decode_##WN##_##ON##_f32, W, OUT, HhF32)                    \
    HH_DECODE(hh_decode_##WN##_##ON##_f16, W, OUT, HhF16)                    \
    HH_DECODE(hh_decode_##WN##_##ON##_bf16, W, OUT, HhBF16)
HH_DECODE_OUT(hh_u32, i32, HhF32, f32)
HH_DECODE_OUT(hh_u32, i32, HhF16, f16)
HH_DECODE_OUT(hh_u32, i32, HhBF16, bf16)
HH_DECODE_OUT(hh_u64, i64, HhF32, f32)
HH_DECODE_OUT(hh_u64, i64, HhF16, f16)
HH_DECODE_OUT(hh_u64, i64, HhBF16, bf16)
