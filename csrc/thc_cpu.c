/* Fused CPU stages of the THC codec (hhook/cpu_kernels.py compiles and loads this file).
 *
 * Each function does one stage over a range of blocks or words, so that Python threads
 * can split a tensor (ctypes releases the GIL). The pure-torch codec in hhook/codec.py is
 * the specification; quantization reproduces its float32 operations in the same order,
 * so the file must be compiled without floating-point contraction or fast-math
 * (-fno-trapping-math only lets the clamps vectorize; it changes no value).
 *
 *   hh_prepare:  load (fp32/fp16/bf16) + digest of the float32 bits + sign diagonal
 *                + Walsh-Hadamard transform + per-block max |y|, rotated blocks out.
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
static void fwht_small(float *x, int64_t n) {
    /* strides 1, 2 and 4: one 8-point transform per group of 8 (or less for n < 8) */
#ifdef __AVX2__
    if (n >= 8) {
        const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
        const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
        const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
        for (int64_t i = 0; i < n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            v = _mm256_add_ps(_mm256_mul_ps(v, s1), _mm256_permute_ps(v, 0xB1));
            v = _mm256_add_ps(_mm256_mul_ps(v, s2), _mm256_permute_ps(v, 0x4E));
            v = _mm256_add_ps(_mm256_mul_ps(v, s4), _mm256_permute2f128_ps(v, v, 1));
            _mm256_storeu_ps(x + i, v);
        }
        return;
    }
#endif
    for (int64_t h = 1; h < n && h < 8; h <<= 1)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

static void fwht(float *x, int64_t n) {
    fwht_small(x, n);
    int64_t h = 8;
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

/* -- stage 1 ---------------------------------------------------------------------- */
/* Rotated blocks [first_block, last_block) into blocks_out (float32, n_blocks x B), their
 * max |y| into maxima; returns through digest_out the sum of this range's element hashes
 * (mod 2^64; the caller reduces mod 2^48) and through nonfinite_out whether any rotated
 * value is not finite. signs holds D / sqrt(B). */
void hh_prepare(const void *src, int dtype, int64_t numel, int64_t block, int64_t first_block,
                int64_t last_block, const float *signs, float *blocks_out, float *maxima,
                uint64_t *digest_out, int32_t *nonfinite_out) {
    uint64_t digest = 0;
    int32_t bad = 0;
    for (int64_t b = first_block; b < last_block; b++) {
        float *y = blocks_out + b * block;
        int64_t start = b * block;
        int64_t count = numel - start < block ? numel - start : block;
        load_f32(src, dtype, start, count, y);
        uint32_t index_hash = (uint32_t)start * HH_DIGEST_MUL + HH_DIGEST_SALT;
        uint32_t lo = 0, hi = 0; /* count <= 65536: sums of 16-bit halves cannot overflow */
        for (int64_t i = 0; i < count; i++) {
            uint32_t u;
            memcpy(&u, y + i, 4);
            uint32_t h = mix32(u + index_hash + (uint32_t)i * HH_DIGEST_MUL);
            lo += h & 0xFFFFu;
            hi += h >> 16;
            y[i] *= signs[i];
        }
        digest += (uint64_t)lo + ((uint64_t)hi << 16);
        for (int64_t i = count; i < block; i++) y[i] = 0.0f;
        fwht(y, block);
        /* max |y| on the bit patterns: integer order is float order for |y|, and inf/NaN
         * (exponent all ones) sort above every finite value */
        uint32_t top = 0;
        for (int64_t i = 0; i < block; i++) {
            uint32_t u;
            memcpy(&u, y + i, 4);
            u &= 0x7FFFFFFFu;
            top = u > top ? u : top;
        }
        memcpy(maxima + b, &top, 4);
        bad |= top >= 0x7F800000u;
    }
    *digest_out = digest;
    *nonfinite_out = bad;
}

/* -- stage 3 ---------------------------------------------------------------------- */
#define HH_TILE 1024

/* Codes of coordinates [p, p + len) of one block: v = y (+ r); a = v + M; b = a * inv;
 * t = b + u; c = clamp(floor(t), 0, L - 1); residual_out = v - (c * step - M). */
static void round_segment(const float *y, const float *r, float *ro, float m, float top, uint32_t base,
                          int64_t len, uint32_t *codes) {
    float inv = top / (m * 2.0f);
    if (!isfinite(inv)) inv = 0.0f;
    float step = (m * 2.0f) / top;
    if (r) {
        for (int64_t i = 0; i < len; i++) {
            float v = y[i] + r[i];
            float u = (float)(int32_t)(mix32(base + (uint32_t)i) >> 8) * 0x1p-24f;
            float c = floorf((v + m) * inv + u);
            c = c < 0.0f ? 0.0f : c;
            c = c > top ? top : c;
            ro[i] = v - (c * step - m);
            codes[i] = (uint32_t)(int32_t)c;
        }
    } else {
        for (int64_t i = 0; i < len; i++) {
            float u = (float)(int32_t)(mix32(base + (uint32_t)i) >> 8) * 0x1p-24f;
            float c = floorf((y[i] + m) * inv + u);
            c = c < 0.0f ? 0.0f : c;
            c = c > top ? top : c;
            codes[i] = (uint32_t)(int32_t)c;
        }
    }
}

/* Words [first_word, last_word) of the planar lane layout: lane j of word i holds the code
 * of coordinate j * n_words + i, rounded by round_segment. */
void hh_quantize(const float *blocks, const float *residual, float *residual_out, const float *maxima,
                 int64_t count, int log2_block, int levels, uint32_t key, int64_t n_words, int lanes,
                 int width, int word_bits, int64_t first_word, int64_t last_word, void *words) {
    const float top = (float)(levels - 1);
    uint32_t codes[HH_TILE];
    for (int64_t w0 = first_word; w0 < last_word; w0 += HH_TILE) {
        int64_t tile = last_word - w0 < HH_TILE ? last_word - w0 : HH_TILE;
        uint32_t *out32 = (uint32_t *)words + w0;
        uint64_t *out64 = (uint64_t *)words + w0;
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
                              maxima[b], top, (uint32_t)p + key, seg_end - p, codes + (p - p0));
                p = seg_end;
            }
            int64_t filled = p_end > p0 ? p_end - p0 : 0;
            for (int64_t i = filled; i < tile; i++) codes[i] = 0; /* padding codes */
            if (word_bits == 32) {
                if (lane == 0)
                    for (int64_t i = 0; i < tile; i++) out32[i] = codes[i];
                else
                    for (int64_t i = 0; i < tile; i++) out32[i] |= codes[i] << shift;
            } else {
                if (lane == 0)
                    for (int64_t i = 0; i < tile; i++) out64[i] = codes[i];
                else
                    for (int64_t i = 0; i < tile; i++) out64[i] |= (uint64_t)codes[i] << shift;
            }
        }
    }
}

/* -- stage 5 ---------------------------------------------------------------------- */
/* Blocks [first_block, last_block): lane sums S -> S * (step / n) - M -> D H y / sqrt(B)
 * (signs holds D / sqrt(B)) -> out[:numel] in its dtype. work: B floats. */
void hh_decode(const void *words, int word_bits, int64_t n_words, int width,
               const float *maxima, int levels, int world_size, int64_t numel, int64_t block,
               const float *signs, int64_t first_block, int64_t last_block, void *out, int out_dtype,
               float *work) {
    const uint64_t mask = ((uint64_t)1 << width) - 1;
    const float top = (float)(levels - 1);
    const float n = (float)world_size;
    for (int64_t b = first_block; b < last_block; b++) {
        float m = maxima[b];
        float scale = ((m * 2.0f) / top) / n;
        int64_t p = b * block, p_end = p + block;
        while (p < p_end) {
            int64_t lane = p / n_words;
            int64_t i0 = p - lane * n_words;
            int64_t len = n_words - i0 < p_end - p ? n_words - i0 : p_end - p;
            int shift = (int)lane * width;
            float *dst = work + (p - b * block);
            if (word_bits == 32) {
                const uint32_t *w = (const uint32_t *)words + i0;
                uint32_t mk = (uint32_t)mask;
                for (int64_t i = 0; i < len; i++) dst[i] = (float)(int32_t)((w[i] >> shift) & mk) * scale - m;
            } else {
                const uint64_t *w = (const uint64_t *)words + i0;
                for (int64_t i = 0; i < len; i++) dst[i] = (float)(int64_t)((w[i] >> shift) & mask) * scale - m;
            }
            p += len;
        }
        fwht(work, block);
        for (int64_t i = 0; i < block; i++) work[i] *= signs[i];
        int64_t start = b * block;
        int64_t count = numel - start < block ? numel - start : block;
        store_from_f32(out, out_dtype, start, count, work);
    }
}
