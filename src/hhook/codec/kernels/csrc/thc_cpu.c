/* Fused CPU stages of the THC codec (hhook/codec/kernels/cpu.py compiles and loads this file).
 *
 * Each function does one stage over a range of blocks or words, so that Python threads
 * can split a tensor (ctypes releases the GIL). The pure-torch codec in hhook/codec/ is
 * the specification; every stage reproduces its float32 operations in the same order,
 * so the file must be compiled without floating-point contraction or fast-math
 * (-fno-trapping-math only lets the clamps vectorize; it changes no value).
 *
 *   hh_prepare:  load (fp32/fp16/bf16) + digest of the float32 bits + sign diagonal
 *                + Walsh-Hadamard transform + 1/sqrt(B) + per-block max |y|, rotated blocks out.
 *
 * The transform is the specification's (hhook/codec/rotation.py): radix-2 butterflies on
 * strides 1, 2, 4, ..., B/2 in that order, each an exact-rounded add and subtract, then one
 * multiply by norm = float32(1/sqrt(B)); the sign diagonal is exact. Every code path below
 * (the portable one and the AVX2 one, whatever -march) performs these operations in this
 * order, so the rotated blocks and the decoded outputs are the same bits on every CPU.
 *   hh_quantize: (y + residual) -> stochastic rounding -> lane words, residual out.
 *   hh_decode:   lane sums -> dequantized mean -> inverse rotation -> store in dtype.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { HH_F32 = 0, HH_F16 = 1, HH_BF16 = 2 };

#define HH_MUL1 0x21F0AAADu
#define HH_MUL2 0x735A2D97u
#define HH_DIGEST_SALT 0x44696773u
#define HH_DIGEST_MUL 0x9E3779B9u

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= HH_MUL1;
    x ^= x >> 15;
    x *= HH_MUL2;
    x ^= x >> 15;
    return x;
}

/* -- dtype conversions (torch's: exact widening, round-to-nearest-even narrowing) -- */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void load_f32(const void *src, int dtype, int64_t first, int64_t count, float *dst) {
    if (dtype == HH_F32) {
        memcpy(dst, (const float *)src + first, (size_t)count * 4);
    } else if (dtype == HH_F16) {
        const _Float16 *s = (const _Float16 *)src + first;
        for (int64_t i = 0; i < count; i++) dst[i] = (float)s[i];
    } else {
        const uint16_t *s = (const uint16_t *)src + first;
        for (int64_t i = 0; i < count; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

static void store_from_f32(void *dst, int dtype, int64_t first, int64_t count, const float *src) {
    if (dtype == HH_F32) {
        memcpy((float *)dst + first, src, (size_t)count * 4);
    } else if (dtype == HH_F16) {
        _Float16 *d = (_Float16 *)dst + first;
        for (int64_t i = 0; i < count; i++) d[i] = (_Float16)src[i];
    } else {
        uint16_t *d = (uint16_t *)dst + first;
        for (int64_t i = 0; i < count; i++) d[i] = f32_to_bf16(src[i]);
    }
}

/* -- Walsh-Hadamard transform, in place, unnormalised ---------------------------- */
/* Portable version: the reference for the vector one below, and the path for blocks too
 * small for it. The stages commute, so any order gives the transform (rounding aside). */
static void fwht(float *x, int64_t n) {
    int64_t h = 1;
    for (; 4 * h <= n; h <<= 2) /* two stages per pass: half the loads and stores */
        for (int64_t i = 0; i < n; i += 4 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h], c = x[j + 2 * h], d = x[j + 3 * h];
                float ab = a + b, amb = a - b, cd = c + d, cmd = c - d;
                x[j] = ab + cd;
                x[j + h] = amb + cmd;
                x[j + 2 * h] = ab - cd;
                x[j + 3 * h] = amb - cmd;
            }
    for (; h < n; h <<= 1)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

/* Streaming pays once a stage's output exceeds the last-level cache; below, the next stage
 * finds it in cache. */
#define HH_STREAM_BYTES ((int64_t)4 << 20)

#ifdef __AVX2__
#define HH_INLINE static inline __attribute__((always_inline))
#define HH_GROUP 32 /* coordinates of the first pass's register group */

/* mix32 on 4 (SSE) or 8 (AVX2) lanes at once: P is the intrinsics' prefix, V the vector. */
#define HH_MIX32_LANES(name, V, P, xor_)                                 \
    static inline V name(V x) {                                          \
        x = xor_(x, P##_srli_epi32(x, 16));                              \
        x = P##_mullo_epi32(x, P##_set1_epi32((int)HH_MUL1));            \
        x = xor_(x, P##_srli_epi32(x, 15));                              \
        x = P##_mullo_epi32(x, P##_set1_epi32((int)HH_MUL2));            \
        return xor_(x, P##_srli_epi32(x, 15));                           \
    }
HH_MIX32_LANES(mix32_x4, __m128i, _mm, _mm_xor_si128)
HH_MIX32_LANES(mix32_x8, __m256i, _mm256, _mm256_xor_si256)

/* First pass, strides 1..16, one group of 32 in eight 128-bit registers (strides 4..16
 * are then register to register: no lane-crossing shuffle, slow on 2x128-bit cores).
 * in -> (digest of in's bits when hash) -> * signs when signs -> out. hash holds the
 * element hashes' index terms of the group's first four; lo/hi the digest halves. */
HH_INLINE void wht_first_pass(const float *in, float *out, int64_t n, const float *signs, int hash,
                              uint32_t index_hash, uint32_t *digest_lo, uint32_t *digest_hi) {
    const __m128 s1 = _mm_setr_ps(1, -1, 1, -1), s2 = _mm_setr_ps(1, 1, -1, -1);
    const __m128i index_step = _mm_set1_epi32((int)(4u * HH_DIGEST_MUL));
    const __m128i low16 = _mm_set1_epi32(0xFFFF);
    __m128i index = _mm_add_epi32(_mm_set1_epi32((int)index_hash),
                                  _mm_mullo_epi32(_mm_setr_epi32(0, 1, 2, 3), _mm_set1_epi32((int)HH_DIGEST_MUL)));
    __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();
    for (int64_t i = 0; i < n; i += HH_GROUP) {
        __m128 v[8];
        for (int k = 0; k < 8; k++) {
            v[k] = _mm_loadu_ps(in + i + 4 * k);
            if (hash) {
                __m128i h = mix32_x4(_mm_add_epi32(_mm_castps_si128(v[k]), index));
                index = _mm_add_epi32(index, index_step);
                lo = _mm_add_epi32(lo, _mm_and_si128(h, low16));
                hi = _mm_add_epi32(hi, _mm_srli_epi32(h, 16));
            }
            if (signs) v[k] = _mm_mul_ps(v[k], _mm_loadu_ps(signs + i + 4 * k));
            v[k] = _mm_add_ps(_mm_mul_ps(v[k], s1), _mm_permute_ps(v[k], 0xB1));
            v[k] = _mm_add_ps(_mm_mul_ps(v[k], s2), _mm_permute_ps(v[k], 0x4E));
        }
        for (int s = 1; s < 8; s <<= 1)
            for (int k = 0; k < 8; k++)
                if (!(k & s)) {
                    __m128 a = v[k], b = v[k + s];
                    v[k] = _mm_add_ps(a, b);
                    v[k + s] = _mm_sub_ps(a, b);
                }
        for (int k = 0; k < 8; k++) _mm_storeu_ps(out + i + 4 * k, v[k]);
    }
    if (hash) {
        uint32_t l[4], h[4];
        _mm_storeu_si128((__m128i *)l, lo);
        _mm_storeu_si128((__m128i *)h, hi);
        *digest_lo = l[0] + l[1] + l[2] + l[3];
        *digest_hi = h[0] + h[1] + h[2] + h[3];
    }
}

/* 2^stages butterfly stages over strides h .. h 2^(stages-1), in registers; in -> out
 * (in == out is fine), the outputs * mul[i] when mul, else * scale when scale != 0, their
 * max |y| bits into top when top. */
HH_INLINE void wht_radix_pass(const float *in, float *out, int64_t n, int64_t h, int stages, const float *mul,
                              float scale, __m256i *top, int stream) {
    const int r = 1 << stages;
    const __m256 scale8 = _mm256_set1_ps(scale);
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    for (int64_t i = 0; i < n; i += r * h)
        for (int64_t j = i; j < i + h; j += 8) {
            __m256 v[16];
            for (int k = 0; k < r; k++) v[k] = _mm256_loadu_ps(in + j + k * h);
            for (int s = 1; s < r; s <<= 1)
                for (int k = 0; k < r; k++)
                    if (!(k & s)) {
                        __m256 a = v[k], b = v[k + s];
                        v[k] = _mm256_add_ps(a, b);
                        v[k + s] = _mm256_sub_ps(a, b);
                    }
            for (int k = 0; k < r; k++) {
                if (mul)
                    v[k] = _mm256_mul_ps(v[k], _mm256_loadu_ps(mul + j + k * h));
                else if (scale != 0.0f)
                    v[k] = _mm256_mul_ps(v[k], scale8);
                if (top) *top = _mm256_max_epu32(*top, _mm256_and_si256(_mm256_castps_si256(v[k]), abs_mask));
                if (stream)
                    _mm256_stream_ps(out + j + k * h, v[k]);
                else
                    _mm256_storeu_ps(out + j + k * h, v[k]);
            }
        }
}

/* Strides HH_GROUP .. n/2 of x (the first pass done), the last pass writing to out with
 * its epilogue (mul or scale, top) as in wht_radix_pass; stream: out is 32-byte aligned and is
 * written with non-temporal stores (no read for ownership, for outputs beyond the cache). */
HH_INLINE void wht_rest_to(float *x, float *out, int64_t n, const float *mul, float scale, __m256i *top, int stream) {
    int64_t h = HH_GROUP;
    int left = 0;
    for (int64_t m = h; m < n; m <<= 1) left++;
    for (; left > 4; left -= 3, h <<= 3) /* radix 8 passes, then one of radix 1..16 */
        wht_radix_pass(x, x, n, h, 3, 0, 0.0f, 0, 0);
    switch (left) {
    case 0: wht_radix_pass(x, out, n, 8, 0, mul, scale, top, stream); break; /* n == HH_GROUP: the epilogue */
    case 1: wht_radix_pass(x, out, n, h, 1, mul, scale, top, stream); break;
    case 2: wht_radix_pass(x, out, n, h, 2, mul, scale, top, stream); break;
    case 3: wht_radix_pass(x, out, n, h, 3, mul, scale, top, stream); break;
    default: wht_radix_pass(x, out, n, h, 4, mul, scale, top, stream); break;
    }
}

HH_INLINE void wht_rest(float *x, float *out, int64_t n, const float *mul, float scale, __m256i *top, int stream) {
    if (stream)
        wht_rest_to(x, out, n, mul, scale, top, 1);
    else
        wht_rest_to(x, out, n, mul, scale, top, 0);
}

#define HH_SCRATCH 4096 /* floats: blocks up to this size go through an L1 scratch */

static inline int aligned32(const void *p) { return ((uintptr_t)p & 31) == 0; }

static inline uint32_t max_u32_x8(__m256i v) {
    uint32_t t[8], m = 0;
    _mm256_storeu_si256((__m256i *)t, v);
    for (int k = 0; k < 8; k++) m = t[k] > m ? t[k] : m;
    return m;
}
#endif

/* Adds the element hashes of y[0..count) (their 16-bit halves) into lo and hi: the
 * digest of a block's source values, index_hash the block's index term. */
static inline void digest_halves(const float *y, int64_t count, uint32_t index_hash, uint32_t *lo, uint32_t *hi) {
    for (int64_t i = 0; i < count; i++) {
        uint32_t u;
        memcpy(&u, y + i, 4);
        uint32_t h = mix32(u + index_hash + (uint32_t)i * HH_DIGEST_MUL);
        *lo += h & 0xFFFFu;
        *hi += h >> 16;
    }
}

/* The bits of layout.overflow_limit(block), 2^(126 - log2 B): a block maximum at or above it
 * (inf and NaN included: their bits sort above) counts as non-finite. */
static inline uint32_t overflow_bits(int64_t block) {
    int log2b = 0;
    while (((int64_t)1 << log2b) < block) log2b++;
    return (uint32_t)(253 - log2b) << 23;
}

/* -- stage 1 ---------------------------------------------------------------------- */
/* Rotated blocks [first_block, last_block) into blocks_out (float32, n_blocks x B), their
 * max |y| into maxima; returns through digest_out the sum of this range's element hashes
 * (mod 2^64; the caller reduces mod 2^48) and through nonfinite_out whether any rotated
 * value is not finite or too large to sum (overflow_bits). signs holds D (+-1), norm is float32(1/sqrt(B)), applied after the
 * butterflies. residual (float32, n_blocks x B, or NULL) is the error feedback that stage 3
 * adds: the flag covers it too, so y + residual, what the rank encodes, is flagged whenever
 * it is not finite (both below overflow_bits, their sum cannot overflow float32). */
void hh_prepare(const void *src, int dtype, int64_t numel, int64_t block, int64_t first_block,
                int64_t last_block, const float *signs, float norm, float *blocks_out, float *maxima,
                const float *residual, uint64_t *digest_out, int32_t *nonfinite_out) {
    uint64_t digest = 0;
    int32_t bad = 0;
    const uint32_t limit = overflow_bits(block);
#ifdef __AVX2__
    float scratch[HH_SCRATCH] __attribute__((aligned(32)));
    const int big = (last_block - first_block) * block * 4 >= HH_STREAM_BYTES && block <= HH_SCRATCH;
#endif
    for (int64_t b = first_block; b < last_block; b++) {
        float *y = blocks_out + b * block;
        int64_t start = b * block;
        int64_t count = numel - start < block ? numel - start : block;
        uint32_t index_hash = (uint32_t)start * HH_DIGEST_MUL + HH_DIGEST_SALT;
        uint32_t lo = 0, hi = 0; /* count <= 65536: sums of 16-bit halves cannot overflow */
        uint32_t top = 0;
#ifdef __AVX2__
        if (block >= HH_GROUP) {
            /* one read of the source: digest, signs and strides 1..16 in registers; the
             * max |y| rides on the last butterfly pass */
            const float *in = y;
            int hash = 1;
            if (dtype == HH_F32 && count == block) {
                in = (const float *)src + start;
            } else {
                load_f32(src, dtype, start, count, y);
                for (int64_t i = count; i < block; i++) y[i] = 0.0f;
                if (count < block) { /* the digest covers the tensor, not the padding */
                    hash = 0;
                    digest_halves(y, count, index_hash, &lo, &hi);
                }
            }
            /* large outputs: butterflies in scratch, the last pass streams to y */
            int stream = big && aligned32(y);
            float *x = stream ? scratch : y;
            if (hash)
                wht_first_pass(in, x, block, signs, 1, index_hash, &lo, &hi);
            else
                wht_first_pass(in, x, block, signs, 0, 0, 0, 0);
            __m256i tops = _mm256_setzero_si256();
            wht_rest(x, y, block, 0, norm, &tops, stream);
            top = max_u32_x8(tops);
        } else
#endif
        {
            load_f32(src, dtype, start, count, y);
            digest_halves(y, count, index_hash, &lo, &hi);
            for (int64_t i = 0; i < count; i++) y[i] *= signs[i];
            for (int64_t i = count; i < block; i++) y[i] = 0.0f;
            fwht(y, block);
            /* max |y| on the bit patterns: integer order is float order for |y|, and
             * inf/NaN (exponent all ones) sort above every finite value */
            for (int64_t i = 0; i < block; i++) {
                uint32_t u;
                y[i] *= norm;
                memcpy(&u, y + i, 4);
                u &= 0x7FFFFFFFu;
                top = u > top ? u : top;
            }
        }
        digest += (uint64_t)lo + ((uint64_t)hi << 16);
        memcpy(maxima + b, &top, 4);
        bad |= top >= limit;
        if (residual) {
            uint32_t rtop = 0;
            for (int64_t i = 0; i < block; i++) {
                uint32_t u;
                memcpy(&u, residual + b * block + i, 4);
                u &= 0x7FFFFFFFu;
                rtop = u > rtop ? u : rtop;
            }
            bad |= rtop >= limit;
        }
    }
#ifdef __AVX2__
    _mm_sfence(); /* the streamed stores are visible before the caller reads */
#endif
    *digest_out = digest;
    *nonfinite_out = bad;
}

/* -- stage 3 ---------------------------------------------------------------------- */
#define HH_TILE 1024

/* Where a rank draws its thresholds (rng.Stream): its private key, and for correlated
 * rounding L = strata_bits > 0, the table of (mix32(i + shared) >> (32 - L)) << (24 - L)
 * over a block (the strata already in place), the row key and its place among the strata. */
typedef struct {
    uint32_t key;
    const uint32_t *table;
    uint32_t row, strata_bits, offset;
} hh_stream;

/* rng.thresholds of coordinate i, whose stratum in place (before the mask) is strata:
 * U = (strata mod 2^24) & ~(2^(24 - L) - 1) | mix32(i + key) >> (8 + L), times 2^-24. */
static inline float threshold(const hh_stream *st, uint32_t i, uint32_t strata) {
    const uint32_t L = st->strata_bits;
    uint32_t u = mix32(i + st->key) >> (8 + L);
    if (L) u |= strata & (0xFFFFFFu & ~((1u << (24 - L)) - 1));
    return (float)(int32_t)u * 0x1p-24f;
}

/* Codes of coordinates [p, p + len) of one block: v = y (+ r); a = v + M; b = a * inv;
 * t = b + u; c = clamp(floor(t), 0, L - 1); residual_out = v - (c * step - M). The codes
 * go to lane `shift` of words[0, len) (lane 0 stores, the others OR in). base: the index
 * of coordinate p (the thresholds' counter). */
static inline __attribute__((always_inline)) void
round_segment_as(const float *y, const float *r, float *ro, float m, float top, const hh_stream *st, int64_t base,
                 int64_t len, int log2_block, void *words, int word_bits, int shift, const int correlated) {
    /* correlated: the stratum of coordinate base + i, in place, is table[i_in_block + i] + block_part */
    const uint32_t L = correlated ? st->strata_bits : 0;
    const uint32_t *table = L ? st->table + (base & (((int64_t)1 << log2_block) - 1)) : 0;
    const uint32_t block_part =
        L ? ((mix32((uint32_t)(base >> log2_block) + st->row) >> (32 - L)) + st->offset) << (24 - L) : 0;
    float inv = top / (m * 2.0f);
    if (!isfinite(inv)) inv = 0.0f;
    float step = (m * 2.0f) / top;
    if (!r) ro = 0; /* no residual in, none out */
    uint32_t *out32 = (uint32_t *)words;
    uint64_t *out64 = (uint64_t *)words;
    int64_t i = 0;
#ifdef __AVX2__
    {
        /* the scalar loop's operations, 8 at a time: max(c, 0) and min(top, c) are
         * `c >= 0 ? c : 0` and `c > top ? top : c`, NaN included (a NaN t gives code 0) */
        const __m256 m8 = _mm256_set1_ps(m), inv8 = _mm256_set1_ps(inv), step8 = _mm256_set1_ps(step);
        const __m256 top8 = _mm256_set1_ps(top), zero = _mm256_setzero_ps();
        const __m128i count = _mm_cvtsi32_si128(shift);
        __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int)((uint32_t)base + st->key)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256i eight = _mm256_set1_epi32(8);
        const __m128i keep = _mm_cvtsi32_si128(8 + (int)L);
        const __m256i block8 = _mm256_set1_epi32((int)block_part);
        const __m256i strata_mask = _mm256_set1_epi32((int)(0xFFFFFFu & ~((1u << (24 - L)) - 1)));
        const __m256 unit = _mm256_set1_ps(0x1p-24f);
        for (; i + 8 <= len; i += 8) {
            __m256 v = _mm256_loadu_ps(y + i);
            if (r) v = _mm256_add_ps(v, _mm256_loadu_ps(r + i));
            __m256i bits = _mm256_srl_epi32(mix32_x8(index), keep);
            if (correlated) {
                __m256i strata = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(table + i)), block8);
                bits = _mm256_or_si256(bits, _mm256_and_si256(strata, strata_mask));
            }
            __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(bits), unit);
            index = _mm256_add_epi32(index, eight);
            __m256 c = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_add_ps(v, m8), inv8), u));
            c = _mm256_min_ps(top8, _mm256_max_ps(c, zero)); /* maxps returns its second operand on NaN: 0 */
            if (ro) _mm256_storeu_ps(ro + i, _mm256_sub_ps(v, _mm256_sub_ps(_mm256_mul_ps(c, step8), m8)));
            __m256i codes = _mm256_cvttps_epi32(c);
            if (word_bits == 32) {
                __m256i *w = (__m256i *)(out32 + i);
                __m256i shifted = _mm256_sll_epi32(codes, count);
                _mm256_storeu_si256(w, shift ? _mm256_or_si256(_mm256_loadu_si256(w), shifted) : shifted);
            } else {
                __m256i *w = (__m256i *)(out64 + i);
                __m256i s0 = _mm256_sll_epi64(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(codes)), count);
                __m256i s1 = _mm256_sll_epi64(_mm256_cvtepu32_epi64(_mm256_extracti128_si256(codes, 1)), count);
                if (shift) {
                    s0 = _mm256_or_si256(_mm256_loadu_si256(w), s0);
                    s1 = _mm256_or_si256(_mm256_loadu_si256(w + 1), s1);
                }
                _mm256_storeu_si256(w, s0);
                _mm256_storeu_si256(w + 1, s1);
            }
        }
    }
#endif
    for (; i < len; i++) {
        float v = r ? y[i] + r[i] : y[i];
        float u = threshold(st, (uint32_t)(base + i), table ? table[i] + block_part : 0);
        float c = floorf((v + m) * inv + u);
        c = c >= 0.0f ? c : 0.0f; /* NaN: 0, as every backend */
        c = c > top ? top : c;
        if (ro) ro[i] = v - (c * step - m);
        uint32_t code = (uint32_t)(int32_t)c;
        if (word_bits == 32)
            out32[i] = shift ? out32[i] | code << shift : code;
        else
            out64[i] = shift ? out64[i] | (uint64_t)code << shift : code;
    }
}

/* The two modes compiled apart: independent rounding pays nothing for correlated's. */
static void round_segment(const float *y, const float *r, float *ro, float m, float top, const hh_stream *st,
                          int64_t base, int64_t len, int log2_block, void *words, int word_bits, int shift) {
    if (st->strata_bits)
        round_segment_as(y, r, ro, m, top, st, base, len, log2_block, words, word_bits, shift, 1);
    else
        round_segment_as(y, r, ro, m, top, st, base, len, log2_block, words, word_bits, shift, 0);
}

/* Words [first_word, last_word) of the planar lane layout: lane j of word i holds the code
 * of coordinate j * n_words + i, rounded by round_segment; a tile of words stays in L1
 * while the lanes are ORed in. */
void hh_quantize(const float *blocks, const float *residual, float *residual_out, const float *maxima,
                 int64_t count, int log2_block, int levels, uint32_t key, const uint32_t *table, uint32_t row, int strata_bits, uint32_t offset, int64_t n_words, int lanes, int width, int word_bits, int64_t first_word,
                 int64_t last_word, void *words) {
    const float top = (float)(levels - 1);
    const hh_stream st = {key, table, row, (uint32_t)strata_bits, offset};
    const int word_bytes = word_bits / 8;
    for (int64_t w0 = first_word; w0 < last_word; w0 += HH_TILE) {
        int64_t tile = last_word - w0 < HH_TILE ? last_word - w0 : HH_TILE;
        char *tile_words = (char *)words + w0 * word_bytes;
        for (int lane = 0; lane < lanes; lane++) {
            int shift = lane * width;
            int64_t p0 = lane * n_words + w0;
            int64_t p_end = p0 + tile < count ? p0 + tile : count;
            int64_t p = p0;
            while (p < p_end) {
                int64_t b = p >> log2_block;
                int64_t seg_end = (b + 1) << log2_block;
                if (seg_end > p_end) seg_end = p_end;
                round_segment(blocks + p, residual ? residual + p : 0, residual_out ? residual_out + p : 0,
                              maxima[b], top, &st, p, seg_end - p, log2_block, tile_words + (p - p0) * word_bytes,
                              word_bits, shift);
                p = seg_end;
            }
            int64_t filled = p_end > p0 ? p_end - p0 : 0;
            if (lane == 0 && filled < tile) /* padding codes */
                memset(tile_words + filled * word_bytes, 0, (size_t)(tile - filled) * word_bytes);
        }
    }
}

/* -- stage 5 ---------------------------------------------------------------------- */
/* Block b of one message's lane values c -> c * scale - m, into work[0, B) (accumulate:
 * added to what work holds, elementwise). */
static void dequantize_block(const void *words, int word_bits, int64_t n_words, int width, int64_t b,
                             int64_t block, float scale, float m, float *work, int accumulate) {
    const uint64_t mask = ((uint64_t)1 << width) - 1;
    int64_t p = b * block, p_end = p + block;
    while (p < p_end) {
        int64_t lane = p / n_words;
        int64_t i0 = p - lane * n_words;
        int64_t len = n_words - i0 < p_end - p ? n_words - i0 : p_end - p;
        int shift = (int)lane * width;
        float *dst = work + (p - b * block);
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 scale8 = _mm256_set1_ps(scale), m8 = _mm256_set1_ps(m);
        const __m128i count = _mm_cvtsi32_si128(shift);
        if (word_bits == 32) {
            const __m256i mk = _mm256_set1_epi32((int)mask);
            for (; i + 8 <= len; i += 8) {
                __m256i w = _mm256_loadu_si256((const __m256i *)((const uint32_t *)words + i0 + i));
                __m256i c = _mm256_and_si256(_mm256_srl_epi32(w, count), mk);
                __m256 v = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c), scale8), m8);
                _mm256_storeu_ps(dst + i, accumulate ? _mm256_add_ps(_mm256_loadu_ps(dst + i), v) : v);
            }
        } else {
            const __m256i mk = _mm256_set1_epi64x((int64_t)mask);
            const __m256i evens = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
            for (; i + 8 <= len; i += 8) {
                const uint64_t *w = (const uint64_t *)words + i0 + i;
                __m256i c0 = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)w), count), mk);
                __m256i c1 = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)(w + 4)), count), mk);
                /* codes < 2^31: their low halves, in order */
                __m128i l0 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c0, evens));
                __m128i l1 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c1, evens));
                __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(l0), l1, 1);
                __m256 v = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c), scale8), m8);
                _mm256_storeu_ps(dst + i, accumulate ? _mm256_add_ps(_mm256_loadu_ps(dst + i), v) : v);
            }
        }
#endif
        if (word_bits == 32) {
            const uint32_t *w = (const uint32_t *)words + i0;
            uint32_t mk = (uint32_t)mask;
            for (; i < len; i++) {
                float v = (float)(int32_t)((w[i] >> shift) & mk) * scale - m;
                dst[i] = accumulate ? dst[i] + v : v;
            }
        } else {
            const uint64_t *w = (const uint64_t *)words + i0;
            for (; i < len; i++) {
                float v = (float)(int64_t)((w[i] >> shift) & mask) * scale - m;
                dst[i] = accumulate ? dst[i] + v : v;
            }
        }
        p += len;
    }
}

/* Block b's rotated mean in work -> D H work / sqrt(B) (signs holds D / sqrt(B)) ->
 * out[b * B, ...) cropped to numel, in its dtype (big: stream whole fp32 blocks past the cache). */
static void unrotate_block(float *work, int64_t b, int64_t block, int64_t numel, const float *signs, void *out,
                           int out_dtype, int big) {
    int64_t start = b * block;
    int64_t count = numel - start < block ? numel - start : block;
#ifdef __AVX2__
    if (block >= HH_GROUP) {
        /* the sign diagonal and, for whole fp32 blocks, the store ride on the last pass */
        int direct = out_dtype == HH_F32 && count == block;
        float *dst = direct ? (float *)out + start : work;
        wht_first_pass(work, work, block, 0, 0, 0, 0, 0);
        wht_rest(work, dst, block, signs, 0.0f, 0, direct && big && aligned32(dst));
        if (!direct) store_from_f32(out, out_dtype, start, count, work);
        return;
    }
#else
    (void)big;
#endif
    fwht(work, block);
    for (int64_t i = 0; i < block; i++) work[i] *= signs[i];
    store_from_f32(out, out_dtype, start, count, work);
}

/* Blocks [first_block, last_block) of one summed message: lane sums S -> S * (step / n) - M
 * -> the inverse rotation -> out[:numel] in its dtype. work: B floats. */
void hh_decode(const void *words, int word_bits, int64_t n_words, int width,
               const float *maxima, int levels, int world_size, int64_t numel, int64_t block,
               const float *signs, int64_t first_block, int64_t last_block, void *out, int out_dtype,
               float *work) {
    const float top = (float)(levels - 1);
    const float n = (float)world_size;
    const int big = (last_block - first_block) * block * 4 >= HH_STREAM_BYTES;
    for (int64_t b = first_block; b < last_block; b++) {
        float m = maxima[b];
        dequantize_block(words, word_bits, n_words, width, b, block, ((m * 2.0f) / top) / n, m, work, 0);
        unrotate_block(work, b, block, numel, signs, out, out_dtype, big);
    }
#ifdef __AVX2__
    _mm_sfence(); /* the streamed stores are visible before the caller reads */
#endif
}

/* Blocks [first_block, last_block) of `messages` one-rank messages (gathered scales),
 * message r's words at words + r * stride_words (words), its maxima at maxima + r *
 * stride_floats: sum over r in rank order, from 0, of c * step_r - M_r, divided by the
 * count, then the inverse rotation -> out[:numel] in its dtype. work: B floats. */
void hh_decode_gathered(const void *words, int word_bits, int64_t n_words, int64_t stride_words, int width,
                        const float *maxima, int64_t stride_floats, int levels, int messages, int64_t numel,
                        int64_t block, const float *signs, int64_t first_block, int64_t last_block, void *out,
                        int out_dtype, float *work) {
    const float top = (float)(levels - 1);
    const float n = (float)messages;
    const int64_t word_bytes = word_bits / 8;
    const int big = (last_block - first_block) * block * 4 >= HH_STREAM_BYTES;
    for (int64_t b = first_block; b < last_block; b++) {
        for (int64_t i = 0; i < block; i++) work[i] = 0.0f;
        for (int r = 0; r < messages; r++) {
            float m = maxima[r * stride_floats + b];
            const char *own = (const char *)words + r * stride_words * word_bytes;
            dequantize_block(own, word_bits, n_words, width, b, block, (m * 2.0f) / top, m, work, 1);
        }
        for (int64_t i = 0; i < block; i++) work[i] = work[i] / n;
        unrotate_block(work, b, block, numel, signs, out, out_dtype, big);
    }
#ifdef __AVX2__
    _mm_sfence(); /* the streamed stores are visible before the caller reads */
#endif
}
