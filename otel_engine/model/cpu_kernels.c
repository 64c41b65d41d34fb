/* CPU kernels for the parts of a decoder layer that are not matmuls.
 *
 * Compiled on the machine that runs them (otel_engine/model/kernels.py: cc -O3
 * -march=native -fopenmp) and called through ctypes with raw pointers, one call per
 * operation: each replaces a chain of small torch ops whose dispatch cost dominates a
 * decode step on a small CPU. Every function exists for float32 (suffix _f32) and bfloat16
 * (_bf16, stored as uint16); arithmetic is float32 throughout, rounded once on store (round
 * to nearest even, as torch does). With AVX-512 the loops run 16 lanes at a time (masked
 * tails, any length); without it, the same loops run one element at a time.
 *
 * Layouts (all row-major, contiguous):
 *   hidden, delta, out    [rows, width]
 *   qkv                   [tokens, (num_heads + 2 * num_kv_heads) * head_dim]
 *   k_cache, v_cache      [num_kv_heads, num_slots, head_dim], slot = block * block_size + offset
 *   cos_sin               [max_positions, head_dim] float32: per row the cos of each of the
 *                         head_dim / 2 frequencies, then their sin
 *   block_tables          [batch, max_blocks] int32; seq_lens [batch] int32
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#define LANES 16
#else
#define LANES 1
#endif

typedef uint16_t bf16;

/* ---- scalar load/store ------------------------------------------------------------------ */

static inline float load1_f32(const float *p) { return *p; }
static inline void store1_f32(float *p, float v) { *p = v; }
static inline float load1_bf16(const bf16 *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}
static inline void store1_bf16(bf16 *p, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN stays a (quiet) NaN */
        *p = (bf16)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *p = (bf16)(bits >> 16);
}

#ifdef __AVX512F__
/* ---- 16-lane load/store, masked: lanes past n read 0 and are not written ------------------ */

typedef __m512 vec;
static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}
static inline vec load_f32(const float *p, int64_t n) {
    return _mm512_maskz_loadu_ps(tail_mask(n), p);
}
static inline void store_f32(float *p, vec v, int64_t n) {
    _mm512_mask_storeu_ps(p, tail_mask(n), v);
}
static inline vec load_bf16(const bf16 *p, int64_t n) {
    __m256i half = _mm256_maskz_loadu_epi16(tail_mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
static inline void store_bf16(bf16 *p, vec v, int64_t n) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_mask_storeu_epi16(p, tail_mask(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
/* e^x for x <= 0 (softmax, sigmoid): Cephes-style range reduction and a degree-6 polynomial,
 * relative error about 2e-7; x below -87 gives 0. */
static inline vec exp_vec(vec x) {
    const vec log2e = _mm512_set1_ps(1.44269504088896341f);
    const vec ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
    vec r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    vec p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}
/* lanes past n set to 0 */
static inline vec keep(vec x, int64_t n) { return _mm512_maskz_mov_ps(tail_mask(n), x); }
#define ZERO() _mm512_setzero_ps()
#define ADD(a, b) _mm512_add_ps(a, b)
#define MUL(a, b) _mm512_mul_ps(a, b)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET(x) _mm512_set1_ps(x)
#define HSUM(a) _mm512_reduce_add_ps(a)
#else
typedef float vec;
static inline vec load_f32(const float *p, int64_t n) { (void)n; return *p; }
static inline void store_f32(float *p, vec v, int64_t n) { (void)n; *p = v; }
static inline vec load_bf16(const bf16 *p, int64_t n) { (void)n; return load1_bf16(p); }
static inline void store_bf16(bf16 *p, vec v, int64_t n) { (void)n; store1_bf16(p, v); }
static inline vec exp_vec(vec x) { return expf(x); }
static inline vec keep(vec x, int64_t n) { (void)n; return x; }
#define ZERO() 0.0f
#define ADD(a, b) ((a) + (b))
#define MUL(a, b) ((a) * (b))
#define FMA(a, b, c) ((a) * (b) + (c))
#define SET(x) (x)
#define HSUM(a) (a)
#endif

#define MAX_BLOCK_SIZE 256
/* decode attention specialised for head_dim 64 and a group size known at compile time */
#define DECODE_CASE(SUFFIX, G)                                                                   \
    case G:                                                                                      \
        decode_item_##SUFFIX(out, qkv, k_cache, v_cache, table, len, b, kvh, num_heads, G, 64,   \
                             block_size, num_slots, qkv_width, scale);                           \
        break;
#define CHUNK(n, i) ((n) - (i) < LANES ? (n) - (i) : LANES)

#define DEFINE_KERNELS(T, SUFFIX)                                                                \
                                                                                                 \
/* hidden += delta (when delta is given); out = weight * normalize(hidden), RMSNorm. */          \
void add_rms_norm_##SUFFIX(T *restrict hidden, const T *restrict delta,                          \
                           const T *restrict weight, T *restrict out, int64_t rows,              \
                           int64_t width, float eps) {                                           \
    _Pragma("omp parallel for if (rows > 8)")                                                    \
    for (int64_t r = 0; r < rows; r++) {                                                         \
        T *h = hidden + r * width;                                                               \
        vec squares = ZERO();                                                                    \
        for (int64_t i = 0; i < width; i += LANES) {                                             \
            const int64_t n = CHUNK(width, i);                                                   \
            vec x = load_##SUFFIX(h + i, n);                                                     \
            if (delta) {                                                                         \
                store_##SUFFIX(h + i, ADD(x, load_##SUFFIX(delta + r * width + i, n)), n);       \
                x = load_##SUFFIX(h + i, n); /* as rounded in the residual stream */             \
            }                                                                                    \
            squares = FMA(x, x, squares);                                                        \
        }                                                                                        \
        const vec inv = SET(1.0f / sqrtf(HSUM(squares) / (float)width + eps));                   \
        T *o = out + r * width;                                                                  \
        for (int64_t i = 0; i < width; i += LANES) {                                             \
            const int64_t n = CHUNK(width, i);                                                   \
            store_##SUFFIX(o + i, MUL(load_##SUFFIX(h + i, n), inv), n);                         \
            store_##SUFFIX(o + i, MUL(load_##SUFFIX(weight + i, n), load_##SUFFIX(o + i, n)), n); \
        }                                                                                        \
    }                                                                                            \
}                                                                                                \
                                                                                                 \
/* Rotary embedding (rotate-half layout) on the q and k heads of qkv, in place, then the k   */  \
/* and v heads written to their cache slots.                                                 */  \
void rope_and_cache_##SUFFIX(T *restrict qkv, const float *restrict cos_sin,                     \
                             const int64_t *restrict positions,                                  \
                             const int64_t *restrict slots, T *restrict k_cache,                 \
                             T *restrict v_cache, int64_t tokens, int64_t num_heads,             \
                             int64_t num_kv_heads, int64_t head_dim, int64_t num_slots) {        \
    const int64_t half = head_dim / 2;                                                           \
    const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;                             \
    const int64_t rotated = num_heads + num_kv_heads;                                            \
    _Pragma("omp parallel for if (tokens > 4)")                                                  \
    for (int64_t t = 0; t < tokens; t++) {                                                       \
        T *row = qkv + t * width;                                                                \
        const float *cs = cos_sin + positions[t] * head_dim;                                     \
        for (int64_t h = 0; h < rotated; h++) {                                                  \
            T *x = row + h * head_dim;                                                           \
            for (int64_t i = 0; i < half; i += LANES) {                                          \
                const int64_t n = CHUNK(half, i);                                                \
                const vec a = load_##SUFFIX(x + i, n), b = load_##SUFFIX(x + half + i, n);       \
                const vec c = load_f32(cs + i, n), s = load_f32(cs + half + i, n);               \
                store_##SUFFIX(x + i, FMA(a, c, MUL(SET(-1.0f), MUL(b, s))), n);                 \
                store_##SUFFIX(x + half + i, FMA(b, c, MUL(a, s)), n);                           \
            }                                                                                    \
        }                                                                                        \
        const int64_t slot = slots[t];                                                           \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                             \
            memcpy(k_cache + (h * num_slots + slot) * head_dim,                                  \
                   row + (num_heads + h) * head_dim, head_dim * sizeof(T));                      \
            memcpy(v_cache + (h * num_slots + slot) * head_dim,                                  \
                   row + (rotated + h) * head_dim, head_dim * sizeof(T));                        \
        }                                                                                        \
    }                                                                                            \
}                                                                                                \
                                                                                                 \
/* One (sequence, KV head) of decode attention; head_dim is a constant where it is called  */  \
/* with one, so that the loops over it unroll and q stays in registers.                    */  \
static inline __attribute__((always_inline)) void decode_item_##SUFFIX(                         \
    T *restrict out, const T *restrict qkv, const T *restrict k_cache,                          \
    const T *restrict v_cache, const int32_t *restrict table, int64_t len, int64_t b,           \
    int64_t kvh, int64_t num_heads, const int64_t group, const int64_t head_dim,                 \
    int64_t block_size, int64_t num_slots, int64_t qkv_width, float scale) {                     \
    float q[group][head_dim], acc[group][head_dim];                                              \
    float run_max[group], run_sum[group], rescales[group], scores[group][block_size];            \
    const int64_t chunks = (head_dim + LANES - 1) / LANES;                                       \
    for (int64_t g = 0; g < group; g++) {                                                        \
        const T *qh = qkv + b * qkv_width + (kvh * group + g) * head_dim;                        \
        for (int64_t d = 0; d < head_dim; d++) {                                                 \
            q[g][d] = load1_##SUFFIX(qh + d) * scale;                                            \
            acc[g][d] = 0.0f;                                                                    \
        }                                                                                        \
        run_max[g] = -INFINITY;                                                                  \
        run_sum[g] = 0.0f;                                                                       \
    }                                                                                            \
    const T *keys = k_cache + kvh * num_slots * head_dim;                                        \
    const T *values = v_cache + kvh * num_slots * head_dim;                                      \
    for (int64_t start = 0; start < len; start += block_size) {                                  \
        const int64_t block = table[start / block_size];                                         \
        const int64_t count = len - start < block_size ? len - start : block_size;               \
        const T *kb = keys + block * block_size * head_dim;                                      \
        const T *vb = values + block * block_size * head_dim;                                    \
        if (start + block_size < len) { /* blocks are scattered: fetch the next one early */     \
            const int64_t next = table[start / block_size + 1] * block_size * head_dim;          \
            for (int64_t byte = 0; byte < block_size * head_dim * (int64_t)sizeof(T); byte += 64) { \
                __builtin_prefetch((const char *)(keys + next) + byte);                          \
                __builtin_prefetch((const char *)(values + next) + byte);                        \
            }                                                                                    \
        }                                                                                        \
        for (int64_t j = 0; j < count; j++) {                                                    \
            vec dots[group];                                                                     \
            for (int64_t g = 0; g < group; g++) dots[g] = ZERO();                                \
            for (int64_t d = 0; d < head_dim; d += LANES) {                                      \
                const int64_t n = CHUNK(head_dim, d);                                            \
                const vec k = load_##SUFFIX(kb + j * head_dim + d, n);                           \
                for (int64_t g = 0; g < group; g++)                                              \
                    dots[g] = FMA(load_f32(&q[g][d], n), k, dots[g]);                            \
            }                                                                                    \
            for (int64_t g = 0; g < group; g++) scores[g][j] = HSUM(dots[g]);                    \
        }                                                                                        \
        for (int64_t g = 0; g < group; g++) {                                                    \
            float block_max = -INFINITY;                                                         \
            for (int64_t j = 0; j < count; j++)                                                  \
                block_max = scores[g][j] > block_max ? scores[g][j] : block_max;                 \
            const float new_max = block_max > run_max[g] ? block_max : run_max[g];               \
            const float rescale = expf(run_max[g] - new_max);                                    \
            run_max[g] = new_max;                                                                \
            float total = 0.0f;                                                                  \
            for (int64_t j = 0; j < count; j += LANES) {                                         \
                const int64_t n = CHUNK(count, j);                                               \
                const vec p = keep(exp_vec(ADD(load_f32(&scores[g][j], n), SET(-new_max))), n);  \
                store_f32(&scores[g][j], p, n);                                                  \
                total += HSUM(p);                                                                \
            }                                                                                    \
            run_sum[g] = run_sum[g] * rescale + total;                                           \
            rescales[g] = rescale;                                                               \
        }                                                                                        \
        /* acc = acc * rescale + p @ V: each V row loaded once for every head of the group */   \
        vec sums[group][chunks];                                                                 \
        for (int64_t g = 0; g < group; g++)                                                      \
            for (int64_t c = 0; c < chunks; c++)                                                 \
                sums[g][c] = MUL(load_f32(&acc[g][c * LANES], CHUNK(head_dim, c * LANES)),       \
                                 SET(rescales[g]));                                              \
        for (int64_t j = 0; j < count; j++) {                                                    \
            vec weights[group];                                                                  \
            for (int64_t g = 0; g < group; g++) weights[g] = SET(scores[g][j]);                  \
            for (int64_t c = 0; c < chunks; c++) {                                               \
                const vec v = load_##SUFFIX(vb + j * head_dim + c * LANES,                       \
                                            CHUNK(head_dim, c * LANES));                         \
                for (int64_t g = 0; g < group; g++) sums[g][c] = FMA(weights[g], v, sums[g][c]); \
            }                                                                                    \
        }                                                                                        \
        for (int64_t g = 0; g < group; g++)                                                      \
            for (int64_t c = 0; c < chunks; c++)                                                 \
                store_f32(&acc[g][c * LANES], sums[g][c], CHUNK(head_dim, c * LANES));           \
    }                                                                                            \
    for (int64_t g = 0; g < group; g++) {                                                        \
        T *o = out + (b * num_heads + kvh * group + g) * head_dim;                               \
        const vec inv = SET(run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f);                       \
        for (int64_t d = 0; d < head_dim; d += LANES) {                                          \
            const int64_t n = CHUNK(head_dim, d);                                                \
            store_##SUFFIX(o + d, MUL(load_f32(&acc[g][d], n), inv), n);                         \
        }                                                                                        \
    }                                                                                            \
}                                                                                                \
                                                                                                 \
/* One query token per sequence against its cached keys and values (paged), every query   */    \
/* head of a group sharing its KV head: online softmax, one pass over the cache.          */    \
void decode_attention_##SUFFIX(T *restrict out, const T *restrict qkv,                           \
                               const T *restrict k_cache, const T *restrict v_cache,             \
                               const int32_t *restrict block_tables,                             \
                               const int32_t *restrict seq_lens, int64_t batch,                  \
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,        \
                               int64_t block_size, int64_t max_blocks, int64_t num_slots,        \
                               int64_t qkv_width, float scale) {                                 \
    const int64_t group = num_heads / num_kv_heads;                                              \
    _Pragma("omp parallel for schedule(dynamic) if (batch * num_kv_heads > 1)")                  \
    for (int64_t work = 0; work < batch * num_kv_heads; work++) {                                \
        const int64_t b = work / num_kv_heads, kvh = work % num_kv_heads;                        \
        const int32_t *table = block_tables + b * max_blocks;                                    \
        const int64_t len = seq_lens[b];                                                         \
        switch (head_dim == 64 && group <= 8 ? group : 0) {                                      \
        DECODE_CASE(SUFFIX, 1) DECODE_CASE(SUFFIX, 2) DECODE_CASE(SUFFIX, 3)                     \
        DECODE_CASE(SUFFIX, 4) DECODE_CASE(SUFFIX, 5) DECODE_CASE(SUFFIX, 6)                     \
        DECODE_CASE(SUFFIX, 7) DECODE_CASE(SUFFIX, 8)                                            \
        default:                                                                                 \
            decode_item_##SUFFIX(out, qkv, k_cache, v_cache, table, len, b, kvh, num_heads,      \
                                 group, head_dim, block_size, num_slots, qkv_width, scale);      \
        }                                                                                        \
    }                                                                                            \
}                                                                                                \
                                                                                                 \
/* out[r] = silu(gate[r]) * up[r], with gate_up[r] = [gate | up] (the fused projection);    */  \
/* the activation is rounded to T before the product, as torch does.                       */  \
void silu_mul_##SUFFIX(T *restrict out, const T *restrict gate_up, int64_t rows,                 \
                       int64_t width) {                                                          \
    _Pragma("omp parallel for if (rows > 8)")                                                    \
    for (int64_t r = 0; r < rows; r++) {                                                         \
        const T *gate = gate_up + r * 2 * width, *up = gate + width;                             \
        T *o = out + r * width;                                                                  \
        for (int64_t i = 0; i < width; i += LANES) {                                             \
            const int64_t n = CHUNK(width, i);                                                   \
            const vec x = load_##SUFFIX(gate + i, n);                                            \
            /* silu(x) = x * sigmoid(x), with e^-|x| only (no overflow) */                       \
            const vec e = exp_vec(MUL(SET(-1.0f), abs_vec(x)));                                  \
            const vec sig = select_pos(x, div_vec(SET(1.0f), ADD(SET(1.0f), e)),                 \
                                       div_vec(e, ADD(SET(1.0f), e)));                           \
            store_##SUFFIX(o + i, MUL(x, sig), n);                                               \
            store_##SUFFIX(o + i, MUL(load_##SUFFIX(o + i, n), load_##SUFFIX(up + i, n)), n);    \
        }                                                                                        \
    }                                                                                            \
}

#ifdef __AVX512F__
static inline vec abs_vec(vec x) { return _mm512_abs_ps(x); }
static inline vec div_vec(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec select_pos(vec x, vec if_pos, vec if_neg) {
    return _mm512_mask_mov_ps(if_neg, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ),
                              if_pos);
}
#else
static inline vec abs_vec(vec x) { return fabsf(x); }
static inline vec div_vec(vec a, vec b) { return a / b; }
static inline vec select_pos(vec x, vec if_pos, vec if_neg) { return x >= 0.0f ? if_pos : if_neg; }
#endif

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(bf16, bf16)

/* ---- 4-bit weights, bfloat16 activations (AVX-512 BF16) -------------------------------------
 *
 * out[M, N] (bfloat16) = x[M, K] @ W.T for a matrix stored as a GGUF Q4_0/Q4_1 file stores it:
 * W[n, k] = d[n, g] * q[n, k] + m[n, g] per group g of 32 weights along a row, q in 0..15.
 * Per group, with q - 8 exact in bfloat16 (the activations stay as they are):
 *     sum_k x[k] W[n, k] = d[n, g] * sum_k x[k] (q[n, k] - 8) + (m + 8d)[n, g] * sum_k x[k]
 * the inner sum by vdpbf16ps in float32, the rest in float32, rounded to bfloat16 once. For a
 * few rows a step is bound by reading the weights, and these are a quarter of bfloat16's
 * bytes. Every row is computed the same way whatever the other rows are.
 *
 * Packed weights (llama.py `_pack_int4`): per block of 16 output rows of W, per group, 256
 * bytes: byte (j, c, e) of the j-th 32 bytes holds, for row c, k = 32g + 4j + e in its low
 * nibble and k = 32g + 4j + 2 + e in its high nibble (j < 8, c < 16, e < 2), so that widened
 * to 16 bits, each nibble is one half of vdpbf16ps's (k, k + 1) pairs. `params`: per block,
 * per group, 16 floats d then 16 floats m + 8d. N is a multiple of 16, K of 32. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define Q4_GROUP 32
#define Q4_ROWS 4 /* rows of x per tile; a tile is up to 4 rows by 32 columns of out */

/* ROWS rows of x by BLOCKS (1 or 2) blocks of 16 columns of out; constants where called. */
static inline __attribute__((always_inline)) void q4_tile(
    const int ROWS, const int BLOCKS, const bf16 *restrict x, const float *restrict sums,
    int64_t k, const uint8_t *restrict w, const float *restrict params, bf16 *restrict out,
    int64_t n) {
    const int64_t groups = k / Q4_GROUP;
    /* bfloat16 bits of q - 8 for q = 0..15 (vpermw looks each 16-bit lane up) */
    const __m512i centred = _mm512_set_epi16(
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
        0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
        0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0, 0xc100);
    const __m512i nibble = _mm512_set1_epi16(0x0f);
    vec acc[Q4_ROWS][2];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) acc[r][b] = ZERO();
    for (int64_t g = 0; g < groups; g++) {
        vec dot[Q4_ROWS][2];
        for (int r = 0; r < ROWS; r++)
            for (int b = 0; b < BLOCKS; b++) dot[r][b] = ZERO();
        for (int j = 0; j < 8; j++) {
            __m512bh low[2], high[2];
            for (int b = 0; b < BLOCKS; b++) {
                const __m512i bytes = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i *)(w + (b * groups + g) * 256 + j * 32)));
                low[b] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, nibble), centred);
                high[b] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), centred);
            }
            for (int r = 0; r < ROWS; r++) {
                int32_t pairs[2];
                memcpy(pairs, x + r * k + g * Q4_GROUP + j * 4, sizeof pairs);
                const __m512bh first = (__m512bh)_mm512_set1_epi32(pairs[0]);
                const __m512bh second = (__m512bh)_mm512_set1_epi32(pairs[1]);
                for (int b = 0; b < BLOCKS; b++) {
                    dot[r][b] = _mm512_dpbf16_ps(dot[r][b], low[b], first);
                    dot[r][b] = _mm512_dpbf16_ps(dot[r][b], high[b], second);
                }
            }
        }
        for (int b = 0; b < BLOCKS; b++) {
            const float *group = params + (b * groups + g) * 32;
            const vec d = _mm512_loadu_ps(group), m = _mm512_loadu_ps(group + 16);
            for (int r = 0; r < ROWS; r++) {
                acc[r][b] = FMA(dot[r][b], d, acc[r][b]);
                acc[r][b] = FMA(m, SET(sums[r * groups + g]), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) store_bf16(out + r * n + b * 16, acc[r][b], 16);
}

static void q4_rows(int64_t rows, int blocks, const bf16 *x, const float *sums, int64_t k,
                    const uint8_t *w, const float *params, bf16 *out, int64_t n) {
    const int64_t groups = k / Q4_GROUP;
    int64_t r = 0;
#define Q4_TILE(ROWS, BLOCKS)                                                                  \
    q4_tile(ROWS, BLOCKS, x + r * k, sums + r * groups, k, w, params, out + r * n, n)
    if (blocks == 2) {
        for (; r + Q4_ROWS <= rows; r += Q4_ROWS) Q4_TILE(4, 2);
        switch (rows - r) {
        case 3: Q4_TILE(3, 2); break;
        case 2: Q4_TILE(2, 2); break;
        case 1: Q4_TILE(1, 2); break;
        }
    } else {
        for (; r + Q4_ROWS <= rows; r += Q4_ROWS) Q4_TILE(4, 1);
        switch (rows - r) {
        case 3: Q4_TILE(3, 1); break;
        case 2: Q4_TILE(2, 1); break;
        case 1: Q4_TILE(1, 1); break;
        }
    }
#undef Q4_TILE
}

/* sums: scratch for rows * k / 32 floats (each group's sum of x) */
void q4_linear_bf16(bf16 *restrict out, const bf16 *restrict x, const uint8_t *restrict w,
                    const float *restrict params, float *restrict sums, int64_t rows, int64_t n,
                    int64_t k) {
    const int64_t groups = k / Q4_GROUP, blocks = n / 16, pairs = (blocks + 1) / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const bf16 *at = x + r * k + g * Q4_GROUP;
            sums[r * groups + g] = _mm512_reduce_add_ps(ADD(load_bf16(at, 16), load_bf16(at + 16, 16)));
        }
    _Pragma("omp parallel for schedule(static) if (pairs > 1)")
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t block = 2 * pair;
        q4_rows(rows, block + 1 < blocks ? 2 : 1, x, sums, k, w + block * groups * 256,
                params + block * groups * 32, out + block * 16, n);
    }
}
#endif

/* The largest block size decode_attention takes (the Python side checks it). */
int64_t otel_kernels_max_block_size(void) { return MAX_BLOCK_SIZE; }
