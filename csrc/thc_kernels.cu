// Fused CUDA kernels for the hhook THC codec (hhook/cuda_kernels.py launches them).
//
// The pure-torch codec (hhook/codec.py, rotation.py, quantization.py, lanes.py, rng.py) is
// the specification. Three stages, each one kernel per call:
//
//   hh_prepare_*   pad, multiply by the sign diagonal D, Walsh-Hadamard transform, scale by
//                  1/sqrt(B), write max|y| per block (plus the header) into the scale
//                  vector, store the rotated blocks plus the error-feedback residual.
//   hh_quantize_*  stochastic rounding onto the agreed scales with the same counter-based
//                  RNG and the same rounded float operations as quantization.quantize_into,
//                  written straight into planar lane words; optionally the residual.
//   hh_decode_*    unpack the summed words, dequantize to the mean, inverse rotation, crop,
//                  store in the output dtype.
//
// No #include on purpose: NVRTC (through CuPy) compiles this without host headers, and
// fp16/bf16 are handled as raw 16-bit patterns (PTX cvt for fp16, bit arithmetic for bf16).
// Rounding that must match torch bit for bit uses __fadd_rn/__fmul_rn/__fdiv_rn, which the
// compiler never contracts into FMAs.
//
// The Walsh-Hadamard transform runs on a tile of TILE = HH_R * blockDim.x floats in shared
// memory (one or several whole blocks of B = 2^log2B). It is done in passes of up to
// HH_LOG2R index bits, from the highest bit down: in each pass every thread gathers the
// HH_R elements that differ only in those bits, transforms them in registers and scatters
// them back. Shared memory is padded by one float every 32 to avoid bank conflicts.

#define HH_LOG2R 4
#define HH_R (1 << HH_LOG2R)
#define HH_HEADER 3

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

struct HhF32 {
    typedef float T;
    static __device__ __forceinline__ float load(const T* p, hh_i64 i) { return p[i]; }
    static __device__ __forceinline__ void store(T* p, hh_i64 i, float v) { p[i] = v; }
};
struct HhF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(const T* p, hh_i64 i) { return hh_half_to_float(p[i]); }
    static __device__ __forceinline__ void store(T* p, hh_i64 i, float v) { p[i] = hh_float_to_half(v); }
};
struct HhBF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(const T* p, hh_i64 i) { return hh_bf16_to_float(p[i]); }
    static __device__ __forceinline__ void store(T* p, hh_i64 i, float v) { p[i] = hh_float_to_bf16(v); }
};

// ---- counter-based RNG: hhook/rng.py ------------------------------------------------
__device__ __forceinline__ hh_u32 hh_mix32(hh_u32 x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    x ^= x >> 15;
    return x;
}

// rng.uniform: top 24 bits of mix32((index + key) mod 2^32), times 2^-24 (exact).
__device__ __forceinline__ float hh_uniform(hh_u32 key, hh_i64 index) {
    return (float)(hh_mix32((hh_u32)index + key) >> 8) * 5.9604644775390625e-8f;
}

// rotation.signs: entry p of D is -1 where bit 0 of mix32((p + sign_key) mod 2^32) is set.
__device__ __forceinline__ bool hh_negative(hh_u32 sign_key, hh_u32 p) {
    return (hh_mix32(p + sign_key) & 1u) != 0u;
}

__device__ __forceinline__ hh_u32 hh_umax(hh_u32 a, hh_u32 b) { return a > b ? a : b; }

__device__ __forceinline__ int hh_pad(int i) { return i + (i >> 5); }

// ---- Walsh-Hadamard transform of every B-block of a shared-memory tile -----------------
// Natural (Sylvester) order, unnormalised: y[i] = sum_j (-1)^popcount(i & j) x[j], as
// rotation._hadamard. Ends with __syncthreads(); the caller syncs before it.
__device__ void hh_fwht_tile(float* s, int log2B) {
    const int t = threadIdx.x;
    for (int hi = log2B; hi > 0; hi -= HH_LOG2R) {
        const int lo = hi > HH_LOG2R ? hi - HH_LOG2R : 0;
        const int nb = hi - lo;  // index bits [lo, hi) are transformed in this pass
        const int base = ((t >> lo) << (lo + HH_LOG2R)) | (t & ((1 << lo) - 1));
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
                        v[r] = a + b;
                        v[r | (1 << h)] = a - b;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < HH_R; ++r) s[hh_pad(base | (r << lo))] = v[r];
        __syncthreads();
    }
}

// ---- stage 1: rotate and measure ----------------------------------------------------
// Grid: one CUDA block per tile of HH_R * blockDim.x coordinates (a multiple of B).
// Dynamic shared memory: (hh_pad(tile) + tile / B) * 4 bytes.
// scales must be zeroed: scales[0] becomes 1 where a block max is inf/NaN (the codec
// then zeroes the maxima), scales[1], scales[2] = fingerprint, -fingerprint.
template <class In>
__device__ void hh_prepare(const typename In::T* x, const float* residual, int has_residual,
                           float* blocks, float* scales, hh_i64 numel, hh_i64 total, int log2B,
                           hh_u32 sign_key, float norm, float fingerprint) {
    extern __shared__ float hh_smem[];
    const int T = blockDim.x, t = threadIdx.x;
    const int tile = HH_R * T;
    const int B = 1 << log2B;
    const int tile_blocks = tile >> log2B;
    float* s = hh_smem;
    hh_u32* smax = (hh_u32*)(hh_smem + hh_pad(tile));
    const hh_i64 base = (hh_i64)blockIdx.x * tile;

    for (int b = t; b < tile_blocks; b += T) smax[b] = 0u;
    if (blockIdx.x == 0 && t == 0) {
        scales[1] = fingerprint;
        scales[2] = -fingerprint;
    }
    // Load (coalesced), pad with zeros, apply D.
    for (int k = 0; k < HH_R; ++k) {
        const int e = t + k * T;
        const hh_i64 g = base + e;
        float v = g < numel ? In::load(x, g) : 0.0f;
        if (hh_negative(sign_key, (hh_u32)(e & (B - 1)))) v = -v;
        s[hh_pad(e)] = v;
    }
    __syncthreads();
    hh_fwht_tile(s, log2B);

    // Normalise, store y plus the residual; max |y| per block of y alone (the scales cover
    // the gradient, as in codec.prepare). As unsigned bit patterns |y| orders like the
    // floats and NaN sorts above inf, so a NaN block is flagged.
    const int seg = B < 32 ? B : 32;  // lanes of a warp that share a block
    const int lane = t & 31;
    for (int k = 0; k < HH_R; ++k) {
        const int e = t + k * T;
        const hh_i64 g = base + e;
        hh_u32 m = 0u;
        if (g < total) {
            const float y = __fmul_rn(s[hh_pad(e)], norm);
            m = __float_as_uint(y) & 0x7fffffffu;
            blocks[g] = has_residual ? __fadd_rn(y, residual[g]) : y;
        }
        for (int off = 1; off < seg; off <<= 1) m = hh_umax(m, __shfl_xor_sync(0xffffffffu, m, off));
        if (g < total && (lane & (seg - 1)) == 0) atomicMax(&smax[e >> log2B], m);
    }
    __syncthreads();
    const hh_i64 n_blocks = total >> log2B;
    for (int b = t; b < tile_blocks; b += T) {
        const hh_i64 blk = (base >> log2B) + b;
        if (blk < n_blocks) {
            const hh_u32 m = smax[b];
            scales[HH_HEADER + blk] = __uint_as_float(m);
            if ((m & 0x7f800000u) == 0x7f800000u) scales[0] = 1.0f;
        }
    }
}

// ---- stage 3: stochastic rounding straight into lane words ----------------------------
// One thread per word (grid-stride). Lane j of word i holds code j * n_words + i; codes
// past `count` are zero padding. Float operations in quantization.quantize_into's order.
template <class W>
__device__ void hh_quantize(const float* blocks, const float* scales, W* words, float* residual,
                            int has_residual, hh_i64 count, hh_i64 n_words, int log2B, int levels,
                            int width, int lanes, hh_u32 key) {
    const float top = (float)(levels - 1);
    const hh_i64 stride = (hh_i64)gridDim.x * blockDim.x;
    for (hh_i64 i = (hh_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n_words; i += stride) {
        W word = 0;
        for (int j = 0; j < lanes; ++j) {
            const hh_i64 idx = (hh_i64)j * n_words + i;
            if (idx >= count) break;
            const float y = blocks[idx];
            const float m = scales[idx >> log2B];
            const float inv = m == 0.0f ? 0.0f : __fdiv_rn(top, __fmul_rn(m, 2.0f));
            const float a = __fadd_rn(y, m);
            const float b = __fmul_rn(a, inv);
            const float tt = __fadd_rn(b, hh_uniform(key, idx));
            const float c = fminf(fmaxf(floorf(tt), 0.0f), top);
            word |= ((W)c) << (j * width);
            if (has_residual) {
                const float step = __fdiv_rn(__fmul_rn(m, 2.0f), top);
                residual[idx] = __fsub_rn(y, __fsub_rn(__fmul_rn(c, step), m));
            }
        }
        words[i] = word;
    }
}

// ---- stage 5: unpack, dequantize, inverse rotation, crop ------------------------------
// Grid and tile as hh_prepare. Dynamic shared memory: (hh_pad(tile) + 2 * tile / B) * 4.
// mean = S * ((M * 2 / (L - 1)) / n) - M, in fp32 as quantization.dequantize; then
// x = D H mean / sqrt(B), cropped to numel and stored in Out's dtype.
template <class W, class Out>
__device__ void hh_decode(const W* words, const float* scales, typename Out::T* out, hh_i64 numel,
                          hh_i64 total, hh_i64 n_words, int log2B, int levels, int world, int width,
                          hh_u32 sign_key, float norm) {
    extern __shared__ float hh_smem[];
    const int T = blockDim.x, t = threadIdx.x;
    const int tile = HH_R * T;
    const int B = 1 << log2B;
    const int tile_blocks = tile >> log2B;
    float* s = hh_smem;
    float* mul = hh_smem + hh_pad(tile);
    float* sub = mul + tile_blocks;
    const hh_i64 base = (hh_i64)blockIdx.x * tile;
    const hh_i64 n_blocks = total >> log2B;

    for (int b = t; b < tile_blocks; b += T) {
        const hh_i64 blk = (base >> log2B) + b;
        const float m = blk < n_blocks ? scales[blk] : 0.0f;
        const float step = __fdiv_rn(__fmul_rn(m, 2.0f), (float)(levels - 1));
        mul[b] = __fdiv_rn(step, (float)world);
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
            v = __fsub_rn(__fmul_rn(sum, mul[b]), sub[b]);
        }
        s[hh_pad(e)] = v;
    }
    __syncthreads();
    hh_fwht_tile(s, log2B);

    for (int k = 0; k < HH_R; ++k) {
        const int e = t + k * T;
        const hh_i64 g = base + e;
        if (g < numel) {
            float x = __fmul_rn(s[hh_pad(e)], norm);
            if (hh_negative(sign_key, (hh_u32)(e & (B - 1)))) x = -x;
            Out::store(out, g, x);
        }
    }
}

// ---- entry points (names used by hhook/cuda_kernels.py) --------------------------------
#define HH_PREPARE(NAME, IN)                                                                   \
    extern "C" __global__ void NAME(const IN::T* x, const float* residual, int has_residual,   \
                                    float* blocks, float* scales, hh_i64 numel, hh_i64 total,  \
                                    int log2B, hh_u32 sign_key, float norm, float fingerprint) { \
        hh_prepare<IN>(x, residual, has_residual, blocks, scales, numel, total, log2B, sign_key, \
                       norm, fingerprint);                                                     \
    }
HH_PREPARE(hh_prepare_f32, HhF32)
HH_PREPARE(hh_prepare_f16, HhF16)
HH_PREPARE(hh_prepare_bf16, HhBF16)

#define HH_QUANTIZE(NAME, W)                                                                    \
    extern "C" __global__ void NAME(const float* blocks, const float* scales, W* words,          \
                                    float* residual, int has_residual, hh_i64 count,             \
                                    hh_i64 n_words, int log2B, int levels, int width, int lanes, \
                                    hh_u32 key) {                                                \
        hh_quantize<W>(blocks, scales, words, residual, has_residual, count, n_words, log2B,     \
                       levels, width, lanes, key);                                               \
    }
HH_QUANTIZE(hh_quantize_i32, hh_u32)
HH_QUANTIZE(hh_quantize_i64, hh_u64)

#define HH_DECODE(NAME, W, OUT)                                                                 \
    extern "C" __global__ void NAME(const W* words, const float* scales, OUT::T* out,            \
                                    hh_i64 numel, hh_i64 total, hh_i64 n_words, int log2B,       \
                                    int levels, int world, int width, hh_u32 sign_key,           \
                                    float norm) {                                                \
        hh_decode<W, OUT>(words, scales, out, numel, total, n_words, log2B, levels, world, width, \
                          sign_key, norm);                                                       \
    }
HH_DECODE(hh_decode_i32_f32, hh_u32, HhF32)
HH_DECODE(hh_decode_i32_f16, hh_u32, HhF16)
HH_DECODE(hh_decode_i32_bf16, hh_u32, HhBF16)
HH_DECODE(hh_decode_i64_f32, hh_u64, HhF32)
HH_DECODE(hh_decode_i64_f16, hh_u64, HhF16)
HH_DECODE(hh_decode_i64_bf16, hh_u64, HhBF16)
