/* CPU kernels of a decoder layer: RMSNorm with its residual add, rotary with the cache write,
 * decode and prefill attention over the paged cache, SiLU-and-mul, the greedy argmax; from
 * AVX2 up, GGUF blocks times float32 x in 8 bits; and, on CPUs with AVX-512 BF16, the 4-bit
 * matmuls and a whole 4-bit decoder stack in one call.
 *
 * Compiled by kernels.py for the instruction set that the engine's own process detects
 * (explicit -march flags, never -march=native; the target is in the library's build tag and
 * its cache key) and called through ctypes with raw pointers. Every exported function
 * returns a status (STATUS_LIST: OK, or why it refused its input: never an uninitialized
 * output, never a signal on an input it could check), which kernels.py raises as an
 * exception naming the kernel and the failed check. The element-wise ops, decode
 * attention and argmax exist for float32 (suffix _f32) and bfloat16 (_bf16, stored as
 * uint16), and the cache write and decode attention also for float32 over a float16 cache
 * (_f32_f16); arithmetic is float32 throughout, rounded once on store (round to nearest even,
 * as torch does). One source of those loops for every level (`vec`, LANES and a few operations
 * on them): with AVX-512 16 lanes at a time (masked tails, any length), with AVX2 and FMA 8
 * (masked tails: vmaskmov for float32, a copy through a buffer for 16-bit types), below that one
 * element at a time (what the compiler vectorizes of them).
 * The functions marked AVX-512 BF16 exist only in a build for that target.
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
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
/* the sum of a 256-bit vector's 8 floats (every level from AVX2 up) */
static inline float hsum256(__m256 v) {
    const __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    return _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(m, m), _mm_hadd_ps(m, m)));
}
/* A float16 field as float32 by the F16C instruction (every level from AVX2 up; exact, as
 * half_to_float). */
static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}
/* the sum of a 256-bit vector's 8 int32 */
static inline int32_t hsum_epi32(__m256i v) {
    const __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i pairs = _mm_add_epi32(m, _mm_unpackhi_epi64(m, m));
    return _mm_cvtsi128_si32(_mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 1)));
}
#endif
/* e^x for x <= 0 at every lane width (`exp_vec`): x = n ln2 + r (ln2 in two parts), e^r by
 * Cephes' degree-6 polynomial, p(r) r^2 + r + 1, relative error about 2e-7. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_TERMS 6
__attribute__((unused)) /* the baseline build's exp is libm's */
static const float EXP_POLY[EXP_TERMS] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                          4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
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

/* float16, IEEE half precision (stored as uint16): the KV cache of a float32 model from a
 * half-precision checkpoint. One element at a time in integer steps (no _Float16, which GCC
 * has on x86 only from version 12): exact widening; narrowing rounds to nearest even, as
 * F16C's vcvtps2ph (the vector levels) and torch do, a value from 65520 up (65504 and a half
 * step) becomes infinite, a NaN stays a (quiet) NaN. */
typedef uint16_t f16;
static inline float load1_f16(const f16 *p) {
    const uint32_t h = *p, sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    float value;
    if (exponent == 0) { /* zero or subnormal: m * 2^-24, exact in float32 */
        value = (float)m * 0x1p-24f;
        return sign ? -value : value;
    }
    const uint32_t bits = sign | (exponent == 0x1f ? 0x7f800000u : (exponent + 112) << 23) | (m << 13);
    memcpy(&value, &bits, sizeof value);
    return value;
}
static inline void store1_f16(f16 *p, float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    const uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) { /* NaN */
        *p = (f16)(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    } else if (magnitude >= 0x477ff000u) { /* 65520 and up, infinity: infinite */
        *p = (f16)(sign | 0x7c00u);
    } else if (magnitude >= 0x38800000u) { /* a normal half (2^-14 up): rebias, round */
        const uint32_t rebiased = magnitude - 0x38000000u;
        *p = (f16)(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13));
    } else { /* a subnormal half or zero: |v| in steps of 2^-24, rounded to nearest even */
        *p = (f16)(sign | (uint32_t)nearbyintf(fabsf(v) * 0x1p24f));
    }
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
#ifdef __AVX512BF16__
    /* one instruction; unlike torch it flushes float32 denormals (below 1.2e-38) to zero */
    _mm256_mask_storeu_epi16(p, tail_mask(n), (__m256i)_mm512_cvtneps_pbh(v));
#else
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_mask_storeu_epi16(p, tail_mask(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
}
static inline vec load_f16(const f16 *p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(n), p));
}
static inline void store_f16(f16 *p, vec v, int64_t n) {
    _mm256_mask_storeu_epi16(p, tail_mask(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* e^x for x <= 0 (softmax, sigmoid) by the EXP_ method, 2^n by vscalefps; x below -87 gives 0. */
static inline vec exp_vec(vec x) {
    const vec log2e = _mm512_set1_ps(EXP_LOG2E);
    const vec ln2_hi = _mm512_set1_ps(EXP_LN2_HI), ln2_lo = _mm512_set1_ps(EXP_LN2_LO);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
    vec r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    vec p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < EXP_TERMS; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}
/* Fetch p's cache line ahead of use. As inline assembly: GCC 12 at -O3 dropped every
 * __builtin_prefetch of decode attention's loop from its output (and cold-cache decode took
 * twice as long). */
static inline void prefetch_line(const void *p) {
    __asm__ volatile("prefetcht0 (%0)" : : "r"(p));
}
/* lanes past n set to 0 */
static inline vec keep(vec x, int64_t n) { return _mm512_maskz_mov_ps(tail_mask(n), x); }
#define ZERO() _mm512_setzero_ps()
#define ADD(a, b) _mm512_add_ps(a, b)
#define MUL(a, b) _mm512_mul_ps(a, b)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET(x) _mm512_set1_ps(x)
#define HSUM(a) _mm512_reduce_add_ps(a)
#elif defined(__AVX2__) && defined(__FMA__)
/* ---- 8-lane load/store (AVX2 and FMA): lanes past n read 0 and are not written ------------ */

typedef __m256 vec;
static inline __m256i tail_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec load_f32(const float *p, int64_t n) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(n));
}
static inline void store_f32(float *p, vec v, int64_t n) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, tail_mask(n), v);
}
/* 8 16-bit values (n of them; the rest read 0) and back: no 16-bit masked load or store
 * below AVX-512, so a tail goes through a buffer */
static inline __m128i load8_u16(const uint16_t *p, int64_t n) {
    if (n >= 8) return _mm_loadu_si128((const __m128i *)p);
    uint16_t part[8] = {0};
    memcpy(part, p, (size_t)n * sizeof *p);
    return _mm_loadu_si128((const __m128i *)part);
}
static inline void store8_u16(uint16_t *p, __m128i packed, int64_t n) {
    if (n >= 8) {
        _mm_storeu_si128((__m128i *)p, packed);
        return;
    }
    uint16_t part[8];
    _mm_storeu_si128((__m128i *)part, packed);
    memcpy(p, part, (size_t)n * sizeof *p);
}
static inline vec load_bf16(const bf16 *p, int64_t n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load8_u16(p, n)), 16));
}
static inline void store_bf16(bf16 *p, vec v, int64_t n) {
    /* round to nearest even as store1_bf16; a NaN stays a (quiet) NaN */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
    const __m256i high = _mm256_srli_epi32(rounded, 16); /* 0-65535: packus keeps them */
    store8_u16(p, _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)), n);
}
/* float16 by F16C (x86-64-v3 has it) */
static inline vec load_f16(const f16 *p, int64_t n) { return _mm256_cvtph_ps(load8_u16(p, n)); }
static inline void store_f16(f16 *p, vec v, int64_t n) {
    store8_u16(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT), n);
}
/* e^x for x <= 0 (softmax, sigmoid) by the EXP_ method at 8 lanes, 2^n built in the exponent
 * bits (n >= -126 for x >= -87); x below -87 gives 0. */
static inline vec exp_vec(vec x) {
    const vec log2e = _mm256_set1_ps(EXP_LOG2E);
    const vec ln2_hi = _mm256_set1_ps(EXP_LN2_HI), ln2_lo = _mm256_set1_ps(EXP_LN2_LO);
    const vec tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const vec n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vec r = _mm256_fnmadd_ps(n, ln2_hi, x);
    r = _mm256_fnmadd_ps(n, ln2_lo, r);
    vec p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < EXP_TERMS; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}
/* lanes past n set to 0 */
static inline vec keep(vec x, int64_t n) {
    return n >= 8 ? x : _mm256_and_ps(x, _mm256_castsi256_ps(tail_mask(n)));
}
#define ZERO() _mm256_setzero_ps()
#define ADD(a, b) _mm256_add_ps(a, b)
#define MUL(a, b) _mm256_mul_ps(a, b)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET(x) _mm256_set1_ps(x)
#define HSUM(a) hsum256(a)
#else
typedef float vec;
static inline vec load_f32(const float *p, int64_t n) { (void)n; return *p; }
static inline void store_f32(float *p, vec v, int64_t n) { (void)n; *p = v; }
static inline vec load_bf16(const bf16 *p, int64_t n) { (void)n; return load1_bf16(p); }
static inline void store_bf16(bf16 *p, vec v, int64_t n) { (void)n; store1_bf16(p, v); }
static inline vec load_f16(const f16 *p, int64_t n) { (void)n; return load1_f16(p); }
static inline void store_f16(f16 *p, vec v, int64_t n) { (void)n; store1_f16(p, v); }
static inline vec exp_vec(vec x) { return expf(x); }
static inline vec keep(vec x, int64_t n) { (void)n; return x; }
#define ZERO() 0.0f
#define ADD(a, b) ((a) + (b))
#define MUL(a, b) ((a) * (b))
#define FMA(a, b, c) ((a) * (b) + (c))
#define SET(x) (x)
#define HSUM(a) (a)
#endif

/* Layout constants that kernels.py mirrors (checked at load: otel_kernels_contract). */
/* What every exported function returns (amx_ready and the contract aside): a closed set,
 * named here once; the contract string lists the names in code order and kernels.py
 * (KernelStatus) says what each means. BAD_TYPE: a GGML type id none of the kernels takes;
 * NO_MEMORY: an allocation failed; BAD_ARGUMENT: a precondition of the kernel's (a size, a
 * head size, a multiple of a block) does not hold; UNAVAILABLE: this process may not use the
 * kernel's instructions (Linux did not lend the AMX tiles). A function that fails writes no
 * defined output; kernels.py raises KernelError. */
#define STATUS_LIST(X)                                                                           \
    X(OK, ok) X(BAD_TYPE, bad_type) X(NO_MEMORY, no_memory) X(BAD_ARGUMENT, bad_argument)        \
    X(UNAVAILABLE, unavailable)
#define STATUS_ENUM(E, name) STATUS_##E,
enum { STATUS_LIST(STATUS_ENUM) STATUS_COUNT };

/* The check that failed last on this thread, as its source text (kernels.py adds it to the
 * error's reason): the calling thread's, so a failure inside a parallel region is recorded in
 * a shared status and returned, with its check, after the region. */
static _Thread_local const char *last_failure = "";
static int failed(int status, const char *check) {
    last_failure = check;
    return status;
}
const char *otel_kernels_failure(void) { return last_failure; }
#define REQUIRE(condition)                                                                       \
    do {                                                                                         \
        if (!(condition)) return failed(STATUS_BAD_ARGUMENT, #condition);                        \
    } while (0)
#define CHECKED(call)                                                                            \
    do {                                                                                         \
        const int status_ = (call);                                                              \
        if (status_) return status_;                                                             \
    } while (0)

#define MAX_BLOCK_SIZE 256 /* the largest block size decode_attention takes */
#define Q4_GROUP 32        /* weights per scale and offset of the 4-bit formats */
#define PANEL_BLOCKS 3     /* blocks of 16 columns per bfloat16 panel */
#define PREFILL_KEYS 32    /* keys per packed tile of prefill attention (32 * head_dim values) */
#define PREFILL_MAX_HD 128 /* prefill attention takes head sizes 64 and 128 */
/* decode attention specialised for head_dim 64 or 128 and a group size known at compile time */
#define DECODE_CASE(SUFFIX, HD, G)                                                               \
    case G:                                                                                      \
        DECODE_##SUFFIX(HD, G);                                                                  \
        break;
#define DECODE_CASES(SUFFIX, HD)                                                                 \
    DECODE_CASE(SUFFIX, HD, 1) DECODE_CASE(SUFFIX, HD, 2) DECODE_CASE(SUFFIX, HD, 3)             \
    DECODE_CASE(SUFFIX, HD, 4) DECODE_CASE(SUFFIX, HD, 5) DECODE_CASE(SUFFIX, HD, 6)             \
    DECODE_CASE(SUFFIX, HD, 7) DECODE_CASE(SUFFIX, HD, 8)
/* the portable kernel of one (sequence, KV head), its head size and group constants */
#define DECODE_ITEM(SUFFIX, HD, G)                                                               \
    decode_item_##SUFFIX(out, qkv, k_cache, v_cache, table, len, b, kvh, num_heads, G, HD,       \
                         block_size, num_slots, qkv_width, scale)
#define DECODE_f32(HD, G) DECODE_ITEM(f32, HD, G)
#define DECODE_f32_f16(HD, G) DECODE_ITEM(f32_f16, HD, G)
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DECODE_bf16(HD, G)                                                                       \
    decode_paired_bf16(HD, out + (b * num_heads + kvh * G) * HD, qkv + b * qkv_width + kvh * G * HD, \
                       k_cache + kvh * num_slots * HD, v_cache + kvh * num_slots * HD, table, len, \
                       G, __builtin_ctzll((unsigned long long)block_size), scale)
#else
#define DECODE_bf16(HD, G) DECODE_ITEM(bf16, HD, G)
#endif
#define CHUNK(n, i) ((n) - (i) < LANES ? (n) - (i) : LANES)

/* The index of the first greatest value of a row of n (float32 from either type), or of its
 * first NaN: what torch's max(dim=-1) returns. */
#ifdef __AVX512F__
#define ARGMAX_ROW(SUFFIX)                                                                       \
static int64_t argmax_row_##SUFFIX(const T_##SUFFIX *row, int64_t n) {                           \
    vec best = SET(-INFINITY);                                                                   \
    __m512i index = _mm512_setzero_si512(), at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8,   \
                                                                 7, 6, 5, 4, 3, 2, 1, 0);        \
    __mmask16 nan = 0;                                                                           \
    for (int64_t i = 0; i < n; i += LANES) {                                                     \
        const vec v = _mm512_mask_blend_ps(tail_mask(n - i), SET(-INFINITY),                     \
                                           load_##SUFFIX(row + i, CHUNK(n, i)));                 \
        const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* ties: earlier */   \
        best = _mm512_mask_mov_ps(best, greater, v);                                             \
        index = _mm512_mask_mov_epi32(index, greater, at);                                       \
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                           \
        at = _mm512_add_epi32(at, _mm512_set1_epi32(LANES));                                    \
    }                                                                                            \
    if (nan)                                                                                     \
        for (int64_t i = 0; i < n; i++)                                                          \
            if (isnan(load1_##SUFFIX(row + i))) return i;                                        \
    const float top = _mm512_reduce_max_ps(best);                                                \
    const __mmask16 tops = _mm512_cmp_ps_mask(best, SET(top), _CMP_EQ_OQ);                       \
    return _mm512_mask_reduce_min_epi32(tops, index);                                            \
}
#elif defined(__AVX2__) && defined(__FMA__)
#define ARGMAX_ROW(SUFFIX)                                                                       \
static int64_t argmax_row_##SUFFIX(const T_##SUFFIX *row, int64_t n) {                           \
    vec best = SET(-INFINITY), nan = ZERO();                                                     \
    __m256i index = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);      \
    for (int64_t i = 0; i < n; i += LANES) {                                                     \
        const vec v = _mm256_blendv_ps(SET(-INFINITY), load_##SUFFIX(row + i, CHUNK(n, i)),      \
                                       _mm256_castsi256_ps(tail_mask(n - i)));                   \
        const vec greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ); /* ties: earlier */             \
        best = _mm256_blendv_ps(best, v, greater);                                               \
        index = _mm256_blendv_epi8(index, at, _mm256_castps_si256(greater));                     \
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));                              \
        at = _mm256_add_epi32(at, _mm256_set1_epi32(LANES));                                     \
    }                                                                                            \
    if (_mm256_movemask_ps(nan))                                                                 \
        for (int64_t i = 0; i < n; i++)                                                          \
            if (isnan(load1_##SUFFIX(row + i))) return i;                                        \
    float tops[LANES];                                                                           \
    int32_t at_top[LANES];                                                                       \
    _mm256_storeu_ps(tops, best);                                                                \
    _mm256_storeu_si256((__m256i *)at_top, index);                                               \
    int64_t first = at_top[0];                                                                   \
    float top = tops[0];                                                                         \
    for (int l = 1; l < LANES; l++) /* the greatest; of equals, the earliest */                  \
        if (tops[l] > top || (tops[l] == top && at_top[l] < first)) {                            \
            top = tops[l];                                                                       \
            first = at_top[l];                                                                   \
        }                                                                                        \
    return first;                                                                                \
}
#else
#define ARGMAX_ROW(SUFFIX)                                                                       \
static int64_t argmax_row_##SUFFIX(const T_##SUFFIX *row, int64_t n) {                           \
    int64_t index = 0;                                                                           \
    float best = -INFINITY;                                                                      \
    for (int64_t i = 0; i < n; i++) {                                                            \
        const float v = load1_##SUFFIX(row + i);                                                 \
        if (isnan(v)) return i;                                                                  \
        if (v > best) { best = v; index = i; }                                                   \
    }                                                                                            \
    return index;                                                                                \
}
#endif
typedef float T_f32;
typedef bf16 T_bf16;
ARGMAX_ROW(f32)
ARGMAX_ROW(bf16)

#define DEFINE_KERNELS(T, SUFFIX)                                                                \
                                                                                                 \
/* hidden += delta (when delta is given); out = weight * normalize(hidden), RMSNorm. */          \
int add_rms_norm_##SUFFIX(T *restrict hidden, const T *restrict delta,                           \
                          const T *restrict weight, T *restrict out, int64_t rows,               \
                          int64_t width, float eps) {                                            \
    REQUIRE(rows >= 0);                                                                          \
    REQUIRE(width > 0);                                                                          \
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
    return STATUS_OK;                                                                            \
}                                                                                                \
                                                                                                 \
/* out[r] = the index of row r's first greatest logit (its first NaN if any): greedy      */  \
/* sampling straight from the LM head's output, in its own type.                         */  \
int argmax_##SUFFIX(int64_t *restrict out, const T *restrict logits, int64_t rows,              \
                    int64_t vocab) {                                                             \
    REQUIRE(rows >= 0);                                                                          \
    REQUIRE(vocab > 0);                                                                          \
    _Pragma("omp parallel for if (rows > 1)")                                                    \
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row_##SUFFIX(logits + r * vocab, vocab);  \
    return STATUS_OK;                                                                            \
}                                                                                                \
                                                                                                 \
/* out[r] = silu(gate[r]) * up[r], with gate_up[r] = [gate | up] (the fused projection);    */  \
/* the activation is rounded to T before the product, as torch does.                       */  \
int silu_mul_##SUFFIX(T *restrict out, const T *restrict gate_up, int64_t rows,                  \
                      int64_t width) {                                                           \
    REQUIRE(rows >= 0);                                                                          \
    REQUIRE(width > 0);                                                                          \
    _Pragma("omp parallel for if (rows > 8)")                                                    \
    for (int64_t r = 0; r < rows; r++) {                                                         \
        const T *gate = gate_up + r * 2 * width, *up = gate + width;                             \
        T *o = out + r * width;                                                                  \
        for (int64_t i = 0; i < width; i += LANES) {                                             \
            const int64_t n = CHUNK(width, i);                                                   \
            const vec x = load_##SUFFIX(gate + i, n);                                            \
            /* silu(x) = x * sigmoid(x), with e^-|x| only (no overflow) */                       \
            const vec e = exp_vec(MUL(SET(-1.0f), abs_vec(x)));                                  \
            const vec r = div_vec(SET(1.0f), ADD(SET(1.0f), e));                                 \
            const vec sig = select_pos(x, r, MUL(e, r));                                         \
            store_##SUFFIX(o + i, MUL(x, sig), n);                                               \
            store_##SUFFIX(o + i, MUL(load_##SUFFIX(o + i, n), load_##SUFFIX(up + i, n)), n);    \
        }                                                                                        \
    }                                                                                            \
    return STATUS_OK;                                                                            \
}

#ifdef __AVX512F__
static inline vec abs_vec(vec x) { return _mm512_abs_ps(x); }
static inline vec div_vec(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec select_pos(vec x, vec if_pos, vec if_neg) {
    return _mm512_mask_mov_ps(if_neg, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ),
                              if_pos);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline vec abs_vec(vec x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
static inline vec div_vec(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec select_pos(vec x, vec if_pos, vec if_neg) {
    return _mm256_blendv_ps(if_neg, if_pos, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
#else
static inline vec abs_vec(vec x) { return fabsf(x); }
static inline vec div_vec(vec a, vec b) { return a / b; }
static inline vec select_pos(vec x, vec if_pos, vec if_neg) { return x >= 0.0f ? if_pos : if_neg; }
#endif

/* Attention scores of one query head group against `count` cached keys: scores[g * stride +
 * j] = q_g . k_j, q already scaled, as float32. */
#define DEFINE_SCORES(T, SUFFIX)                                                                 \
static inline __attribute__((always_inline)) void scores_##SUFFIX(                               \
    float *restrict scores, int64_t stride, const float *restrict q, const T *restrict kb,       \
    int64_t count, const int64_t group, const int64_t head_dim) {                                \
    for (int64_t j = 0; j < count; j++) {                                                        \
        vec dots[group];                                                                         \
        for (int64_t g = 0; g < group; g++) dots[g] = ZERO();                                    \
        for (int64_t d = 0; d < head_dim; d += LANES) {                                          \
            const int64_t n = CHUNK(head_dim, d);                                                \
            const vec k = load_##SUFFIX(kb + j * head_dim + d, n);                               \
            for (int64_t g = 0; g < group; g++)                                                  \
                dots[g] = FMA(load_f32(q + g * head_dim + d, n), k, dots[g]);                    \
        }                                                                                        \
        for (int64_t g = 0; g < group; g++) scores[g * stride + j] = HSUM(dots[g]);              \
    }                                                                                            \
}
DEFINE_SCORES(float, f32)
DEFINE_SCORES(bf16, bf16)
DEFINE_SCORES(f16, f16)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The sums of 16 vectors, one per lane: lane j = sum of v[j]'s 16 lanes (pairs added
 * within 128-bit lanes, then the 128-bit lanes across): 45 instructions for 16 sums. */
static inline vec sum16(const vec v[16]) {
    vec pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a, b, a, b] partial sums */
        pairs[i] = ADD(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                       _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [a, b, c, d], each its lane's total */
        quads[i] = ADD(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        halves[i] = ADD(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return ADD(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
               _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#define MAX_GROUP 8
#endif

/* acc[g] = acc[g] * rescales[g] + sum_j probs[g * stride + j] * v_j over `count` cached
 * values: each value row loaded once for every head of the group. */
#define DEFINE_VALUES(T, SUFFIX)                                                                 \
static inline __attribute__((always_inline)) void values_##SUFFIX(                               \
    float *restrict acc, const float *restrict probs, int64_t stride,                            \
    const float *restrict rescales, const T *restrict vb, int64_t count, const int64_t group,    \
    const int64_t head_dim) {                                                                    \
    const int64_t chunks = (head_dim + LANES - 1) / LANES;                                       \
    vec sums[group][chunks];                                                                     \
    for (int64_t g = 0; g < group; g++)                                                          \
        for (int64_t c = 0; c < chunks; c++)                                                     \
            sums[g][c] = MUL(load_f32(acc + g * head_dim + c * LANES, CHUNK(head_dim, c * LANES)), \
                             SET(rescales[g]));                                                  \
    for (int64_t j = 0; j < count; j++) {                                                        \
        vec weights[group];                                                                      \
        for (int64_t g = 0; g < group; g++) weights[g] = SET(probs[g * stride + j]);             \
        for (int64_t c = 0; c < chunks; c++) {                                                   \
            const vec v = load_##SUFFIX(vb + j * head_dim + c * LANES, CHUNK(head_dim, c * LANES)); \
            for (int64_t g = 0; g < group; g++) sums[g][c] = FMA(weights[g], v, sums[g][c]);     \
        }                                                                                        \
    }                                                                                            \
    for (int64_t g = 0; g < group; g++)                                                          \
        for (int64_t c = 0; c < chunks; c++)                                                     \
            store_f32(acc + g * head_dim + c * LANES, sums[g][c], CHUNK(head_dim, c * LANES));   \
}
DEFINE_VALUES(float, f32)
DEFINE_VALUES(bf16, bf16)
DEFINE_VALUES(f16, f16)

/* ---- decode attention, bfloat16, head_dim 64 or 128 (AVX-512 BF16) --------------------------
 *
 * One (sequence, KV head) per call, every query head of its group at once, in passes of up to
 * DECODE_PASS cached keys: first q . k for all of them (vdpbf16ps on the stored bfloat16 q and
 * k: exact products, float32 sums; one sum16 per 16 keys and head), then one softmax update
 * per pass (the probabilities rounded to bfloat16, as flash attention's P @ V does), then p . v
 * two value rows at a time by vdpbf16ps. A step reads every cached key and value once, from
 * blocks scattered over memory, so the rows DECODE_AHEAD ahead of the one read are prefetched
 * a row at a time (keys, then the pass's values, then the next pass's keys) and the loads stay
 * in flight while the arithmetic runs. Slots past the sequence are never read. HD, the head
 * size, is a constant where it is called: a row is HD / 32 vectors of 32 bfloat16. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DECODE_PASS 256 /* keys per pass */
#define DECODE_AHEAD 32 /* rows prefetched ahead of the one read: measured best of 16-64 */
#define DECODE_MAX_CHUNKS 4 /* 32-wide chunks of the largest head size (128) */

/* The cached row of position j: block table[j / block_size], block_size = 1 << shift. */
static inline __attribute__((always_inline)) const bf16 *cached_row(
    const int HD, const bf16 *base, const int32_t *table, int64_t j, int shift) {
    return base + (((int64_t)table[j >> shift] << shift) + (j & ((1 << shift) - 1))) * HD;
}
/* Every cache line of a row. */
static inline __attribute__((always_inline)) void prefetch_row(const int HD, const bf16 *row) {
    for (int line = 0; line < HD * 2; line += 64) prefetch_line((const char *)row + line);
}

static inline __attribute__((always_inline)) void decode_paired_bf16(
    const int HD, bf16 *restrict out, const bf16 *restrict q, const bf16 *restrict keys,
    const bf16 *restrict values, const int32_t *restrict table, int64_t len, const int64_t group,
    int shift, float scale) {
    const int chunks = HD / 32;
    __m512bh q_parts[MAX_GROUP][DECODE_MAX_CHUNKS];
    vec acc[MAX_GROUP][2 * DECODE_MAX_CHUNKS]; /* per head, d in vdpbf16ps's order: see the end */
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    float scores[MAX_GROUP][DECODE_PASS] __attribute__((aligned(64)));
    bf16 probs[MAX_GROUP][DECODE_PASS] __attribute__((aligned(64)));
    for (int64_t g = 0; g < group; g++) {
        for (int c = 0; c < chunks; c++) {
            q_parts[g][c] = (__m512bh)_mm512_loadu_si512(q + g * HD + c * 32);
            acc[g][2 * c] = acc[g][2 * c + 1] = ZERO();
        }
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    for (int64_t first = 0; first < len; first += DECODE_PASS) {
        const int64_t n = len - first < DECODE_PASS ? len - first : DECODE_PASS;
        for (int64_t start = 0; start < n; start += 16) {
            const int64_t count = n - start < 16 ? n - start : 16;
            const bf16 *rows[16];
            for (int64_t j = 0; j < 16; j++) {
                const int64_t ahead = start + j + DECODE_AHEAD;
                rows[j] = j < count ? cached_row(HD, keys, table, first + start + j, shift) : NULL;
                if (ahead < n) prefetch_row(HD, cached_row(HD, keys, table, first + ahead, shift));
                else if (ahead - n < n)
                    prefetch_row(HD, cached_row(HD, values, table, first + ahead - n, shift));
            }
            for (int64_t g = 0; g < group; g++) {
                vec dots[16];
                for (int64_t j = 0; j < 16; j++) {
                    dots[j] = ZERO();
                    if (j < count) /* slots past the sequence may hold anything: never read */
                        for (int c = 0; c < chunks; c++)
                            dots[j] = _mm512_dpbf16_ps(
                                dots[j], q_parts[g][c],
                                (__m512bh)_mm512_loadu_si512(rows[j] + c * 32));
                }
                _mm512_store_ps(&scores[g][start], MUL(sum16(dots), SET(scale)));
            }
        }
        for (int64_t g = 0; g < group; g++) {
            vec top = SET(-INFINITY);
            for (int64_t i = 0; i < n; i += 16)
                top = _mm512_max_ps(top, _mm512_mask_blend_ps(tail_mask(n - i), SET(-INFINITY),
                                                              _mm512_load_ps(&scores[g][i])));
            const float pass_max = _mm512_reduce_max_ps(top);
            const float new_max = pass_max > run_max[g] ? pass_max : run_max[g];
            const float rescale = expf(run_max[g] - new_max);
            run_max[g] = new_max;
            vec total = ZERO();
            for (int64_t i = 0; i < n; i += 16) {
                const vec p = keep(exp_vec(ADD(_mm512_load_ps(&scores[g][i]), SET(-new_max))), n - i);
                total = ADD(total, p);
                _mm256_store_si256((__m256i *)&probs[g][i], (__m256i)_mm512_cvtneps_pbh(p));
            }
            run_sum[g] = run_sum[g] * rescale + HSUM(total);
            for (int c = 0; c < 2 * chunks; c++) acc[g][c] = MUL(acc[g][c], SET(rescale));
        }
        for (int64_t j = 0; j < n; j += 2) {
            for (int64_t i = j + DECODE_AHEAD; i < j + DECODE_AHEAD + 2; i++) {
                if (i < n) prefetch_row(HD, cached_row(HD, values, table, first + i, shift));
                else if (first + i < len)
                    prefetch_row(HD, cached_row(HD, keys, table, first + i, shift));
            }
            const bf16 *row = cached_row(HD, values, table, first + j, shift);
            /* past the sequence: zeros, never the slot's contents */
            const bf16 *next = j + 1 < n ? cached_row(HD, values, table, first + j + 1, shift) : NULL;
            /* (d of row j, d of row j + 1) pairs against (p_j, p_j+1) */
            __m512bh v[2 * DECODE_MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) {
                const __m512i a = _mm512_loadu_si512(row + c * 32);
                const __m512i b = next ? _mm512_loadu_si512(next + c * 32) : _mm512_setzero_si512();
                v[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                v[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            for (int64_t g = 0; g < group; g++) {
                int32_t pair;
                memcpy(&pair, &probs[g][j], sizeof pair);
                const __m512bh weights = (__m512bh)_mm512_set1_epi32(pair);
                for (int c = 0; c < 2 * chunks; c++)
                    acc[g][c] = _mm512_dpbf16_ps(acc[g][c], v[c], weights);
            }
        }
    }
    /* unpacking put d of each 32-wide chunk c in the order [0-3, 8-11, 16-19, 24-27]
     * (acc[2c]) and [4-7, 12-15, 20-23, 28-31] (acc[2c + 1]) */
    const __m512i to_first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i to_second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t g = 0; g < group; g++) {
        const vec inv = SET(run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f);
        for (int c = 0; c < chunks; c++) {
            store_bf16(out + g * HD + c * 32,
                       MUL(_mm512_permutex2var_ps(acc[g][2 * c], to_first, acc[g][2 * c + 1]), inv), 16);
            store_bf16(out + g * HD + c * 32 + 16,
                       MUL(_mm512_permutex2var_ps(acc[g][2 * c], to_second, acc[g][2 * c + 1]), inv), 16);
        }
    }
}
#endif

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(bf16, bf16)

/* Rotary with the cache write and decode attention, for activations of type T (load_##TS)
 * over a cache of type C (load_##CS): float32 over float32 (_f32), bfloat16 over bfloat16
 * (_bf16), and float32 over float16 (_f32_f16: the half-precision cache of a float32 model).
 * The arithmetic is float32 either way; a cached value is rounded once, when it is written. */
#define DEFINE_ATTENTION(T, TS, C, CS, SUFFIX)                                                   \
/* One head's k or v row into its cache slot: copied, or converted to the cache's type. */       \
static inline void cache_row_##SUFFIX(C *restrict slot, const T *restrict row, int64_t n) {      \
    if (sizeof(C) == sizeof(T)) {                                                                \
        memcpy(slot, row, (size_t)n * sizeof(T));                                                \
        return;                                                                                  \
    }                                                                                            \
    for (int64_t i = 0; i < n; i += LANES)                                                       \
        store_##CS(slot + i, load_##TS(row + i, CHUNK(n, i)), CHUNK(n, i));                     \
}                                                                                                \
                                                                                                 \
/* Rotary embedding (rotate-half layout) on the q and k heads of qkv, in place, then the k   */  \
/* and v heads written to their cache slots.                                                 */  \
int rope_and_cache_##SUFFIX(T *restrict qkv, const float *restrict cos_sin,                      \
                            const int64_t *restrict positions,                                   \
                            const int64_t *restrict slots, C *restrict k_cache,                  \
                            C *restrict v_cache, int64_t tokens, int64_t num_heads,              \
                            int64_t num_kv_heads, int64_t head_dim, int64_t num_slots) {         \
    REQUIRE(tokens >= 0);                                                                        \
    REQUIRE(num_heads > 0 && num_kv_heads > 0);                                                  \
    REQUIRE(head_dim > 0 && head_dim % 2 == 0);                                                  \
    REQUIRE(num_slots > 0);                                                                      \
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
                const vec a = load_##TS(x + i, n), b = load_##TS(x + half + i, n);               \
                const vec c = load_f32(cs + i, n), s = load_f32(cs + half + i, n);               \
                store_##TS(x + i, FMA(a, c, MUL(SET(-1.0f), MUL(b, s))), n);                     \
                store_##TS(x + half + i, FMA(b, c, MUL(a, s)), n);                               \
            }                                                                                    \
        }                                                                                        \
        const int64_t slot = slots[t];                                                           \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                             \
            cache_row_##SUFFIX(k_cache + (h * num_slots + slot) * head_dim,                      \
                               row + (num_heads + h) * head_dim, head_dim);                      \
            cache_row_##SUFFIX(v_cache + (h * num_slots + slot) * head_dim,                      \
                               row + (rotated + h) * head_dim, head_dim);                        \
        }                                                                                        \
    }                                                                                            \
    return STATUS_OK;                                                                            \
}                                                                                                \
                                                                                                 \
/* One (sequence, KV head) of decode attention; head_dim is a constant where it is called  */    \
/* with one, so that the loops over it unroll and q stays in registers.                    */    \
static inline __attribute__((always_inline)) void decode_item_##SUFFIX(                          \
    T *restrict out, const T *restrict qkv, const C *restrict k_cache,                           \
    const C *restrict v_cache, const int32_t *restrict table, int64_t len, int64_t b,            \
    int64_t kvh, int64_t num_heads, const int64_t group, const int64_t head_dim,                 \
    int64_t block_size, int64_t num_slots, int64_t qkv_width, float scale) {                     \
    float q[group][head_dim], acc[group][head_dim];                                              \
    float run_max[group], run_sum[group], rescales[group], scores[group][block_size];            \
    for (int64_t g = 0; g < group; g++) {                                                        \
        const T *qh = qkv + b * qkv_width + (kvh * group + g) * head_dim;                        \
        for (int64_t d = 0; d < head_dim; d++) {                                                 \
            q[g][d] = load1_##TS(qh + d) * scale;                                                \
            acc[g][d] = 0.0f;                                                                    \
        }                                                                                        \
        run_max[g] = -INFINITY;                                                                  \
        run_sum[g] = 0.0f;                                                                       \
    }                                                                                            \
    const C *keys = k_cache + kvh * num_slots * head_dim;                                        \
    const C *values = v_cache + kvh * num_slots * head_dim;                                      \
    for (int64_t start = 0; start < len; start += block_size) {                                  \
        const int64_t block = table[start / block_size];                                         \
        const int64_t count = len - start < block_size ? len - start : block_size;               \
        const C *kb = keys + block * block_size * head_dim;                                      \
        const C *vb = values + block * block_size * head_dim;                                    \
        if (start + block_size < len) { /* blocks are scattered: fetch the next one early */     \
            const int64_t next = table[start / block_size + 1] * block_size * head_dim;          \
            for (int64_t byte = 0; byte < block_size * head_dim * (int64_t)sizeof(C); byte += 64) { \
                __builtin_prefetch((const char *)(keys + next) + byte);                          \
                __builtin_prefetch((const char *)(values + next) + byte);                        \
            }                                                                                    \
        }                                                                                        \
        scores_##CS(&scores[0][0], block_size, &q[0][0], kb, count, group, head_dim);            \
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
        values_##CS(&acc[0][0], &scores[0][0], block_size, rescales, vb, count, group,           \
                        head_dim);                                                               \
    }                                                                                            \
    for (int64_t g = 0; g < group; g++) {                                                        \
        T *o = out + (b * num_heads + kvh * group + g) * head_dim;                               \
        const vec inv = SET(run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f);                       \
        for (int64_t d = 0; d < head_dim; d += LANES) {                                          \
            const int64_t n = CHUNK(head_dim, d);                                                \
            store_##TS(o + d, MUL(load_f32(&acc[g][d], n), inv), n);                             \
        }                                                                                        \
    }                                                                                            \
}                                                                                                \
                                                                                                 \
/* One query token per sequence against its cached keys and values (paged), every query   */     \
/* head of a group sharing its KV head: online softmax, one pass over the cache.          */     \
int decode_attention_##SUFFIX(T *restrict out, const T *restrict qkv,                            \
                              const C *restrict k_cache, const C *restrict v_cache,              \
                              const int32_t *restrict block_tables,                              \
                              const int32_t *restrict seq_lens, int64_t batch,                   \
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,         \
                              int64_t block_size, int64_t max_blocks, int64_t num_slots,         \
                              int64_t qkv_width, float scale) {                                  \
    REQUIRE(batch >= 0);                                                                         \
    REQUIRE(num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0);                 \
    REQUIRE(head_dim > 0);                                                                       \
    REQUIRE(block_size > 0 && block_size <= MAX_BLOCK_SIZE);                                     \
    REQUIRE((block_size & (block_size - 1)) == 0); /* a power of two */                          \
    REQUIRE(max_blocks >= 0 && num_slots > 0);                                                   \
    REQUIRE(qkv_width >= (num_heads + 2 * num_kv_heads) * head_dim);                             \
    const int64_t group = num_heads / num_kv_heads;                                              \
    _Pragma("omp parallel for schedule(dynamic) if (batch * num_kv_heads > 1)")                  \
    for (int64_t work = 0; work < batch * num_kv_heads; work++) {                                \
        const int64_t b = work / num_kv_heads, kvh = work % num_kv_heads;                        \
        const int32_t *table = block_tables + b * max_blocks;                                    \
        const int64_t len = seq_lens[b];                                                         \
        if (head_dim == 64 && group <= 8) {                                                      \
            switch (group) { DECODE_CASES(SUFFIX, 64) }                                          \
        } else if (head_dim == 128 && group <= 8) {                                              \
            switch (group) { DECODE_CASES(SUFFIX, 128) }                                         \
        } else {                                                                                 \
            decode_item_##SUFFIX(out, qkv, k_cache, v_cache, table, len, b, kvh, num_heads,      \
                                 group, head_dim, block_size, num_slots, qkv_width, scale);      \
        }                                                                                        \
    }                                                                                            \
    return STATUS_OK;                                                                            \
}
DEFINE_ATTENTION(float, f32, float, f32, f32)
DEFINE_ATTENTION(bf16, bf16, bf16, bf16, bf16)
DEFINE_ATTENTION(float, f32, f16, f16, f32_f16)

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
 * Packed weights (int4.py `pack_int4`): per block of 16 output rows of W, per group, 256
 * bytes: byte (j, c, e) of the j-th 32 bytes holds, for row c, k = 32g + 4j + e in its low
 * nibble and k = 32g + 4j + 2 + e in its high nibble (j < 8, c < 16, e < 2), so that widened
 * to 16 bits, each nibble is one half of vdpbf16ps's (k, k + 1) pairs. `params`: per block,
 * per group, 16 floats d then 16 floats m + 8d. N is a multiple of 16, K of 32. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define Q4_ROWS 4 /* rows of x per tile; a tile is up to 4 rows by 32 columns of out */
/* Two bfloat16 values read as one 32-bit word (the pair vdpbf16ps multiplies), at any even
 * address. */
typedef int32_t bf16_pair __attribute__((may_alias, aligned(2)));

/* The j-th 32 bytes of block b's group g widened to 16-bit words: word 2c + e holds column
 * c's q for k = 32g + 4j + e in its low nibble and for k + 2 in its high one. */
static inline __m512i q4_words(const uint8_t *restrict w, int64_t groups, int b, int64_t g,
                               int j) {
    return _mm512_cvtepu8_epi16(
        _mm256_loadu_si256((const __m256i *)(w + (b * groups + g) * 256 + j * 32)));
}

/* ROWS rows of x by BLOCKS (1 or 2) blocks of 16 columns of out; constants where called.
 * `ahead` (NULL: none): the weights of the next blocks, `ahead_blocks` of them, fetched a
 * group at a time while this tile runs. */
static inline __attribute__((always_inline)) void q4_tile(
    const int ROWS, const int BLOCKS, const bf16 *restrict x, const float *restrict sums,
    int64_t k, const uint8_t *restrict w, const float *restrict params, bf16 *restrict out,
    int64_t n, const uint8_t *ahead, const float *ahead_params, int ahead_blocks) {
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
        for (int b = 0; ahead && b < ahead_blocks; b++) {
            const uint8_t *next = ahead + (b * groups + g) * 256;
            for (int line = 0; line < 256; line += 64) prefetch_line(next + line);
            prefetch_line(ahead_params + (b * groups + g) * 32);
            prefetch_line(ahead_params + (b * groups + g) * 32 + 16);
        }
        vec dot[Q4_ROWS][2], dot_high[Q4_ROWS][2]; /* two chains each: dpbf16 latency */
        for (int r = 0; r < ROWS; r++)
            for (int b = 0; b < BLOCKS; b++) dot[r][b] = dot_high[r][b] = ZERO();
        for (int j = 0; j < 8; j++) {
            __m512bh low[2], high[2];
            for (int b = 0; b < BLOCKS; b++) {
                const __m512i bytes = q4_words(w, groups, b, g, j);
                low[b] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, nibble), centred);
                high[b] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), centred);
            }
            for (int r = 0; r < ROWS; r++) {
                /* each pair broadcast from memory (a load); read as one 8-byte word into a
                 * general register (a memcpy of both) each took a shuffle from there */
                const bf16_pair *pairs = (const bf16_pair *)(x + r * k + g * Q4_GROUP + j * 4);
                const __m512bh first = (__m512bh)_mm512_set1_epi32(pairs[0]);
                const __m512bh second = (__m512bh)_mm512_set1_epi32(pairs[1]);
                for (int b = 0; b < BLOCKS; b++) {
                    dot[r][b] = _mm512_dpbf16_ps(dot[r][b], low[b], first);
                    dot_high[r][b] = _mm512_dpbf16_ps(dot_high[r][b], high[b], second);
                }
            }
        }
        for (int b = 0; b < BLOCKS; b++) {
            const float *group = params + (b * groups + g) * 32;
            const vec d = _mm512_loadu_ps(group), m = _mm512_loadu_ps(group + 16);
            for (int r = 0; r < ROWS; r++) {
                acc[r][b] = FMA(ADD(dot[r][b], dot_high[r][b]), d, acc[r][b]);
                acc[r][b] = FMA(m, SET(sums[r * groups + g]), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) store_bf16(out + r * n + b * 16, acc[r][b], 16);
}

/* Every row of x by one pair of blocks (`blocks`: 1 or 2); the first tile fetches the next
 * pair's weights (`ahead_blocks` blocks, 0: none), so that steps of several rows, whose
 * tiles each run over the pair, compute while the next pair is read from memory. */
static void q4_rows(int64_t rows, int blocks, const bf16 *x, const float *sums, int64_t k,
                    const uint8_t *w, const float *params, bf16 *out, int64_t n,
                    int ahead_blocks) {
    const int64_t groups = k / Q4_GROUP;
    const uint8_t *ahead = ahead_blocks ? w + 2 * groups * 256 : NULL;
    const float *ahead_params = ahead_blocks ? params + 2 * groups * 32 : NULL;
    int64_t r = 0;
#define Q4_TILE(ROWS, BLOCKS)                                                                  \
    q4_tile(ROWS, BLOCKS, x + r * k, sums + r * groups, k, w, params, out + r * n, n,          \
            r ? NULL : ahead, ahead_params, ahead_blocks)
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
int q4_linear_bf16(bf16 *restrict out, const bf16 *restrict x, const uint8_t *restrict w,
                   const float *restrict params, float *restrict sums, int64_t rows, int64_t n,
                   int64_t k) {
    REQUIRE(rows >= 0);
    REQUIRE(n > 0 && n % 16 == 0);
    REQUIRE(k > 0 && k % Q4_GROUP == 0);
    const int64_t groups = k / Q4_GROUP, blocks = n / 16, pairs = (blocks + 1) / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const bf16 *at = x + r * k + g * Q4_GROUP;
            sums[r * groups + g] = _mm512_reduce_add_ps(ADD(load_bf16(at, 16), load_bf16(at + 16, 16)));
        }
    _Pragma("omp parallel for schedule(static) if (pairs > 1)")
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t block = 2 * pair;
        const int64_t next = blocks - block - 2; /* blocks after this pair */
        q4_rows(rows, block + 1 < blocks ? 2 : 1, x, sums, k, w + block * groups * 256,
                params + block * groups * 32, out + block * 16, n,
                next <= 0 ? 0 : next < 2 ? 1 : 2);
    }
    return STATUS_OK;
}

/* ---- the same weights for steps of more rows: bfloat16 panels -------------------------------
 *
 * out = x @ W.T with W as bfloat16 (d * q + m, rounded: the values of the bfloat16 copy of
 * the weights), dequantized once at load (`q4_build_panels_bf16`) into panels of 48 output
 * columns in vdpbf16ps's pair layout, [panel][k / 2][3 blocks][16 columns][2], then multiplied
 * by tiles of 8 rows x 48 columns (24 float32 accumulators). Each thread takes consecutive
 * panels (a static schedule) and, while its tiles run, fetches its next panel a line per pair
 * of k, spread over the tiles: the panels are read from memory once per step, at full speed
 * (32 rows of the default model's 30 layers: 6.8 ms; dequantizing the 4-bit weights per step
 * instead took 9.2 ms, the same panels without fetching ahead 8.5). */
#define PANEL_ROWS 8

/* The panel's `count` blocks, dequantized: [k / 2][block][16 columns][2] bfloat16. Byte 2c + e
 * of the j-th 32 bytes of a group holds column c's (k, k + 2) for k = 32g + 4j + e (c < 8; the
 * next 16 bytes columns 8-15), so widened to 32-bit lanes, their low nibbles are already the
 * (k, k + 1) pairs of columns 0-7 in vdpbf16ps's order, their high nibbles (k + 2, k + 3). */
static void q4_dequantize_panel(bf16 *restrict panel, const uint8_t *restrict w,
                                const float *restrict params, int64_t groups, int count) {
    const __m512i first_pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i second_pairs = _mm512_add_epi32(first_pairs, _mm512_set1_epi32(8));
    const __m512i nibble = _mm512_set1_epi32(0x0f);
    for (int b = 0; b < count; b++)
        for (int64_t g = 0; g < groups; g++) {
            const float *group = params + (b * groups + g) * 32;
            const uint8_t *bytes = w + (b * groups + g) * 256;
            /* d * q + m, with m = (m + 8d) - 8d: exact for a checkpoint's float16 d and m */
            const vec d = _mm512_loadu_ps(group);
            const vec m = FMA(SET(-8.0f), d, _mm512_loadu_ps(group + 16));
            const vec d_first = _mm512_permutexvar_ps(first_pairs, d);
            const vec d_second = _mm512_permutexvar_ps(second_pairs, d);
            const vec m_first = _mm512_permutexvar_ps(first_pairs, m);
            const vec m_second = _mm512_permutexvar_ps(second_pairs, m);
            for (int j = 0; j < 8; j++) {
                const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + j * 32)));
                const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + j * 32 + 16)));
                for (int h = 0; h < 2; h++) {
                    const __m512i q_first = h ? _mm512_srli_epi32(first, 4) : _mm512_and_si512(first, nibble);
                    const __m512i q_second = h ? _mm512_srli_epi32(second, 4) : _mm512_and_si512(second, nibble);
                    const __m512bh both = _mm512_cvtne2ps_pbh(
                        FMA(_mm512_cvtepi32_ps(q_second), d_second, m_second),
                        FMA(_mm512_cvtepi32_ps(q_first), d_first, m_first));
                    const int64_t pair = g * 16 + j * 2 + h;
                    _mm512_storeu_si512(panel + (pair * PANEL_BLOCKS + b) * 32, (__m512i)both);
                }
            }
        }
}

/* A 4-bit matrix [n, k] in q4_linear_bf16's layout as bfloat16 panels: n / 48 rounded up
 * panels of k * 48 bfloat16 (a last panel of fewer blocks is padded). */
int q4_build_panels_bf16(bf16 *restrict panels, const uint8_t *restrict w,
                         const float *restrict params, int64_t n, int64_t k) {
    REQUIRE(n > 0 && n % 16 == 0);
    REQUIRE(k > 0 && k % Q4_GROUP == 0);
    const int64_t groups = k / Q4_GROUP, blocks = n / 16;
    const int64_t count = (blocks + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t p = 0; p < count; p++) {
        const int64_t block = p * PANEL_BLOCKS;
        q4_dequantize_panel(panels + p * k * PANEL_BLOCKS * 16, w + block * groups * 256,
                            params + block * groups * 32, groups,
                            blocks - block < PANEL_BLOCKS ? (int)(blocks - block) : PANEL_BLOCKS);
    }
    return STATUS_OK;
}

/* ROWS rows of x by BLOCKS blocks (constants where called); fetches `ahead + 64 * pair`. */
static inline __attribute__((always_inline)) void panel_tile(
    const int ROWS, const int BLOCKS, const bf16 *restrict x, int64_t k,
    const bf16 *restrict panel, bf16 *restrict out, int64_t n, const char *ahead) {
    vec acc[PANEL_ROWS][PANEL_BLOCKS];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) acc[r][b] = ZERO();
    for (int64_t pair = 0; pair < k / 2; pair++) {
        prefetch_line(ahead + pair * 64);
        __m512bh w[PANEL_BLOCKS];
        for (int b = 0; b < BLOCKS; b++)
            w[b] = (__m512bh)_mm512_loadu_si512(panel + (pair * PANEL_BLOCKS + b) * 32);
        for (int r = 0; r < ROWS; r++) {
            int32_t bits;
            memcpy(&bits, x + r * k + 2 * pair, sizeof bits);
            const __m512bh xx = (__m512bh)_mm512_set1_epi32(bits);
            for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], w[b], xx);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BLOCKS; b++) store_bf16(out + r * n + b * 16, acc[r][b], 16);
}

static void panel_rows(int64_t rows, int blocks, const bf16 *x, int64_t k, const bf16 *panel,
                       bf16 *out, int64_t n, const char *next) {
    /* the next panel's k * 96 bytes (1.5 lines per pair of k), a share per tile */
    const int64_t tiles = (rows + PANEL_ROWS - 1) / PANEL_ROWS;
    const int64_t share = (k * PANEL_BLOCKS * 32 / 64 + tiles - 1) / tiles * 64;
    int64_t r = 0, tile = 0;
#define PANEL_TILE(ROWS, BLOCKS)                                                               \
    panel_tile(ROWS, BLOCKS, x + r * k, k, panel, out + r * n, n, next + tile++ * share)
#define PANEL_TILES(BLOCKS)                                                                    \
    do {                                                                                       \
        for (; r + PANEL_ROWS <= rows; r += PANEL_ROWS) PANEL_TILE(8, BLOCKS);                 \
        if (rows - r >= 4) { PANEL_TILE(4, BLOCKS); r += 4; }                                  \
        for (; r < rows; r++) PANEL_TILE(1, BLOCKS);                                           \
    } while (0)
    if (blocks == 3) PANEL_TILES(3);
    else if (blocks == 2) PANEL_TILES(2);
    else PANEL_TILES(1);
#undef PANEL_TILES
#undef PANEL_TILE
}

/* out [rows, n] = x [rows, k] @ W.T, W as q4_build_panels_bf16 built it. */
int panel_linear_bf16(bf16 *restrict out, const bf16 *restrict x, const bf16 *restrict panels,
                      int64_t rows, int64_t n, int64_t k) {
    REQUIRE(rows >= 0);
    REQUIRE(n > 0 && n % 16 == 0);
    REQUIRE(k > 0 && k % Q4_GROUP == 0);
    if (!rows) return STATUS_OK; /* (panel_rows divides by its tiles) */
    const int64_t blocks = n / 16, count = (blocks + PANEL_BLOCKS - 1) / PANEL_BLOCKS;
    const int64_t size = k * PANEL_BLOCKS * 16;
    _Pragma("omp parallel for schedule(static) if (count > 1)")
    for (int64_t p = 0; p < count; p++) {
        const int64_t block = p * PANEL_BLOCKS;
        const bf16 *panel = panels + p * size;
        /* with a static schedule the next panel is this thread's (but at its last: harmless) */
        const char *next = (const char *)(p + 1 < count ? panel + size : panel);
        panel_rows(rows, blocks - block < PANEL_BLOCKS ? (int)(blocks - block) : PANEL_BLOCKS, x,
                   k, panel, out + block * 16, n, next);
    }
    return STATUS_OK;
}
#endif

/* ---- GGUF block formats, read as they are stored ---------------------------------------------
 *
 * A matrix [n, k] stored as a GGUF file stores it: each row k / weights-per-block blocks of the
 * format's bytes (ggml's layouts; gguf-py's quants.py reads them the same way). Per block:
 *   Q4_0 (32 weights, 18 bytes): d f16, 16 bytes of nibbles: w = d * (q - 8)
 *   Q4_1 (32, 20): d, m f16, 16 bytes of nibbles: w = d * q + m
 *   Q8_0 (32, 34): d f16, 32 int8: w = d * q
 *   Q4_K (256, 144): d, dmin f16, 12 bytes of 6-bit scales and mins (8 of each), 128 bytes of
 *       nibbles: w = (d * sc_s) * q - (dmin * m_s) per sub-block s of 32
 *   Q5_K (256, 176): as Q4_K, and 32 bytes holding each weight's fifth bit
 *   Q6_K (256, 210): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, d
 *       f16: w = (d * sc_s) * (q - 32) per sub-block s of 16
 * `gguf_dequantize_f32` computes each weight in float32 as gguf-py's dequantize does, bit for
 * bit: every product of a scale and q is exact in float32 (at most 24 significant bits), so a
 * fused multiply-add rounds exactly where numpy's multiply then add does. */
/* The formats' ggml type ids (gguf-py's GGMLQuantizationType), stated in the contract. */
#define GGML_TYPE_LIST(X)                                                                        \
    X(Q4_0, 2) X(Q4_1, 3) X(Q8_0, 8) X(Q4_K, 12) X(Q5_K, 13) X(Q6_K, 14)
#define GGML_ENUM(name, id) GGML_##name = id,
enum { GGML_TYPE_LIST(GGML_ENUM) };

static inline float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa * 2^-24, exact in float32 */
        float value = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* weights and bytes per block of a format (0: not one of these) */
static int64_t quant_block_weights(int64_t type) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q8_0: return 32;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return 256;
    default: return 0;
    }
}
static int64_t quant_block_bytes(int64_t type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}
/* bytes of `weights` weights of `type` in whole blocks: a row's, or an offset into one */
static int64_t quant_bytes(int64_t type, int64_t weights) {
    return weights / quant_block_weights(type) * quant_block_bytes(type);
}

/* Q4_K and Q5_K's 6-bit scale and min of sub-block s (ggml's get_scale_min_k4) */
static inline void scale_min_k4(int s, const uint8_t *q, float *sc, float *m) {
    if (s < 4) {
        *sc = (float)(q[s] & 63);
        *m = (float)(q[s + 4] & 63);
    } else {
        *sc = (float)((q[s + 4] & 0xf) | ((q[s - 4] >> 6) << 4));
        *m = (float)((q[s + 4] >> 4) | ((q[s] >> 6) << 4));
    }
}

#ifdef __AVX2__
/* Q4_K and Q5_K's 6-bit sc of sub-blocks 0-7 then m of 0-7 (scale_min_k4's), a byte each,
 * from the block's 12 bytes of them, 32 bits at a time (one 128-bit vector built whole: four
 * 32-bit stores read back as one load stall it). */
static inline __m128i k4_fields(const uint8_t *restrict packed_scales) {
    uint32_t packed[3]; /* three loads of 4 bytes: one memcpy of 12 went through the stack */
    for (int i = 0; i < 3; i++) memcpy(packed + i, packed_scales + 4 * i, sizeof packed[i]);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    return _mm_setr_epi32((int)(packed[0] & six),                                          /* sc 0-3 */
                          (int)((packed[2] & four) | (((packed[0] >> 6) & two) << 4)),     /* sc 4-7 */
                          (int)(packed[1] & six),                                          /* m 0-3 */
                          (int)(((packed[2] >> 4) & four) | (((packed[1] >> 6) & two) << 4))); /* m 4-7 */
}
#endif

/* One block's weights as float32, in order. */
static void dequantize_block(int64_t type, const uint8_t *restrict b, float *restrict y) {
    switch (type) {
    case GGML_Q4_0: {
        const float d = half_to_float(b);
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)((b[2 + i] & 0xf) - 8);
            y[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
        }
        break;
    }
    case GGML_Q4_1: {
        const float d = half_to_float(b), m = half_to_float(b + 2);
        for (int i = 0; i < 16; i++) {
            y[i] = d * (float)(b[4 + i] & 0xf) + m;
            y[i + 16] = d * (float)(b[4 + i] >> 4) + m;
        }
        break;
    }
    case GGML_Q8_0: {
        const float d = half_to_float(b);
        for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d;
        break;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *scales = b + 4;
        const uint8_t *high = type == GGML_Q5_K ? b + 16 : NULL;
        const uint8_t *qs = type == GGML_Q5_K ? b + 48 : b + 16;
        for (int s = 0; s < 8; s++) {
            float sc, m;
            scale_min_k4(s, scales, &sc, &m);
            const float scale = d * sc, shift = dmin * m;
            const uint8_t *nibbles = qs + (s / 2) * 32;
            for (int l = 0; l < 32; l++) {
                int q = (s & 1) ? nibbles[l] >> 4 : nibbles[l] & 0xf;
                if (high) q |= ((high[l] >> s) & 1) << 4;
                y[s * 32 + l] = scale * (float)q - shift;
            }
        }
        break;
    }
    case GGML_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_to_float(b + 208);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *low = ql + 64 * h, high = qh[32 * h + l];
                const int q[4] = {(low[l] & 0xf) | ((high & 3) << 4),
                                  (low[l + 32] & 0xf) | (((high >> 2) & 3) << 4),
                                  (low[l] >> 4) | (((high >> 4) & 3) << 4),
                                  (low[l + 32] >> 4) | (((high >> 6) & 3) << 4)};
                for (int t = 0; t < 4; t++) {
                    const int p = 128 * h + 32 * t + l;
                    y[p] = (d * (float)scales[p / 16]) * (float)(q[t] - 32);
                }
            }
        break;
    }
    }
}

/* The checks of every kernel that takes a GGUF matrix [n, k] of `type` (times `rows` rows of
 * x; dequantization: 1). */
static int check_blocks(int64_t type, int64_t rows, int64_t n, int64_t k) {
    if (!quant_block_weights(type)) return failed(STATUS_BAD_TYPE, ""); /* its value is shown */
    REQUIRE(rows >= 0 && n >= 0);
    REQUIRE(k > 0 && k % quant_block_weights(type) == 0);
    return STATUS_OK;
}

/* One row of k weights as float32 (builds below AVX2; above, dequantize_row_unpacked). */
__attribute__((unused)) static void dequantize_row(int64_t type, const uint8_t *restrict row,
                                                   float *restrict y, int64_t k) {
    const int64_t per = quant_block_weights(type), bytes = quant_block_bytes(type);
    for (int64_t i = 0; i < k / per; i++) dequantize_block(type, row + i * bytes, y + i * per);
}

/* ---- GGUF blocks times 8-bit activations, float32 (AVX2 and above) --------------------------
 *
 * out[r, j] (float32, row stride ldo) = x[r, :] . W[j, :] for float32 x and a matrix W [n, k]
 * in its GGUF blocks, as llama.cpp computes it on a CPU. Each row of x is quantized to int8
 * (round to nearest even, scale d = max |x| / 127, float32) per group of 32 for Q4_0, Q4_1 and
 * Q8_0 (ggml's Q8_0), per 256 for the K-quants (ggml's Q8_K); each group of 32 weights is
 * decoded into a register as int8 q (`group_q`: Q6_K's q - 32; Q4_0, Q4_1, Q4_K and Q5_K's
 * unsigned q as stored) and never stored, once for up to Q8_ROWS_MAX rows of x
 * (`q8_row_f32`). Every block's dot with x is an exact int32, and the float32 work is per 8
 * blocks, not per block (`q8_octet_f32`, `kquant_octet_f32`): the 8 dots gathered into one
 * vector (a lane a block), times the 8 W scales and x scales, summed in float32.
 *   Q4_0, Q4_1, Q8_0: the dot of the two int8 vectors (Q4_0's q - 8 as its unsigned q less
 *       8 times x's integer sum); Q4_1's m times the float32 sums of x over each 32.
 *   K-quants (`kquant_block_dots`): per group the pair sums of q * x (vpmaddubsw) times the
 *       group's integer scale (vpmaddwd; Q6_K's two per 16, one to each half; the scales
 *       unpacked in vectors, `kquant_scales`), summed in int32 over the block; Q4_K and
 *       Q5_K's offsets, -dmin * m per 32, times the float32 sums of x per 32.
 * Against float32 work per group (a conversion, the W scale decoded alone, a multiply-add),
 * this took the 1B shapes' decode steps at one row of x from 27.4 to 19.5 ms (Q4_0) and 28.6
 * to 21.2 ms (Q4_K_M), capped to AVX2 on an EPYC Zen 4 (bench/README.md). Steps of several
 * rows of x take W in transposed panels instead (`q8_panels_f32`, below), with the same bits.
 *
 * One portable driver (`quant_linear_q8_f32`: quantizing x, the loops and threads; the
 * decoding in 256-bit integer steps, which every level from AVX2 up has) and one micro-kernel
 * per level (`dot32_lanes`): with AVX-512 VNNI (and VL) vpdpbusd on 256 bits; with AVX-VNNI
 * its VEX form; with AVX2 vpmaddubsw then vpmaddwd. vpdpbusd and vpmaddubsw multiply unsigned
 * by signed bytes, so the signed formats' signs move onto x (vpsignb): |w| <= 128 and |x| <=
 * 127, so no pair sum of vpmaddubsw saturates. The panels' arithmetic runs on 512 bits with
 * AVX-512 BW (`pv_`, 16 rows of W a panel). A build without any of them has no such function
 * (the plan does not choose it there). */
/* dot32_lanes: the int32 sums of magnitude[i] * signed_x[i] (unsigned times signed bytes)
 * over each 4 of 32 (lane l: elements 4 l to 4 l + 3). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dot32_lanes(__m256i magnitude, __m256i signed_x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x);
}
#define HAS_Q8_DOT 1
#define Q8_DOT_VNNI 1 /* a single instruction: int32 sums, nothing gained by summing in int16 */
#elif defined(__AVXVNNI__)
static inline __m256i dot32_lanes(__m256i magnitude, __m256i signed_x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), magnitude, signed_x);
}
#define HAS_Q8_DOT 1
#define Q8_DOT_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256i dot32_lanes(__m256i magnitude, __m256i signed_x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1));
}
#define HAS_Q8_DOT 1
#endif

#ifdef HAS_Q8_DOT
#define Q8_X_GROUP 32 /* values of x per float32 scale */
#define Q8_ROWS_MAX 4 /* rows of x per pass over a row of W */


/* 32 bytes' low nibbles, then their high nibbles, as 64 int8 (0-15) */
static inline void nibbles64(int8_t *q, __m256i bytes) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    _mm256_storeu_si256((__m256i *)q, _mm256_and_si256(bytes, low4));
    _mm256_storeu_si256((__m256i *)(q + 32), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
}

/* One block as int8 q (in the weights' order) and float32 scales, one per 32 weights (Q6_K:
 * per 16), and the offsets per 32 of the formats with one (Q4_1's m, Q4_K and Q5_K's
 * -dmin * m): weight i = scale * q[i] + offset, gguf_dequantize_f32's value but for the
 * rounding of that sum. 256-bit integer steps, which every level from AVX2 up has. */
static void unpack_block(int64_t type, const uint8_t *restrict b, int8_t *restrict q,
                         float *restrict scale, float *restrict offset) {
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const int at = type == GGML_Q4_0 ? 2 : 4;
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + at));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes); /* 0-15, 16-31 */
        __m256i v = _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
        if (type == GGML_Q4_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
        _mm256_storeu_si256((__m256i *)q, v);
        scale[0] = half_f16c(b);
        if (type == GGML_Q4_1) offset[0] = half_f16c(b + 2);
        break;
    }
    case GGML_Q8_0:
        memcpy(q, b + 2, 32);
        scale[0] = half_f16c(b);
        break;
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const float d = half_f16c(b), dmin = half_f16c(b + 2);
        const uint8_t *qs = type == GGML_Q5_K ? b + 48 : b + 16;
        for (int s = 0; s < 8; s++) {
            float sc, m;
            scale_min_k4(s, b + 4, &sc, &m);
            scale[s] = d * sc;
            offset[s] = -(dmin * m);
        }
        for (int j = 0; j < 4; j++) /* sub-blocks 2 j and 2 j + 1: one run of 32 bytes */
            nibbles64(q + 64 * j, _mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
        if (type == GGML_Q5_K) { /* bit s of each of 32 bytes: sub-block s's fifth bits */
            const __m256i high = _mm256_loadu_si256((const __m256i *)(b + 16));
            for (int s = 0; s < 8; s++) {
                const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high, s), _mm256_set1_epi8(1));
                __m256i *at = (__m256i *)(q + 32 * s);
                _mm256_storeu_si256(at, _mm256_or_si256(_mm256_loadu_si256(at), _mm256_slli_epi16(bit, 4)));
            }
        }
        break;
    }
    case GGML_Q6_K: {
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_f16c(b + 208);
        for (int s = 0; s < 16; s++) scale[s] = d * (float)scales[s];
        const __m256i low4 = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(0x30);
        const __m256i bias = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) { /* weights 128 h + 32 t + l, t = 0-3, from ql and qh */
            const __m256i low[2] = {_mm256_loadu_si256((const __m256i *)(b + 64 * h)),
                                    _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32))};
            const __m256i high = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            for (int t = 0; t < 4; t++) {
                const __m256i nibble = t < 2 ? _mm256_and_si256(low[t], low4)
                                             : _mm256_and_si256(_mm256_srli_epi16(low[t - 2], 4), low4);
                /* bits 2 t, 2 t + 1 of qh moved to bits 4, 5 */
                const __m256i top = 2 * t >= 4 ? _mm256_srli_epi16(high, 2 * t - 4)
                                               : _mm256_slli_epi16(high, 4 - 2 * t);
                const __m256i v = _mm256_or_si256(nibble, _mm256_and_si256(top, two));
                _mm256_storeu_si256((__m256i *)(q + 128 * h + 32 * t), _mm256_sub_epi8(v, bias));
            }
        }
        break;
    }
    }
}

static int has_offsets(int64_t type) {
    return type == GGML_Q4_1 || type == GGML_Q4_K || type == GGML_Q5_K;
}

/* W scales per 32 weights (Q6_K: per 16) */
static int64_t scales_per_32(int64_t type) { return type == GGML_Q6_K ? 2 : 1; }

/* x [rows, k] as int8 per group of `group` values (32, or a K-quant block's 256: ggml's Q8_0
 * and Q8_K): q[i] = x[i] / d rounded to nearest even, d = max |x| / 127, one d per group;
 * where `sums` is given, the float32 sums of x per 32 (the offsets' factor); where `q_sums`
 * is, the integer sums of q per 32 (Q4_0's -8 times them). */
static void quantize_rows_q8(const float *restrict x, int64_t values, int64_t group,
                             int8_t *restrict q, float *restrict scale, float *restrict sums,
                             int32_t *restrict q_sums) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t g = 0; g < values / group; g++) {
        const float *xg = x + g * group;
        __m256 top = _mm256_setzero_ps();
        for (int64_t i = 0; i < group; i += 8) /* a NaN is passed over, as by fmaxf */
            top = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xg + i), magnitude), top);
        const __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        const __m128 pairs = _mm_max_ps(half, _mm_movehl_ps(half, half));
        const float amax = _mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
        const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        for (int64_t i = 0; i < group; i += 32) { /* clamped: NaN and rounding stay in range */
            __m256i lanes[4];
            for (int j = 0; j < 4; j++) {
                const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xg + i + 8 * j), _mm256_set1_ps(inverse));
                const __m256 clamped = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
                lanes[j] = _mm256_cvtps_epi32(_mm256_round_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            /* packs interleave 128-bit halves: vpermd puts the 32 bytes back in order */
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(lanes[0], lanes[1]),
                                                     _mm256_packs_epi32(lanes[2], lanes[3]));
            _mm256_storeu_si256((__m256i *)(q + g * group + i),
                                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            if (q_sums) /* the same 32 values in another order: an exact integer sum */
                q_sums[(g * group + i) / 32] = hsum_epi32(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1)));
        }
        scale[g] = d;
    }
    for (int64_t g = 0; sums && g < values / Q8_X_GROUP; g++) {
        const float *xg = x + g * Q8_X_GROUP;
        sums[g] = hsum256(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                                        _mm256_add_ps(_mm256_loadu_ps(xg + 16), _mm256_loadu_ps(xg + 24))));
    }
}

/* Group g (of 32 weights) of one block as 32 int8 q in registers: Q6_K's q - 32 (signed);
 * Q4_0, Q4_1, Q4_K and Q5_K's q as they are (0-31, unsigned); Q8_0's stored q. */
static inline __attribute__((always_inline)) __m256i group_q(const int64_t type,
                                                             const uint8_t *restrict b, int g) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        /* the 16 bytes in both halves (a load, no shuffle), the second's high nibbles down */
        const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + (type == GGML_Q4_0 ? 2 : 4))));
        return _mm256_and_si256(_mm256_srlv_epi64(bytes, _mm256_setr_epi64x(0, 0, 4, 4)), low4);
    }
    case GGML_Q8_0:
        return _mm256_loadu_si256((const __m256i *)(b + 2));
    case GGML_Q4_K:
    case GGML_Q5_K: { /* sub-blocks 2 j and 2 j + 1: the low and high nibbles of 32 bytes */
        const uint8_t *qs = type == GGML_Q5_K ? b + 48 : b + 16;
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * (g / 2)));
        __m256i v = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
        if (type == GGML_Q5_K) { /* bit g of each of 32 bytes: the fifth bits */
            const __m256i high = _mm256_loadu_si256((const __m256i *)(b + 16));
            const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high, g), _mm256_set1_epi8(1));
            v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
        }
        return v;
    }
    default: { /* Q6_K: weights 128 h + 32 t + l from ql and qh, h = g / 4, t = g % 4 */
        const int h = g / 4, t = g % 4;
        const __m256i low = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
        const __m256i nibble = _mm256_and_si256(t < 2 ? low : _mm256_srli_epi16(low, 4), low4);
        const __m256i high = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        /* bits 2 t, 2 t + 1 of qh moved to bits 4, 5 */
        const __m256i top = 2 * t >= 4 ? _mm256_srli_epi16(high, 2 * t - 4)
                                       : _mm256_slli_epi16(high, 4 - 2 * t);
        const __m256i v = _mm256_or_si256(nibble, _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
        return _mm256_sub_epi8(v, _mm256_set1_epi8(32));
    }
    }
}

static int signed_q(int64_t type) { return type == GGML_Q8_0 || type == GGML_Q6_K; }

/* Rows of x quantized to 8 bits (`quantize_rows_q8`): k int8 a row, a scale per group (32, or
 * a K-quant's 256), and where the format needs them, float32 sums per 32 (the offsets'
 * factor) and integer sums of q per 32 (Q4_0's). Row r of each at r times its row's length. */
typedef struct {
    const int8_t *q;
    const float *scale, *sums;
    const int32_t *q_sums;
    int64_t k, groups, scales; /* a row's values, groups of 32, and scales */
} q8_x;

/* What a row of W times a row of x sums over the blocks: the scaled integer dots, one lane a
 * block (block mod 8; lane 0 past the row's last 8), and the offsets times x's sums, one
 * lane a block (Q4_1, as the dots) or a group of 32 of the block (Q4_K, Q5_K). */
typedef struct {
    __m256 chain;
    __m256 offsets;
} q8_sums;

/* A K-quant block's integer sub-block scales as 16-bit lanes for vpmaddwd, one vector per
 * group of 32 (Q4_K and Q5_K: the 6-bit scale; Q6_K: its two int8 scales of 16, one to each
 * half), its d and (Q4_K, Q5_K) its offsets per 32, -dmin * m, one lane a group. */
static inline __attribute__((always_inline)) void kquant_scales(const int64_t type,
                                                                const uint8_t *restrict b,
                                                                __m256i *restrict scale16,
                                                                float *restrict d,
                                                                __m256 *restrict offsets) {
    if (type == GGML_Q6_K) { /* the 16 scales in both halves, 0-7 then 8-15 */
        *d = half_f16c(b + 208);
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        const __m256i halves[2] = {_mm256_permute2x128_si256(scales, scales, 0x00),
                                   _mm256_permute2x128_si256(scales, scales, 0x11)};
        _Pragma("GCC unroll 8")
        for (int g = 0; g < 8; g++) { /* scale 2 g to the first 16 lanes' bytes, 2 g + 1 after */
            const char lo = (char)(2 * (2 * g % 8)), hi = (char)(2 * ((2 * g + 1) % 8));
            scale16[g] = _mm256_shuffle_epi8(halves[g / 4],
                                             _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1,
                                                              lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1,
                                                              hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1,
                                                              hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1));
        }
        return;
    }
    /* the 6-bit sc and m of sub-blocks 0-7 (scale_min_k4's), 32 bits at a time */
    const __m128i fields = k4_fields(b + 4);
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(fields)); /* 8 x 16 bits, twice */
    _Pragma("GCC unroll 8")
    for (int g = 0; g < 8; g++)
        scale16[g] = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(2 * g | (2 * g + 1) << 8)));
    *d = half_f16c(b);
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8)));
    *offsets = _mm256_mul_ps(_mm256_set1_ps(-half_f16c(b + 2)), m);
}

/* One K-quant block of W (block `blk` of the row) times ROWS rows of x quantized per 256 (one
 * scale, ggml's Q8_K): per group of 32 the pair sums of q * x (vpmaddubsw) times the group's
 * integer scale (vpmaddwd, exact: |sum| < 2^21 a lane), summed in int32 over the block into
 * dots[r] (its lanes summed later: the block's exact dot), and the block's d; Q4_K and Q5_K's
 * offsets times x's float32 sums per 32 into each row's. */
static inline __attribute__((always_inline)) void kquant_block_dots(const int64_t type, const int ROWS,
                                                                    const uint8_t *restrict b, int64_t blk,
                                                                    const q8_x *restrict x,
                                                                    q8_sums *restrict sums,
                                                                    __m256i *restrict dots, float *restrict d) {
    __m256i scale16[8];
    __m256 offsets;
    kquant_scales(type, b, scale16, d, &offsets);
    if (type != GGML_Q6_K)
        for (int r = 0; r < ROWS; r++)
            sums[r].offsets = _mm256_fmadd_ps(offsets, _mm256_loadu_ps(x->sums + r * x->groups + 8 * blk),
                                              sums[r].offsets);
    for (int r = 0; r < ROWS; r++) dots[r] = _mm256_setzero_si256();
    _Pragma("GCC unroll 8") /* g a constant in group_q: its shifts immediate */
    for (int g = 0; g < 8; g++) {
        const __m256i q = group_q(type, b, g);
        const __m256i magnitude = signed_q(type) ? _mm256_sign_epi8(q, q) : q;
        for (int r = 0; r < ROWS; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x->q + r * x->k + 256 * blk + 32 * g));
            if (signed_q(type)) v = _mm256_sign_epi8(v, q);
            const __m256i pairs = _mm256_maddubs_epi16(magnitude, v);
            dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(pairs, scale16[g]));
        }
    }
}

/* Lane i: the sum of the 8 int32 of lanes[i] (8 blocks' dots to one each, exact). */
static inline __attribute__((always_inline)) __m256i sum_each8(const __m256i *restrict lanes) {
    const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(lanes[0], lanes[1]),
                                          _mm256_hadd_epi32(lanes[2], lanes[3]));
    const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(lanes[4], lanes[5]),
                                           _mm256_hadd_epi32(lanes[6], lanes[7]));
    /* low: blocks 0-3's sums of their first 4 lanes, then of their last 4; high: 4-7's */
    return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                            _mm256_permute2x128_si256(low, high, 0x31));
}

/* The 16-bit float fields at the start of 8 blocks (b + i * bytes) as float32, one lane a
 * block: each block's d and (Q4_1) the m after it. */
static inline __attribute__((always_inline)) void octet_halves(const uint8_t *restrict b,
                                                               int64_t bytes, __m256 *restrict d,
                                                               __m256 *restrict m) {
    uint32_t f[8]; /* 32 bits a block: d, then m (scalar loads: a gather is slower on Zen) */
    for (int i = 0; i < 8; i++) memcpy(f + i, b + i * bytes, sizeof(uint32_t));
    const __m256i fields = _mm256_setr_epi32((int)f[0], (int)f[1], (int)f[2], (int)f[3], (int)f[4],
                                             (int)f[5], (int)f[6], (int)f[7]);
    /* [d 0-3, m 0-3 | d 4-7, m 4-7] as 16 bits each, then the d and the m halves together */
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(fields, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(fields, 16)),
        _MM_SHUFFLE(3, 1, 2, 0));
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

/* 8 blocks of Q4_0, Q4_1 or Q8_0 (`b` the first, block `at` of the row) times ROWS rows of x
 * quantized per 32: each block's exact int32 dot of q and x (Q4_0: of its unsigned q, less 8
 * times x's integer sum), the blocks' dots as one vector, one lane a block, times W's scales
 * and x's in float32 into each row's chain; Q4_1's m times x's float32 sums into its
 * offsets. */
static inline __attribute__((always_inline)) void q8_octet_f32(const int64_t type, const int ROWS,
                                                               const uint8_t *restrict b, int64_t at,
                                                               const q8_x *restrict x,
                                                               q8_sums *restrict sums) {
    const int64_t bytes = quant_block_bytes(type);
    __m256i lanes[Q8_ROWS_MAX][8];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; i++) {
        const __m256i q = group_q(type, b + i * bytes, 0);
        const __m256i magnitude = signed_q(type) ? _mm256_sign_epi8(q, q) : q;
        for (int r = 0; r < ROWS; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x->q + r * x->k + 32 * (at + i)));
            if (signed_q(type)) v = _mm256_sign_epi8(v, q);
            lanes[r][i] = dot32_lanes(magnitude, v);
        }
    }
    __m256 d, m;
    octet_halves(b, bytes, &d, &m);
    for (int r = 0; r < ROWS; r++) {
        __m256i dots = sum_each8(lanes[r]);
        if (type == GGML_Q4_0) /* q - 8: 8 times x's sum less */
            dots = _mm256_sub_epi32(
                dots, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(x->q_sums + r * x->groups + at)), 3));
        const __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(x->scale + r * x->scales + at));
        sums[r].chain = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, sums[r].chain);
        if (type == GGML_Q4_1)
            sums[r].offsets = _mm256_fmadd_ps(m, _mm256_loadu_ps(x->sums + r * x->groups + at), sums[r].offsets);
    }
}

/* One block of Q4_0, Q4_1 or Q8_0 past a row's last 8 (block `at`), times ROWS rows of x:
 * its exact int32 dot, as `q8_octet_f32` has it, times both scales into the chain's first
 * lane (one rounding a block, as there); Q4_1's m times x's sum into the offsets' first. */
static inline __attribute__((always_inline)) void q8_tail_block_f32(const int64_t type, const int ROWS,
                                                                    const uint8_t *restrict b, int64_t at,
                                                                    const q8_x *restrict x,
                                                                    q8_sums *restrict sums) {
    const __m256i q = group_q(type, b, 0);
    const __m256i magnitude = signed_q(type) ? _mm256_sign_epi8(q, q) : q;
    const float d = half_f16c(b), m = type == GGML_Q4_1 ? half_f16c(b + 2) : 0.0f;
    for (int r = 0; r < ROWS; r++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(x->q + r * x->k + 32 * at));
        if (signed_q(type)) v = _mm256_sign_epi8(v, q);
        int32_t dot = hsum_epi32(dot32_lanes(magnitude, v));
        if (type == GGML_Q4_0) dot -= 8 * x->q_sums[r * x->groups + at]; /* q - 8 */
        sums[r].chain = _mm256_fmadd_ps(_mm256_setr_ps((float)dot, 0, 0, 0, 0, 0, 0, 0),
                                        _mm256_set1_ps(d * x->scale[r * x->scales + at]), sums[r].chain);
        if (type == GGML_Q4_1)
            sums[r].offsets = _mm256_fmadd_ps(_mm256_setr_ps(m, 0, 0, 0, 0, 0, 0, 0),
                                              _mm256_set1_ps(x->sums[r * x->groups + at]), sums[r].offsets);
    }
}

/* 8 K-quant blocks (`b` the first, block `at` of the row) times ROWS rows of x: each block's
 * exact int32 dot (`kquant_block_dots`), the 8 as one vector, one lane a block, times the
 * blocks' d and x's scales in float32 into each row's chain, as `q8_octet_f32` does. */
static inline __attribute__((always_inline)) void kquant_octet_f32(const int64_t type, const int ROWS,
                                                                   const uint8_t *restrict b, int64_t at,
                                                                   const q8_x *restrict x,
                                                                   q8_sums *restrict sums) {
    __m256i lanes[Q8_ROWS_MAX][8], dots[Q8_ROWS_MAX];
    float d[8];
    for (int i = 0; i < 8; i++) {
        kquant_block_dots(type, ROWS, b + i * quant_block_bytes(type), at + i, x, sums, dots, d + i);
        for (int r = 0; r < ROWS; r++) lanes[r][i] = dots[r];
    }
    for (int r = 0; r < ROWS; r++) {
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_loadu_ps(x->scale + r * x->scales + at));
        sums[r].chain = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_each8(lanes[r])), scale, sums[r].chain);
    }
}

/* One K-quant block past a row's last 8: its exact dot times both scales into the chain's
 * first lane, as `q8_tail_block_f32` does. */
static inline __attribute__((always_inline)) void kquant_tail_block_f32(const int64_t type, const int ROWS,
                                                                        const uint8_t *restrict b, int64_t at,
                                                                        const q8_x *restrict x,
                                                                        q8_sums *restrict sums) {
    __m256i dots[Q8_ROWS_MAX];
    float d;
    kquant_block_dots(type, ROWS, b, at, x, sums, dots, &d);
    for (int r = 0; r < ROWS; r++)
        sums[r].chain = _mm256_fmadd_ps(_mm256_setr_ps((float)hsum_epi32(dots[r]), 0, 0, 0, 0, 0, 0, 0),
                                        _mm256_set1_ps(d * x->scale[r * x->scales + at]), sums[r].chain);
}

/* One row of W (`row`) times ROWS rows of quantized x, into out[r * ldo]: each block decoded
 * into registers once for all ROWS. Every row of x sums its blocks in one order whatever ROWS
 * is (q8_sums), so a row's output never depends on the others. */
static inline __attribute__((always_inline)) void q8_row_f32(const int64_t type, const int ROWS,
                                                             const uint8_t *restrict row,
                                                             const q8_x *restrict x,
                                                             float *restrict out, int64_t ldo) {
    const int64_t per = quant_block_weights(type), bytes = quant_block_bytes(type);
    const int64_t blocks = x->k / per;
    q8_sums sums[Q8_ROWS_MAX];
    for (int r = 0; r < ROWS; r++) sums[r].chain = sums[r].offsets = _mm256_setzero_ps();
    int64_t blk = 0; /* 8 blocks at a time, then one at a time */
    for (; blk + 8 <= blocks; blk += 8)
        if (per == 32) q8_octet_f32(type, ROWS, row + blk * bytes, blk, x, sums);
        else kquant_octet_f32(type, ROWS, row + blk * bytes, blk, x, sums);
    for (; blk < blocks; blk++)
        if (per == 32) q8_tail_block_f32(type, ROWS, row + blk * bytes, blk, x, sums);
        else kquant_tail_block_f32(type, ROWS, row + blk * bytes, blk, x, sums);
    for (int r = 0; r < ROWS; r++) out[r * ldo] = hsum256(sums[r].chain) + hsum256(sums[r].offsets);
}

/* q8_row_f32 for each format, with its ROWS (1 to Q8_ROWS_MAX) a constant */
#define Q8_ROW_OF(NAME)                                                                           \
    static void q8_row_##NAME(int rows, const uint8_t *restrict row, const q8_x *restrict x,     \
                              float *restrict out, int64_t ldo) {                                \
        switch (rows) {                                                                           \
        case 1: q8_row_f32(GGML_##NAME, 1, row, x, out, ldo); break;                              \
        case 2: q8_row_f32(GGML_##NAME, 2, row, x, out, ldo); break;                              \
        case 3: q8_row_f32(GGML_##NAME, 3, row, x, out, ldo); break;                              \
        default: q8_row_f32(GGML_##NAME, 4, row, x, out, ldo); break;                             \
        }                                                                                         \
    }
Q8_ROW_OF(Q4_0)
Q8_ROW_OF(Q4_1)
Q8_ROW_OF(Q8_0)
Q8_ROW_OF(Q4_K)
Q8_ROW_OF(Q5_K)
Q8_ROW_OF(Q6_K)
typedef void (*q8_row_fn)(int, const uint8_t *, const q8_x *, float *, int64_t);
static q8_row_fn q8_row_of(int64_t type) {
    switch (type) {
    case GGML_Q4_0: return q8_row_Q4_0;
    case GGML_Q4_1: return q8_row_Q4_1;
    case GGML_Q8_0: return q8_row_Q8_0;
    case GGML_Q4_K: return q8_row_Q4_K;
    case GGML_Q5_K: return q8_row_Q5_K;
    default: return q8_row_Q6_K;
    }
}

/* ---- Many rows of x: W in panels of 8 or 16 rows, transposed ----------------------------------
 *
 * For steps of several rows of x (`panel_min_rows`), `q8_panels_f32` decodes PANEL_W rows of W
 * at a time into a buffer of the thread's (`panel_pack`) in which every group of 32 weights is
 * 8 vectors, vector kk holding the rows' bytes 4 kk to 4 kk + 3 (one lane a row of W), then
 * multiplies every row of x by it: x's 4 bytes broadcast, one vpmaddubsw (or vpdpbusd) gives
 * the rows' pair sums at once, so the decoding is paid once per panel for all the rows of x,
 * and no horizontal sum is left to do per block. PANEL_W is 8 (256-bit vectors) from AVX2 up
 * and 16 with AVX-512 BW (512-bit, `pv_` below): a 16-row panel is two 8-row halves packed by
 * the same 256-bit code, their vectors interleaved, so that one 512-bit load takes a vector's
 * 16 rows. The K-quants' integer scales and
 * offsets are laid out the same way, one lane a row of W. Each output is the float32 that
 * `q8_row_f32` computes, bit for bit: the same exact int32 dot per block, rounded by the same
 * fused multiply-add into the same chain lane (block mod 8 within whole octets, lane 0 past
 * them), the offsets into the same lane, the lanes summed in hsum256's order. Memory per
 * thread: one chunk of a panel (PANEL_CHUNK values of PANEL_W rows of W, 9-19 KiB by format)
 * and the sums of each row of x (PANEL_W * 64 bytes a row); never a copy of the matrix. */
#define PANEL_ROWS 8 /* rows of x per pass over a panel: their sums stay in L1 */

/* The panels' vectors, one lane a row of W, and the few operations on them */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PANEL_HALVES 2
typedef __m512i pv_i;
typedef __m512 pv_f;
#define pv_maddubs _mm512_maddubs_epi16
#define pv_madd _mm512_madd_epi16
#define pv_add16 _mm512_add_epi16
#define pv_add32 _mm512_add_epi32
#define pv_sub32 _mm512_sub_epi32
#define pv_set32 _mm512_set1_epi32
#define pv_zero_i _mm512_setzero_si512
#define pv_cvt _mm512_cvtepi32_ps
#define pv_as_f _mm512_castsi512_ps
#define pv_as_i _mm512_castps_si512
#define pv_fma _mm512_fmadd_ps
#define pv_mul _mm512_mul_ps
#define pv_addf _mm512_add_ps
#define pv_setf _mm512_set1_ps
#define pv_storef _mm512_storeu_ps
/* x's bytes negated where W's are negative (no vpsignb at 512 bits; where W's byte is 0 its
 * magnitude is 0, so the product is 0 either way) */
static inline pv_i pv_sign(pv_i x, pv_i w) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
#ifdef Q8_DOT_VNNI
static inline pv_i pv_dot32_lanes(pv_i magnitude, pv_i signed_x) {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_x);
}
#else
static inline pv_i pv_dot32_lanes(pv_i magnitude, pv_i signed_x) {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed_x), _mm512_set1_epi16(1));
}
#endif
#else
#define PANEL_HALVES 1
typedef __m256i pv_i;
typedef __m256 pv_f;
#define pv_maddubs _mm256_maddubs_epi16
#define pv_madd _mm256_madd_epi16
#define pv_add16 _mm256_add_epi16
#define pv_add32 _mm256_add_epi32
#define pv_sub32 _mm256_sub_epi32
#define pv_set32 _mm256_set1_epi32
#define pv_zero_i _mm256_setzero_si256
#define pv_cvt _mm256_cvtepi32_ps
#define pv_as_f _mm256_castsi256_ps
#define pv_as_i _mm256_castps_si256
#define pv_fma _mm256_fmadd_ps
#define pv_mul _mm256_mul_ps
#define pv_addf _mm256_add_ps
#define pv_setf _mm256_set1_ps
#define pv_storef _mm256_storeu_ps
#define pv_sign _mm256_sign_epi8
#define pv_dot32_lanes dot32_lanes
#endif
#define PANEL_W (8 * PANEL_HALVES) /* rows of W per panel */

/* Rows of x from which the panels beat the row kernel, one thread capped to AVX2 on an EPYC
 * Zen 4 (2,048 x 2,048 unless said): Q4_0 and Q4_1 from 3 (1.1x at 3 rows, 1.7x at 16); Q8_0
 * from 5 (its signs cost a vpsignb and a vpmaddwd per 4 bytes: 0.94x at 4 rows, 1.1-1.2x from
 * 5); Q4_K and Q5_K from 5 (1.0x at 4, 1.2x at 5: the row kernel takes 4 rows a pass, 1.3x at
 * 8, 1.4-1.6x at 16); Q6_K from 6 (signs again; 1.0x at 5-6, 1.05-1.1x at 8, 1.3x at 16). */
static int64_t panel_min_rows(int64_t type) {
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: return 3;
    case GGML_Q6_K: return 6;
    default: return 5;
    }
}

/* Where each part of a panel's block (PANEL_W rows of W) starts, in vectors: per group of
 * 32 the 8 vectors of magnitudes (the unsigned formats' q), the signed formats' q as many
 * again; the K-quants' integer scales as int16 pairs (one vector per group, Q6_K's two: one
 * per 16), Q4_K and Q5_K's float32 offsets (one vector per group), then d, then Q4_1's m. */
typedef struct {
    int q, sign, scale, offset, d, m, vectors;
} panel_layout;

static inline panel_layout panel_layout_of(int64_t type) {
    const int groups = (int)quant_block_weights(type) / 32;
    panel_layout at = {.q = 0, .sign = 8 * groups};
    at.scale = 8 * groups * (signed_q(type) ? 2 : 1);
    at.offset = at.scale + (type == GGML_Q6_K ? 16 : groups == 8 ? 8 : 0);
    at.d = at.offset + (type == GGML_Q4_K || type == GGML_Q5_K ? 8 : 0);
    at.m = at.d + 1;
    at.vectors = at.m + (type == GGML_Q4_1 ? 1 : 0);
    return at;
}

/* the 8 x 8 int32 of rows[0-7] transposed in place: rows[kk] lane c = old rows[c] lane kk */
static inline __attribute__((always_inline)) void transpose8_epi32(__m256i *restrict rows) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        rows[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        rows[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* 8 rows of W (`w`, row_bytes apart) as half `half` of a panel: its vector i at 256-bit
 * position i * PANEL_HALVES + half */
static inline __attribute__((always_inline)) void panel_pack_half(const int64_t type, const uint8_t *restrict w,
                                                                  int64_t row_bytes, int64_t blocks,
                                                                  __m256i *restrict panel, int half) {
    const panel_layout at = panel_layout_of(type);
    const int64_t bytes = quant_block_bytes(type), groups = quant_block_weights(type) / 32;
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m256i *half_v = panel + PANEL_HALVES * blk * at.vectors + half; /* vector i: [PANEL_HALVES * i] */
        _Pragma("GCC unroll 8") /* g a constant in group_q */
        for (int g = 0; g < groups; g++) {
            __m256i q[8];
            for (int c = 0; c < 8; c++) q[c] = group_q(type, w + c * row_bytes + blk * bytes, g);
            transpose8_epi32(q);
            for (int kk = 0; kk < 8; kk++) {
                half_v[PANEL_HALVES * (at.q + 8 * g + kk)] =
                    signed_q(type) ? _mm256_sign_epi8(q[kk], q[kk]) : q[kk];
                if (signed_q(type)) half_v[PANEL_HALVES * (at.sign + 8 * g + kk)] = q[kk];
            }
        }
        float d[8], m[8];
        __m256i scale[2][8], offset[8]; /* per row of W, then transposed: per group, a lane a row */
        for (int c = 0; c < 8; c++) {
            const uint8_t *b = w + c * row_bytes + blk * bytes;
            d[c] = half_f16c(type == GGML_Q6_K ? b + 208 : b);
            if (type == GGML_Q4_1) m[c] = half_f16c(b + 2);
            if (type == GGML_Q4_K || type == GGML_Q5_K) { /* kquant_scales' values */
                const __m128i fields = k4_fields(b + 4); /* sc 0-7, m 0-7 */
                scale[0][c] = _mm256_cvtepu8_epi32(fields);
                offset[c] = _mm256_castps_si256(_mm256_mul_ps(_mm256_set1_ps(-half_f16c(b + 2)),
                                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8)))));
            }
            if (type == GGML_Q6_K) {
                const __m128i scales = _mm_loadu_si128((const __m128i *)(b + 192));
                scale[0][c] = _mm256_cvtepi8_epi32(scales);
                scale[1][c] = _mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8));
            }
        }
        half_v[PANEL_HALVES * at.d] = _mm256_castps_si256(_mm256_loadu_ps(d));
        if (type == GGML_Q4_1) half_v[PANEL_HALVES * at.m] = _mm256_castps_si256(_mm256_loadu_ps(m));
        for (int part = 0; part < (at.offset - at.scale) / 8; part++) { /* each scale in both int16 */
            transpose8_epi32(scale[part]);
            for (int s = 0; s < 8; s++)
                half_v[PANEL_HALVES * (at.scale + 8 * part + s)] =
                    _mm256_or_si256(_mm256_and_si256(scale[part][s], _mm256_set1_epi32(0xffff)),
                                    _mm256_slli_epi32(scale[part][s], 16));
        }
        if (at.d > at.offset) {
            transpose8_epi32(offset);
            for (int g = 0; g < 8; g++) half_v[PANEL_HALVES * (at.offset + g)] = offset[g];
        }
    }
}

/* PANEL_W rows of W as a panel, each 8 as a half */
static inline __attribute__((always_inline)) void panel_pack(const int64_t type, const uint8_t *restrict w,
                                                             int64_t row_bytes, int64_t blocks,
                                                             pv_i *restrict panel) {
    for (int half = 0; half < PANEL_HALVES; half++)
        panel_pack_half(type, w + 8 * half * row_bytes, row_bytes, blocks, (__m256i *)panel, half);
}

static inline pv_i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return pv_set32(v);
}

/* One per-32 block of a panel (`magnitude`, `sign`: its 8 vectors each) times 32 int8 of x:
 * the rows' exact int32 dots, one lane a row of W, by the level's `dot32_lanes` per 4 bytes
 * of x. Without VNNI the 4-bit formats' vpmaddubsw pair sums add up in int16 first (8 of
 * them: |sum| <= 8 * 2 * 15 * 127 < 2^15), then one vpmaddwd. */
static inline __attribute__((always_inline)) pv_i panel_dot32(const int64_t type,
                                                              const pv_i *restrict magnitude,
                                                              const pv_i *restrict sign,
                                                              const int8_t *restrict x) {
#ifndef Q8_DOT_VNNI
    if (!signed_q(type)) {
        pv_i pairs = pv_maddubs(magnitude[0], broadcast4(x));
        for (int kk = 1; kk < 8; kk++)
            pairs = pv_add16(pairs, pv_maddubs(magnitude[kk], broadcast4(x + 4 * kk)));
        return pv_madd(pairs, pv_set32(0x00010001));
    }
#endif
    pv_i dot = pv_zero_i();
    for (int kk = 0; kk < 8; kk++) {
        pv_i v = broadcast4(x + 4 * kk);
        if (signed_q(type)) v = pv_sign(v, sign[kk]);
        dot = pv_add32(dot, pv_dot32_lanes(magnitude[kk], v));
    }
    return dot;
}

/* One K-quant block of a panel (`v`) times TILE rows of x (256 int8 each, `k` apart): the
 * panel rows' exact int32 dots, into dots[0 to TILE - 1]; each group's vectors of W loaded once for
 * the TILE rows. Per group the pair sums add up in int16 over 8 vectors (Q4_K: |sum| <= 8 * 2
 * * 15 * 127) or 4 (Q5_K's 31, Q6_K's |q - 32| <= 32; Q6_K's scale changes after 4 anyway),
 * then times the integer scale by vpmaddwd into int32. */
static inline __attribute__((always_inline)) void panel_dots_k(const int64_t type, const int TILE,
                                                               const pv_i *restrict v,
                                                               const int8_t *restrict x, int64_t k,
                                                               pv_i *restrict dots) {
    const panel_layout at = panel_layout_of(type);
    const int run = type == GGML_Q4_K ? 8 : 4; /* vectors per int16 sum */
    for (int r = 0; r < TILE; r++) dots[r] = pv_zero_i();
    for (int g = 0; g < 8; g++) {
        pv_i magnitude[8], sign[8];
        for (int kk = 0; kk < 8; kk++) {
            magnitude[kk] = v[at.q + 8 * g + kk];
            if (signed_q(type)) sign[kk] = v[at.sign + 8 * g + kk];
        }
        for (int r = 0; r < TILE; r++)
            for (int h = 0; h < 8 / run; h++) {
                pv_i pairs = pv_zero_i();
                for (int kk = h * run; kk < (h + 1) * run; kk++) {
                    pv_i xv = broadcast4(x + r * k + 32 * g + 4 * kk);
                    if (signed_q(type)) xv = pv_sign(xv, sign[kk]);
                    pairs = pv_add16(pairs, pv_maddubs(magnitude[kk], xv));
                }
                dots[r] = pv_add32(dots[r], pv_madd(pairs, v[at.scale + (type == GGML_Q6_K ? 2 * g + h : g)]));
            }
    }
}

#define PANEL_K_TILE 4 /* rows of x per pass over a K-quant block's vectors (in registers) */

/* A row of x's sums over a panel's rows of W (one lane each): q8_sums' lanes, a vector each */
typedef struct {
    pv_f chain[8], offsets[8];
} panel_sums;

/* A panel of `count` blocks (W's blocks `first` on, of a row's `blocks`) times `rows` (<=
 * PANEL_ROWS) rows of quantized x, added to their sums */
static inline __attribute__((always_inline)) void panel_rows_f32(const int64_t type, int rows,
                                                                 const pv_i *restrict panel,
                                                                 int64_t first, int64_t count,
                                                                 int64_t blocks, const q8_x *restrict x,
                                                                 panel_sums *restrict sums) {
    const panel_layout at = panel_layout_of(type);
    const int64_t per = quant_block_weights(type), octets = blocks / 8 * 8;
    for (int64_t blk = first; blk < first + count; blk++) {
        const pv_i *v = panel + (blk - first) * at.vectors;
        pv_i magnitude[8], sign[8]; /* a per-32 block's, in registers for all the rows */
        for (int kk = 0; per == 32 && kk < 8; kk++) {
            magnitude[kk] = v[at.q + kk];
            if (signed_q(type)) sign[kk] = v[at.sign + kk];
        }
        pv_i dots[PANEL_ROWS]; /* the K-quants' (a per-32 block's as they are used) */
        for (int r = 0; per == 256 && r < rows; r += PANEL_K_TILE) {
            const int8_t *xq = x->q + r * x->k + 256 * blk;
            switch (rows - r < PANEL_K_TILE ? rows - r : PANEL_K_TILE) {
            case 4: panel_dots_k(type, 4, v, xq, x->k, dots + r); break;
            case 3: panel_dots_k(type, 3, v, xq, x->k, dots + r); break;
            case 2: panel_dots_k(type, 2, v, xq, x->k, dots + r); break;
            default: panel_dots_k(type, 1, v, xq, x->k, dots + r);
            }
        }
        const pv_f d = pv_as_f(v[at.d]);
        const int lane = blk < octets ? (int)(blk % 8) : 0;
        for (int r = 0; r < rows; r++) {
            pv_i dot = per == 32 ? panel_dot32(type, magnitude, sign, x->q + r * x->k + 32 * blk) : dots[r];
            if (type == GGML_Q4_0) /* q - 8: 8 times x's sum less */
                dot = pv_sub32(dot, pv_set32(8 * x->q_sums[r * x->groups + blk]));
            const pv_f scale = pv_mul(d, pv_setf(x->scale[r * x->scales + blk]));
            sums[r].chain[lane] = pv_fma(pv_cvt(dot), scale, sums[r].chain[lane]);
            const float *x_sums = x->sums + r * x->groups + per / 32 * blk;
            if (type == GGML_Q4_1)
                sums[r].offsets[lane] = pv_fma(pv_as_f(v[at.m]), pv_setf(x_sums[0]), sums[r].offsets[lane]);
            if (type == GGML_Q4_K || type == GGML_Q5_K)
                for (int g = 0; g < 8; g++)
                    sums[r].offsets[g] = pv_fma(pv_as_f(v[at.offset + g]), pv_setf(x_sums[g]), sums[r].offsets[g]);
        }
    }
}

/* each row's sums into out[r * ldo + 0 to PANEL_W - 1]: the lanes added in hsum256's order,
 * PANEL_W at once */
static void panel_store(int64_t rows, const panel_sums *restrict sums, float *restrict out, int64_t ldo) {
    for (int64_t r = 0; r < rows; r++) {
        pv_f total[2];
        for (int s = 0; s < 2; s++) {
            const pv_f *t = s ? sums[r].offsets : sums[r].chain;
            const pv_f m0 = pv_addf(t[0], t[4]), m1 = pv_addf(t[1], t[5]);
            const pv_f m2 = pv_addf(t[2], t[6]), m3 = pv_addf(t[3], t[7]);
            total[s] = pv_addf(pv_addf(m0, m1), pv_addf(m2, m3));
        }
        pv_storef(out + r * ldo, pv_addf(total[0], total[1]));
    }
}

/* values of a row of W per panel: panel and x's rows stay in L1 (the same bytes at 8 and 16
 * rows of W) */
#define PANEL_CHUNK (1024 / PANEL_HALVES)

/* W's PANEL_W rows at `w` times every row of x, PANEL_CHUNK values at a time (each packed once, then
 * multiplied by PANEL_ROWS rows of x at a time), a format's constants inlined */
#define PANEL_OF(NAME)                                                                            \
    static void panel_##NAME(const uint8_t *restrict w, int64_t row_bytes, int64_t blocks,        \
                             pv_i *restrict panel, panel_sums *restrict sums, int64_t rows,       \
                             const q8_x *restrict x, float *restrict out, int64_t ldo) {          \
        const int64_t chunk = PANEL_CHUNK / quant_block_weights(GGML_##NAME);                     \
        memset(sums, 0, (size_t)rows * sizeof *sums);                                             \
        for (int64_t first = 0; first < blocks; first += chunk) {                                 \
            const int64_t count = blocks - first < chunk ? blocks - first : chunk;                \
            panel_pack(GGML_##NAME, w + first * quant_block_bytes(GGML_##NAME), row_bytes, count, \
                       panel);                                                                    \
            for (int64_t r = 0; r < rows; r += PANEL_ROWS) {                                      \
                const q8_x part = {x->q + r * x->k, x->scale + r * x->scales,                     \
                                   x->sums ? x->sums + r * x->groups : NULL,                      \
                                   x->q_sums ? x->q_sums + r * x->groups : NULL, x->k, x->groups, \
                                   x->scales};                                                    \
                panel_rows_f32(GGML_##NAME, (int)(rows - r < PANEL_ROWS ? rows - r : PANEL_ROWS), \
                               panel, first, count, blocks, &part, sums + r);                     \
            }                                                                                     \
        }                                                                                         \
        panel_store(rows, sums, out, ldo);                                                        \
    }
PANEL_OF(Q4_0)
PANEL_OF(Q4_1)
PANEL_OF(Q8_0)
PANEL_OF(Q4_K)
PANEL_OF(Q5_K)
PANEL_OF(Q6_K)
typedef void (*panel_fn)(const uint8_t *, int64_t, int64_t, pv_i *, panel_sums *, int64_t,
                         const q8_x *, float *, int64_t);
static panel_fn panel_of(int64_t type) {
    switch (type) {
    case GGML_Q4_0: return panel_Q4_0;
    case GGML_Q4_1: return panel_Q4_1;
    case GGML_Q8_0: return panel_Q8_0;
    case GGML_Q4_K: return panel_Q4_K;
    case GGML_Q5_K: return panel_Q5_K;
    default: return panel_Q6_K;
    }
}

/* Bytes of one thread's scratch for the panels: a chunk of a panel, then each row of x's sums
 * (both multiples of 64) */
static size_t panel_scratch_bytes(int64_t type, int64_t rows) {
    const int64_t vectors = PANEL_CHUNK / quant_block_weights(type) * panel_layout_of(type).vectors;
    return (size_t)vectors * sizeof(pv_i) + (size_t)rows * sizeof(panel_sums);
}

/* W's first n / PANEL_W * PANEL_W rows in panels, threads over the panels (thread t's scratch at
 * scratch + t * panel_scratch_bytes); the rest is the caller's */
static void q8_panels_f32(int64_t type, const uint8_t *restrict w, int64_t row_bytes, int64_t n,
                          const q8_x *restrict x, int64_t rows, float *restrict out, int64_t ldo,
                          uint8_t *restrict scratch) {
    const panel_fn run = panel_of(type);
    const int64_t blocks = x->k / quant_block_weights(type);
    const size_t mine = panel_scratch_bytes(type, rows), sums_at = mine - (size_t)rows * sizeof(panel_sums);
    _Pragma("omp parallel if (n > 16)")
    {
        uint8_t *at = scratch + (size_t)omp_get_thread_num() * mine;
        _Pragma("omp for schedule(static)")
        for (int64_t j = 0; j < n / PANEL_W * PANEL_W; j += PANEL_W)
            run(w + j * row_bytes, row_bytes, blocks, (pv_i *)at, (panel_sums *)(at + sums_at), rows, x,
                out + j, ldo);
    }
}

static size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

int quant_linear_q8_f32(float *restrict out, const float *restrict x, const uint8_t *restrict w,
                        int64_t type, int64_t rows, int64_t n, int64_t k, int64_t ldo) {
    CHECKED(check_blocks(type, rows, n, k));
    REQUIRE(ldo >= n); /* out's row stride */
    if (!rows || !n) return STATUS_OK;
    const int64_t groups = k / Q8_X_GROUP, per = quant_block_weights(type);
    const int64_t x_group = per == 256 ? 256 : Q8_X_GROUP, scales = k / x_group;
    const int64_t row_bytes = quant_bytes(type, k);
    const int panels = rows >= panel_min_rows(type) && n >= PANEL_W;
    /* The call's scratch in one allocation: x quantized (q, scales, and the sums per 32 of the
     * formats that read them: the offsets' formats, Q4_0), then each thread's panels. */
    const size_t q_bytes = round64((size_t)(rows * k)), scale_bytes = round64((size_t)(rows * scales) * sizeof(float));
    const size_t sums_bytes = has_offsets(type) ? round64((size_t)(rows * groups) * sizeof(float)) : 0;
    const size_t q_sums_bytes = type == GGML_Q4_0 ? round64((size_t)(rows * groups) * sizeof(int32_t)) : 0;
    const size_t panel_bytes = panels ? (size_t)omp_get_max_threads() * panel_scratch_bytes(type, rows) : 0;
    uint8_t *scratch = aligned_alloc(64, q_bytes + scale_bytes + sums_bytes + q_sums_bytes + panel_bytes);
    if (!scratch) return failed(STATUS_NO_MEMORY, "aligned_alloc of x quantized to 8 bits and the threads' panels");
    int8_t *xq = (int8_t *)scratch;
    float *x_scale = (float *)(scratch + q_bytes);
    float *x_sums = sums_bytes ? (float *)(scratch + q_bytes + scale_bytes) : NULL;
    int32_t *x_q_sums = q_sums_bytes ? (int32_t *)(scratch + q_bytes + scale_bytes + sums_bytes) : NULL;
    quantize_rows_q8(x, rows * k, x_group, xq, x_scale, x_sums, x_q_sums);
    const q8_x all = {xq, x_scale, x_sums, x_q_sums, k, groups, scales};
    int64_t first = 0; /* W's first row left to the row kernel */
    if (panels) {
        q8_panels_f32(type, w, row_bytes, n, &all, rows, out, ldo,
                      scratch + q_bytes + scale_bytes + sums_bytes + q_sums_bytes);
        first = n / PANEL_W * PANEL_W;
    }
    const q8_row_fn run = q8_row_of(type);
    _Pragma("omp parallel for schedule(static) if (n - first > 16)")
    for (int64_t j = first; j < n; j++)
        for (int64_t r = 0; r < rows; r += Q8_ROWS_MAX) { /* a second pass reads the row from L1 */
            const q8_x part = {xq + r * k, x_scale + r * scales, x_sums ? x_sums + r * groups : NULL,
                               x_q_sums ? x_q_sums + r * groups : NULL, k, groups, scales};
            run((int)(rows - r < Q8_ROWS_MAX ? rows - r : Q8_ROWS_MAX), w + j * row_bytes, &part,
                out + r * ldo + j, ldo);
        }
    free(scratch);
    return STATUS_OK;
}

/* One row of k weights as float32 from its unpacked blocks, 8 at a time: gguf_dequantize_f32's
 * values bit for bit (where an offset is added, scale * q is exact in float32, so the fused
 * multiply-add rounds where numpy's multiply then add does; elsewhere one multiply, as
 * numpy's, which keeps the sign of a zero). */
static void dequantize_row_unpacked(int64_t type, const uint8_t *restrict row,
                                    float *restrict y, int64_t k, int8_t *restrict q,
                                    float *restrict scale, float *restrict offset) {
    const int64_t per = quant_block_weights(type), halves = scales_per_32(type);
    for (int64_t b = 0; b < k / per; b++)
        unpack_block(type, row + b * quant_block_bytes(type), q + b * per,
                     scale + b * (per / 32) * halves, offset + b * (per / 32));
    for (int64_t i = 0; i < k; i += 8) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))));
        const __m256 sc = _mm256_broadcast_ss(scale + i / (32 / halves));
        _mm256_storeu_ps(y + i, has_offsets(type) ? _mm256_fmadd_ps(sc, v, _mm256_broadcast_ss(offset + i / 32))
                                                  : _mm256_mul_ps(sc, v));
    }
}
#endif

/* out [n, k] float32 = the matrix w of `type` (rows of k / weights-per-block blocks); from
 * AVX2 up through the 8-bit kernel's unpacking (a buffer of the thread's), else by block. */
int gguf_dequantize_f32(float *restrict out, const uint8_t *restrict w, int64_t type, int64_t n,
                        int64_t k) {
    CHECKED(check_blocks(type, 1, n, k));
    const int64_t row_bytes = quant_bytes(type, k);
#ifdef HAS_Q8_DOT
    const int64_t groups = k / Q8_X_GROUP;
    int status = STATUS_OK; /* the threads' first failure */
    _Pragma("omp parallel if (n * k > 65536)")
    {
        int8_t *q = malloc((size_t)k + (size_t)(groups * 3) * sizeof(float));
        if (!q) {
            _Pragma("omp atomic write")
            status = STATUS_NO_MEMORY;
        }
        float *scale = (float *)(q + k), *offset = scale + 2 * groups;
        _Pragma("omp for schedule(static)")
        for (int64_t r = 0; r < n; r++)
            if (q) dequantize_row_unpacked(type, w + r * row_bytes, out + r * k, k, q, scale, offset);
        free(q);
    }
    return status ? failed(status, "malloc of a thread's unpacked row") : STATUS_OK;
#else
    _Pragma("omp parallel for schedule(static) if (n * k > 65536)")
    for (int64_t r = 0; r < n; r++) dequantize_row(type, w + r * row_bytes, out + r * k, k);
    return STATUS_OK;
#endif
}

#ifdef HAS_Q8_DOT
/* ---- GGUF blocks times float32 x: many rows (AVX2 and above) ---------------------------------
 *
 * out[r, j] (row stride ldo) = x[r, :] . W[j, :] for float32 x and W [n, k] in its GGUF blocks:
 * the steps too large for x in 8 bits (prefill). One driver (`quant_gemm_f32`): x packed once
 * in tiles of GEMM_MR rows (`gemm_pack_x`); each thread takes GEMM_NC rows of W at a time and
 * GEMM_KC values of them at a time, unpacked into a buffer in L2 in the layout the micro-kernel
 * reads (`gemm_pack_w`), then for each tile of x (in L1 for all of them) every GEMM_NR rows of
 * W (`gemm_tile`), adding into out. Each output sums its products in the same order whatever
 * the other rows are. No tile of the matrix is ever in memory: a chunk a thread, and x's copy.
 * The micro-kernel is the level's:
 *  - AVX2 (16 vector registers): x exact, W as gguf_dequantize_f32's float32 values; BLIS's
 *    Haswell micro-kernel: 6 rows of x by 16 of W in 12 float32 accumulators, per value 2
 *    loads of W, 6 broadcasts of x, 12 fused multiply-adds. Against tiles of 16 MiB
 *    dequantized and torch's matmul, the 1B shape's four layer matrices, two threads of a Zen
 *    4: 154 -> 83-95 ms at 128 rows, 672 -> 598 ms at 1,024 (about 100 GMAC/s of a peak of
 *    112). The integer pairs below gain nothing at this level: vpmaddwd then vpaddd is two
 *    instructions per 16 products (FMA: one per 8), and 16 registers hold 4 rows of x.
 *  - AVX-512 (32 registers of 512 bits): x in 16 bits, W in its integers (`GEMM_X16`). Per 32
 *    values x is int16 (x / d rounded to nearest even, d = max |x| / 32767; Q6_K: / 16383)
 *    with its float32 sum, and W its int16 q (Q6_K: q times its int8 scale per 16) with a
 *    float32 scale and offset (Q4_1, Q4_K, Q5_K); 6 rows of x by 32 of W in 12 int32
 *    accumulators of pair sums (vpdpwssd with VNNI, else vpmaddwd then vpaddd), then per 32
 *    values one conversion and fused multiply-add per accumulator (times x's scale times W's)
 *    and one for the offsets (W's times x's sum). The integer sums are exact (`x16_max`); x's
 *    rounding, at most half a step of 1/32767 (1/16383) of its 32 values' largest, is the only
 *    error beyond float32 summation (x in 8 bits: half a step of 1/127). Against the float32
 *    micro-kernel in the same build, the same four matrices at 512 rows, two threads of a Zen
 *    4: 311-333 -> 197-221 ms (about 150 GMAC/s), with VNNI 181-198 ms. */
#define GEMM_KC 256 /* values of a row of W per pass (a K-quant block, 8 of 32) */
#define GEMM_MR 6   /* rows of x per micro-kernel */
#define GEMM_NC 256 /* rows of W per thread's chunk: GEMM_KC values of each, in L2 */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define GEMM_X16 1
#define GEMM_NR 32         /* rows of W per micro-kernel: two vectors */
#define GEMM_VALUE 2       /* bytes a packed value of x or W: int16 */
#else
#define GEMM_X16 0
#define GEMM_NR 16
#define GEMM_VALUE 4 /* float32 */
#endif

/* x packed: value kk of tile t's row r at values[(t * k + kk) * GEMM_MR + r] (GEMM_X16: the
 * int32 pairs kk / 2, and the scales and sums per 32 at [(t * k / 32 + kk / 32) * GEMM_MR + r]) */
typedef struct {
    void *values;
    float *scales, *sums;
} gemm_x;
/* a chunk of W packed, by GEMM_NR rows: value kk of row c at values[kk * GEMM_NR + c] (GEMM_X16:
 * pairs; the scales and offsets per 32 at [kk / 32 * GEMM_NR + c]) */
typedef struct {
    void *values;
    float *scales, *offsets;
} gemm_w;

/* tile t's x from value `first` */
static gemm_x gemm_x_at(gemm_x x, int64_t k, int64_t t, int64_t first) {
    const int64_t per32 = (t * k + first) / 32 * GEMM_MR;
    return (gemm_x){(uint8_t *)x.values + (t * k + first) * GEMM_MR * GEMM_VALUE,
                    x.scales ? x.scales + per32 : NULL, x.sums ? x.sums + per32 : NULL};
}

/* a chunk's rows from row p (a multiple of GEMM_NR) */
static gemm_w gemm_w_at(gemm_w b, int64_t p) {
    const int64_t per32 = p * (GEMM_KC / 32);
    return (gemm_w){(uint8_t *)b.values + p * GEMM_KC * GEMM_VALUE, b.scales ? b.scales + per32 : NULL,
                    b.offsets ? b.offsets + per32 : NULL};
}

#if GEMM_X16
/* x's largest q, so that 32 products never leave int32: 32767 (W's |q| <= 128: 32 * 32767 *
 * 128 < 2^27), Q6_K's 16383 (its q times its int8 scale: 32 * 16383 * 4096 < 2^31) */
static int x16_max(int64_t type) { return type == GGML_Q6_K ? 16383 : 32767; }

/* tile t of x, for W of `type`: its rows' 32-value groups in 16 bits, |q| <= x16_max(type)
 * (rows past `rows` 0) */
static void gemm_pack_x(const float *restrict x, int64_t rows, int64_t k, int64_t t, int64_t type, gemm_x xp) {
    const int top = x16_max(type);
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const gemm_x tile = gemm_x_at(xp, k, t, 0);
    int32_t *to = tile.values;
    for (int r = 0; r < GEMM_MR; r++)
        for (int64_t g = 0; g < k / 32; g++) {
            int32_t *pairs = to + g * 16 * GEMM_MR + r;
            float *scale = tile.scales + g * GEMM_MR + r, *sum = tile.sums + g * GEMM_MR + r;
            if (t * GEMM_MR + r >= rows) {
                for (int p = 0; p < 16; p++) pairs[p * GEMM_MR] = 0;
                *scale = *sum = 0.0f;
                continue;
            }
            const float *xg = x + (t * GEMM_MR + r) * k + g * 32;
            const __m512 low = _mm512_loadu_ps(xg), high = _mm512_loadu_ps(xg + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(high, magnitude),
                                                                  _mm512_max_ps(_mm512_and_ps(low, magnitude),
                                                                                _mm512_setzero_ps())));
            const float d = amax / (float)top, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            /* a NaN in x makes its outputs NaN, as in float32 (max_ps passed over it above) */
            const int nan = _mm512_cmp_ps_mask(low, low, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(high, high, _CMP_UNORD_Q);
            *scale = nan ? NAN : d;
            *sum = hsum256(_mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(low), _mm512_extractf32x8_ps(low, 1)),
                                         _mm256_add_ps(_mm512_castps512_ps256(high), _mm512_extractf32x8_ps(high, 1))));
            const __m512i high_q = _mm512_set1_epi32(top), low_q = _mm512_set1_epi32(-top);
            _Alignas(64) int16_t q[32]; /* clamped: NaN and rounding stay in range */
            _mm256_store_si256((__m256i *)q, _mm512_cvtepi32_epi16(_mm512_max_epi32(_mm512_min_epi32(
                _mm512_cvtps_epi32(_mm512_mul_ps(low, _mm512_set1_ps(inverse))), high_q), low_q)));
            _mm256_store_si256((__m256i *)(q + 16), _mm512_cvtepi32_epi16(_mm512_max_epi32(_mm512_min_epi32(
                _mm512_cvtps_epi32(_mm512_mul_ps(high, _mm512_set1_ps(inverse))), high_q), low_q)));
            for (int p = 0; p < 16; p++) memcpy(pairs + p * GEMM_MR, q + 2 * p, sizeof(int32_t));
        }
}

/* W's rows (count <= GEMM_NR, row_bytes apart), values [first, first + len) (len <= GEMM_KC, a
 * multiple of the block): int16 pairs, scales and offsets per 32; rows past count are 0 */
static void gemm_pack_w(int64_t type, const uint8_t *restrict w, int64_t row_bytes, int count,
                        int64_t first, int64_t len, gemm_w b) {
    _Alignas(32) int16_t rows[GEMM_NR][GEMM_KC];
    int8_t q[GEMM_KC];
    float scale[GEMM_KC / 16], offset[GEMM_KC / 32];
    const int64_t per = quant_block_weights(type), at = quant_bytes(type, first);
    for (int c = 0; c < GEMM_NR; c++) {
        for (int64_t g = 0; g < len / 32; g++) b.scales[g * GEMM_NR + c] = b.offsets[g * GEMM_NR + c] = 0.0f;
        if (c >= count) {
            memset(rows[c], 0, sizeof rows[c]);
            continue;
        }
        const uint8_t *row = w + c * row_bytes + at;
        for (int64_t i = 0; i < len / per; i++)
            unpack_block(type, row + i * quant_block_bytes(type), q + i * per,
                         scale + i * (per / 32) * scales_per_32(type), offset + i * (per / 32));
        for (int64_t i = 0; i < len; i += 16) {
            __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + i)));
            if (type == GGML_Q6_K) { /* times the int8 scale of its 16; the block's d per 32 */
                const uint8_t *block = row + i / 256 * quant_block_bytes(type);
                v = _mm256_mullo_epi16(v, _mm256_set1_epi16(((const int8_t *)(block + 192))[i % 256 / 16]));
                b.scales[i / 32 * GEMM_NR + c] = half_f16c(block + 208);
            }
            _mm256_store_si256((__m256i *)(rows[c] + i), v);
        }
        for (int64_t g = 0; g < len / 32; g++) {
            if (type != GGML_Q6_K) b.scales[g * GEMM_NR + c] = scale[g];
            if (has_offsets(type)) b.offsets[g * GEMM_NR + c] = offset[g];
        }
    }
    int32_t *to = b.values;
    for (int64_t kk = 0; kk < len; kk += 16) /* 8 pairs of 8 rows at a time: 8 x 8 int32 transposes */
        for (int group = 0; group < GEMM_NR / 8; group++) {
            __m256i v[8];
            for (int c = 0; c < 8; c++) v[c] = _mm256_load_si256((const __m256i *)(rows[8 * group + c] + kk));
            transpose8_epi32(v);
            for (int i = 0; i < 8; i++) _mm256_store_si256((__m256i *)(to + (kk / 2 + i) * GEMM_NR + 8 * group), v[i]);
        }
}

static inline __m512i pair_dots(__m512i acc, __m512i x2, __m512i w2) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, x2, w2);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(x2, w2));
#endif
}

/* ROWS rows of x (a tile from gemm_x_at) times `len` packed values of 32 rows of W, added into
 * out's 32 columns (the first `cols` of them) */
static inline __attribute__((always_inline)) void gemm_tile(const int ROWS, const int OFFSETS, gemm_x x,
                                                            gemm_w b, int64_t len, float *restrict out,
                                                            int64_t ldo, int cols) {
    const int32_t *restrict xq = x.values, *restrict bq = b.values;
    const __mmask16 first = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 second = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    __m512 acc[GEMM_MR][2];
    for (int r = 0; r < ROWS; r++) {
        acc[r][0] = _mm512_maskz_loadu_ps(first, out + r * ldo);
        acc[r][1] = _mm512_maskz_loadu_ps(second, out + r * ldo + 16);
    }
    for (int64_t g = 0; g < len / 32; g++) {
        __m512i dots[GEMM_MR][2];
        for (int r = 0; r < ROWS; r++) dots[r][0] = dots[r][1] = _mm512_setzero_si512();
        const int32_t *bg = bq + g * 16 * GEMM_NR, *xg = xq + g * 16 * GEMM_MR;
        _Pragma("GCC unroll 2") /* unrolled further, GCC reorders the integer sums and spills */
        for (int p = 0; p < 16; p++) {
            const __m512i b0 = _mm512_load_si512(bg + p * GEMM_NR), b1 = _mm512_load_si512(bg + p * GEMM_NR + 16);
            for (int r = 0; r < ROWS; r++) {
                const __m512i a = _mm512_set1_epi32(xg[p * GEMM_MR + r]);
                dots[r][0] = pair_dots(dots[r][0], a, b0);
                dots[r][1] = pair_dots(dots[r][1], a, b1);
            }
        }
        const __m512 s0 = _mm512_load_ps(b.scales + g * GEMM_NR), s1 = _mm512_load_ps(b.scales + g * GEMM_NR + 16);
        for (int r = 0; r < ROWS; r++) {
            const __m512 d = _mm512_set1_ps(x.scales[g * GEMM_MR + r]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][0]), _mm512_mul_ps(s0, d), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][1]), _mm512_mul_ps(s1, d), acc[r][1]);
        }
        if (OFFSETS) {
            const __m512 o0 = _mm512_load_ps(b.offsets + g * GEMM_NR);
            const __m512 o1 = _mm512_load_ps(b.offsets + g * GEMM_NR + 16);
            for (int r = 0; r < ROWS; r++) {
                const __m512 sum = _mm512_set1_ps(x.sums[g * GEMM_MR + r]);
                acc[r][0] = _mm512_fmadd_ps(o0, sum, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(o1, sum, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        _mm512_mask_storeu_ps(out + r * ldo, first, acc[r][0]);
        _mm512_mask_storeu_ps(out + r * ldo + 16, second, acc[r][1]);
    }
}
#else
/* tile t of x, value-major (rows past `rows` 0), so that a micro-kernel reads one run */
static void gemm_pack_x(const float *restrict x, int64_t rows, int64_t k, int64_t t, int64_t type, gemm_x xp) {
    (void)type; /* x exact, whatever W's format */
    float *to = gemm_x_at(xp, k, t, 0).values;
    for (int64_t kk = 0; kk < k; kk++)
        for (int r = 0; r < GEMM_MR; r++)
            to[kk * GEMM_MR + r] = t * GEMM_MR + r < rows ? x[(t * GEMM_MR + r) * k + kk] : 0.0f;
}

/* W's rows (count <= GEMM_NR, row_bytes apart), values [first, first + len) (len <= GEMM_KC, a
 * multiple of the block), as float32; rows past count are 0 */
static void gemm_pack_w(int64_t type, const uint8_t *restrict w, int64_t row_bytes, int count,
                        int64_t first, int64_t len, gemm_w b) {
    _Alignas(32) float rows[GEMM_NR][GEMM_KC];
    int8_t q[GEMM_KC];
    float scale[GEMM_KC / 16], offset[GEMM_KC / 32];
    const int64_t at = quant_bytes(type, first);
    for (int c = 0; c < GEMM_NR; c++) {
        if (c < count) dequantize_row_unpacked(type, w + c * row_bytes + at, rows[c], len, q, scale, offset);
        else memset(rows[c], 0, sizeof rows[c]);
    }
    float *to = b.values;
    for (int64_t kk = 0; kk < len; kk += 8) /* 8 x 8 transposes */
        for (int half = 0; half < 2; half++) {
            __m256i v[8];
            for (int c = 0; c < 8; c++) v[c] = _mm256_castps_si256(_mm256_load_ps(rows[8 * half + c] + kk));
            transpose8_epi32(v);
            for (int i = 0; i < 8; i++) _mm256_store_ps(to + (kk + i) * GEMM_NR + 8 * half, _mm256_castsi256_ps(v[i]));
        }
}

/* ROWS rows of x (a tile from gemm_x_at) times `len` packed values of 16 rows of W, added into
 * out's 16 columns (the first `cols` of them, masked where fewer: vmaskmovps stores are slow
 * on AMD, so only there) */
static inline __attribute__((always_inline)) void gemm_tile(const int ROWS, const int OFFSETS, gemm_x x,
                                                            gemm_w b, int64_t len, float *restrict out,
                                                            int64_t ldo, int cols) {
    (void)OFFSETS; /* in the float32 values */
    const float *restrict xv = x.values, *restrict bv = b.values;
    __m256 acc[GEMM_MR][2];
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); /* out's columns < cols */
    const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lanes);
    const __m256i second = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lanes);
    for (int r = 0; r < ROWS; r++) {
        acc[r][0] = cols == GEMM_NR ? _mm256_loadu_ps(out + r * ldo) : _mm256_maskload_ps(out + r * ldo, first);
        acc[r][1] = cols == GEMM_NR ? _mm256_loadu_ps(out + r * ldo + 8) : _mm256_maskload_ps(out + r * ldo + 8, second);
    }
    for (int64_t kk = 0; kk < len; kk++) {
        const __m256 b0 = _mm256_load_ps(bv + kk * GEMM_NR), b1 = _mm256_load_ps(bv + kk * GEMM_NR + 8);
        for (int r = 0; r < ROWS; r++) {
            const __m256 a = _mm256_broadcast_ss(xv + kk * GEMM_MR + r);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < ROWS; r++) {
        if (cols == GEMM_NR) {
            _mm256_storeu_ps(out + r * ldo, acc[r][0]);
            _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
        } else {
            _mm256_maskstore_ps(out + r * ldo, first, acc[r][0]);
            _mm256_maskstore_ps(out + r * ldo + 8, second, acc[r][1]);
        }
    }
}
#endif

int quant_gemm_f32(float *restrict out, const float *restrict x, const uint8_t *restrict w,
                   int64_t type, int64_t rows, int64_t n, int64_t k, int64_t ldo) {
    CHECKED(check_blocks(type, rows, n, k));
    REQUIRE(ldo >= n); /* out's row stride */
    if (!rows || !n) return STATUS_OK;
    const int64_t row_bytes = quant_bytes(type, k);
    const int64_t tiles = (rows + GEMM_MR - 1) / GEMM_MR;
    /* The call's scratch in one allocation: x packed (and its scales and sums per 32), then
     * each thread's chunk of W (and its scales and offsets per 32). */
    const size_t x_bytes = round64((size_t)(tiles * k * GEMM_MR * GEMM_VALUE));
    const size_t x_per32 = GEMM_X16 ? round64((size_t)(tiles * (k / 32) * GEMM_MR) * sizeof(float)) : 0;
    const size_t w_bytes = round64((size_t)(GEMM_NC * GEMM_KC * GEMM_VALUE));
    const size_t w_per32 = GEMM_X16 ? round64((size_t)(GEMM_NC * (GEMM_KC / 32)) * sizeof(float)) : 0;
    const size_t chunk_bytes = w_bytes + 2 * w_per32;
    uint8_t *memory = aligned_alloc(64, x_bytes + 2 * x_per32 + (size_t)omp_get_max_threads() * chunk_bytes);
    if (!memory) return failed(STATUS_NO_MEMORY, "aligned_alloc of x in tiles of 6 rows and the threads' chunks of W");
    const gemm_x xp = {memory, x_per32 ? (float *)(memory + x_bytes) : NULL,
                       x_per32 ? (float *)(memory + x_bytes + x_per32) : NULL};
    _Pragma("omp parallel for schedule(static) if (rows * k > 65536)")
    for (int64_t t = 0; t < tiles; t++) gemm_pack_x(x, rows, k, t, type, xp);
    /* rows of W per chunk: at most GEMM_NC, as many chunks as a multiple of the threads */
    const int64_t threads = omp_get_max_threads();
    const int64_t chunks = threads * ((n + threads * GEMM_NC - 1) / (threads * GEMM_NC));
    const int64_t nc = ((n + chunks - 1) / chunks + GEMM_NR - 1) / GEMM_NR * GEMM_NR;
    const int offsets = has_offsets(type);
    _Pragma("omp parallel if (n > GEMM_NR)")
    {
        uint8_t *mine = memory + x_bytes + 2 * x_per32 + (size_t)omp_get_thread_num() * chunk_bytes;
        const gemm_w b = {mine, w_per32 ? (float *)(mine + w_bytes) : NULL,
                          w_per32 ? (float *)(mine + w_bytes + w_per32) : NULL};
        _Pragma("omp for schedule(static)")
        for (int64_t j = 0; j < n; j += nc) { /* nc rows of W: their chunk in L2 */
            const int64_t count = n - j < nc ? n - j : nc;
            for (int64_t r = 0; r < rows; r++) memset(out + r * ldo + j, 0, (size_t)count * sizeof(float));
            for (int64_t first = 0; first < k; first += GEMM_KC) {
                const int64_t len = k - first < GEMM_KC ? k - first : GEMM_KC;
                for (int64_t p = 0; p < count; p += GEMM_NR)
                    gemm_pack_w(type, w + (j + p) * row_bytes, row_bytes,
                                (int)(count - p < GEMM_NR ? count - p : GEMM_NR), first, len, gemm_w_at(b, p));
                for (int64_t t = 0; t < tiles; t++) { /* a tile of x in L1 for all the panels */
                    const gemm_x xt = gemm_x_at(xp, k, t, first);
                    const int64_t left = rows - t * GEMM_MR;
                    for (int64_t p = 0; p < count; p += GEMM_NR) {
                        float *o = out + t * GEMM_MR * ldo + j + p;
                        const gemm_w bp = gemm_w_at(b, p);
                        const int cols = (int)(count - p < GEMM_NR ? count - p : GEMM_NR);
#define GEMM_TILE(R) (GEMM_X16 && offsets ? gemm_tile(R, 1, xt, bp, len, o, ldo, cols) \
                                          : gemm_tile(R, 0, xt, bp, len, o, ldo, cols))
                        switch (left < GEMM_MR ? left : GEMM_MR) {
                        case 6: GEMM_TILE(6); break;
                        case 5: GEMM_TILE(5); break;
                        case 4: GEMM_TILE(4); break;
                        case 3: GEMM_TILE(3); break;
                        case 2: GEMM_TILE(2); break;
                        default: GEMM_TILE(1);
                        }
#undef GEMM_TILE
                    }
                }
            }
        }
    }
    free(memory);
    return STATUS_OK;
}
#endif

/* ---- GGUF blocks times bfloat16 activations (AVX-512 BF16) -----------------------------------
 *
 * out[r, j] (row stride ldo) = x[r, :] . W[j, :] for a matrix W [n, k] in its GGUF blocks,
 * each row dequantized as it is used (gguf_dequantize_f32's float32 values, rounded to
 * bfloat16: the values of the bfloat16 copy that the reference path multiplies by) into a
 * buffer of the thread's, never into a copy of the whole matrix: one W row at a time, its k
 * weights against every row of x (vdpbf16ps, float32 sums, rounded once). For steps of many
 * rows the caller dequantizes tiles of W (`gguf_dequantize_bf16`) into a cache-sized buffer
 * and multiplies by them with its own matmul (quant.py). k is a multiple of the format's
 * block. Every output is computed the same way whatever the other rows of x are. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define QUANT_TILE_ROWS 4 /* rows of x per dot */

#ifndef QUANT_AHEAD
/* bytes of blocks fetched ahead of the ones read: from memory, a Q4_K matrix of 16,384 x
 * 2,048 at one row took 2.68 ms without, 1.47 with 4 KiB (1 KiB: 1.54, 8 KiB: 1.49) */
#define QUANT_AHEAD 4096
#endif

/* A Q4_K or Q5_K block's 8 sub-block scales d * sc and shifts dmin * m as float32 (the
 * products scale_min_k4's values give: exact; the fields by `k4_fields`, whose vector built
 * whole saved a third of a Q4_K row's time at one row of x). */
static inline void k4_scale_vectors(const uint8_t *restrict b, __m256 *restrict scales,
                                    __m256 *restrict shifts) {
    const __m128i fields = k4_fields(b + 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(fields));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8)));
    uint16_t halves[2];
    memcpy(halves, b, sizeof halves);
    *scales = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(halves[0])), sc);
    *shifts = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(halves[1])), m);
}

static inline void k4_scales(const uint8_t *restrict b, float *restrict scales,
                             float *restrict shifts) {
    __m256 sc, m;
    k4_scale_vectors(b, &sc, &m);
    _mm256_store_ps(scales, sc);
    _mm256_store_ps(shifts, m);
}

/* 32 weights scale * q - shift as bfloat16 (scale_low for the first 16, scale_high for the
 * rest), from 32 bytes of q (signed or not): gguf_dequantize_f32's float32 values, rounded. */
static inline void put32(bf16 *restrict dst, __m256i q, int is_signed, float scale_low,
                         float scale_high, float shift) {
    const __m128i low = _mm256_castsi256_si128(q), high = _mm256_extracti128_si256(q, 1);
    const vec a = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(low) : _mm512_cvtepu8_epi32(low));
    const vec b = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(high) : _mm512_cvtepu8_epi32(high));
    const vec c = SET(shift);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(SET(scale_high), b, c),
                                                          _mm512_fmsub_ps(SET(scale_low), a, c)));
}

/* One block's weights as bfloat16 (the float32 values of dequantize_block, rounded). */
static void dequantize_block_bf16(int64_t type, const uint8_t *restrict b, bf16 *restrict y) {
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const int offset = type == GGML_Q4_0 ? 2 : 4;
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + offset));
        __m256i q = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), nibble);
        const float d = half_f16c(b);
        if (type == GGML_Q4_0) put32(y, _mm256_sub_epi8(q, _mm256_set1_epi8(8)), 1, d, d, 0.0f);
        else put32(y, q, 0, d, d, -half_f16c(b + 2));
        break;
    }
    case GGML_Q8_0: {
        const float d = half_f16c(b);
        put32(y, _mm256_loadu_si256((const __m256i *)(b + 2)), 1, d, d, 0.0f);
        break;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const uint8_t *qs = type == GGML_Q5_K ? b + 48 : b + 16;
        const __m256i high = type == GGML_Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16))
                                               : _mm256_setzero_si256();
        float scales[8] __attribute__((aligned(32))), shifts[8] __attribute__((aligned(32)));
        k4_scales(b, scales, shifts);
        /* broadcast each from memory (a load), not by shuffles on the one shuffle port */
        __asm__ volatile("" ::: "memory");
        if (type == GGML_Q4_K) { /* each sub-block's 16 values as bfloat16, looked up by q */
            const __m512i low4 = _mm512_set1_epi16(0x0f);
            const vec steps = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            for (int j = 0; j < 4; j++) {
                const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
                for (int half = 0; half < 2; half++) {
                    const int s = 2 * j + half;
                    const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(
                        _mm512_fmsub_ps(SET(scales[s]), steps, SET(shifts[s]))));
                    const __m512i q = half ? _mm512_srli_epi16(words, 4) : _mm512_and_si512(words, low4);
                    _mm512_storeu_si512(y + 32 * s, _mm512_permutexvar_epi16(q, table));
                }
            }
            break;
        }
        for (int j = 0; j < 4; j++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            for (int half = 0; half < 2; half++) {
                const int s = 2 * j + half;
                __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, nibble);
                if (type == GGML_Q5_K) {
                    const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high, s), _mm256_set1_epi8(1));
                    q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
                }
                put32(y + 32 * s, q, 0, scales[s], scales[s], shifts[s]);
            }
        }
        break;
    }
    case GGML_Q6_K: {
        float scales[16] __attribute__((aligned(64)));
        _mm512_store_ps(scales, MUL(SET(half_f16c(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                               _mm_loadu_si128((const __m128i *)(b + 192))))));
        __asm__ volatile("" ::: "memory"); /* broadcast each from memory, as above */
        const __m256i three = _mm256_set1_epi8(3), centre = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            const __m256i low = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i low2 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i high = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            for (int t = 0; t < 4; t++) {
                const __m256i ql = _mm256_and_si256(
                    t < 2 ? (t ? low2 : low) : _mm256_srli_epi16(t == 3 ? low2 : low, 4), nibble);
                const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(high, 2 * t), three);
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)), centre);
                const int s = 8 * h + 2 * t;
                put32(y + 128 * h + 32 * t, q, 1, scales[s], scales[s + 1], 0.0f);
            }
        }
        break;
    }
    }
}

static void dequantize_row_bf16(int64_t type, const uint8_t *restrict row, bf16 *restrict y,
                                int64_t k) {
    const int64_t per = quant_block_weights(type), bytes = quant_block_bytes(type);
    for (int64_t i = 0; i < k / per; i++) {
        if ((i * bytes) % 64 < bytes) prefetch_line(row + i * bytes + QUANT_AHEAD);
        dequantize_block_bf16(type, row + i * bytes, y + i * per);
    }
}

/* out [n, k] bfloat16 = the matrix w of `type`: gguf_dequantize_f32's values, rounded
 * (a tile of a matrix, for a matmul of many rows). */
int gguf_dequantize_bf16(bf16 *restrict out, const uint8_t *restrict w, int64_t type, int64_t n,
                         int64_t k) {
    CHECKED(check_blocks(type, 1, n, k));
    const int64_t row_bytes = quant_bytes(type, k);
    _Pragma("omp parallel for schedule(static) if (n > 1)")
    for (int64_t r = 0; r < n; r++) dequantize_row_bf16(type, w + r * row_bytes, out + r * k, k);
    return STATUS_OK;
}

/* ROWS rows of x (constant where called) against one row of W as bfloat16 */
static inline __attribute__((always_inline)) void quant_dot(
    const int ROWS, const bf16 *restrict x, int64_t k, const bf16 *restrict row,
    bf16 *restrict out, int64_t ldo) {
    vec acc[QUANT_TILE_ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = ZERO();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + i);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + i + 32);
        for (int r = 0; r < ROWS; r++) {
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, (__m512bh)_mm512_loadu_si512(x + r * k + i));
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, (__m512bh)_mm512_loadu_si512(x + r * k + i + 32));
        }
    }
    if (i < k) { /* k = 32 mod 64 */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + i);
        for (int r = 0; r < ROWS; r++)
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, (__m512bh)_mm512_loadu_si512(x + r * k + i));
    }
    for (int r = 0; r < ROWS; r++) store1_bf16(out + r * ldo, HSUM(ADD(acc[r][0], acc[r][1])));
}

/* The K-quants from their blocks, exact: each sub-block's q (Q4_K, Q5_K: 0..31; Q6_K: q - 32)
 * looked up as bfloat16 (exact small integers, vpermw), multiplied by x by vdpbf16ps, the sum
 * scaled by the sub-block's d * sc in float32; Q4_K and Q5_K's mins as dmin * m times the
 * sub-block's sum of x. The file's weights unrounded, float32 sums, rounded once. */
static inline __attribute__((always_inline)) void kquant_row(
    const int ROWS, int64_t type, const uint8_t *restrict row, const bf16 *restrict x, int64_t k,
    const float *restrict xsums, bf16 *restrict out, int64_t ldo, __m512i small, __m512i below) {
    const int64_t blocks = k / 256, bytes = quant_block_bytes(type);
    const __m512i low4 = _mm512_set1_epi16(0x0f), one = _mm512_set1_epi16(1);
    vec acc[2][QUANT_TILE_ROWS];
    __m256 mins[QUANT_TILE_ROWS];
    for (int r = 0; r < ROWS; r++) {
        acc[0][r] = acc[1][r] = ZERO();
        mins[r] = _mm256_setzero_ps();
    }
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + blk * bytes;
        const bf16 *xb = x + blk * 256;
        /* the thread's rows are consecutive in memory: fetch ahead across their ends */
        for (int64_t line = 0; line < bytes; line += 64) prefetch_line(b + QUANT_AHEAD + line);
        if (type == GGML_Q6_K) {
            const int8_t *scales = (const int8_t *)(b + 192);
            const float d = half_f16c(b + 208);
            for (int h = 0; h < 2; h++) {
                const __m512i low = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h)));
                const __m512i low2 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)));
                const __m512i high = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                for (int t = 0; t < 4; t++) {
                    const __m512i ql = t < 2 ? _mm512_and_si512(t ? low2 : low, low4)
                                             : _mm512_srli_epi16(t == 3 ? low2 : low, 4);
                    const __m512i qh = _mm512_and_si512(_mm512_srli_epi16(high, 2 * t), _mm512_set1_epi16(3));
                    const __m512i q = _mm512_or_si512(ql, _mm512_slli_epi16(qh, 4));
                    const __m512bh w = (__m512bh)_mm512_permutex2var_epi16(below, q, small);
                    const int s = 8 * h + 2 * t;
                    const vec scale = _mm512_mask_blend_ps(0xff00, SET(d * (float)scales[s]),
                                                           SET(d * (float)scales[s + 1]));
                    for (int r = 0; r < ROWS; r++) {
                        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * k + 128 * h + 32 * t);
                        acc[t & 1][r] = FMA(_mm512_dpbf16_ps(ZERO(), w, xv), scale, acc[t & 1][r]);
                    }
                }
            }
            continue;
        }
        const uint8_t *qs = type == GGML_Q5_K ? b + 48 : b + 16;
        const __m512i high = type == GGML_Q5_K
                                 ? _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)))
                                 : _mm512_setzero_si512();
        float scales[8] __attribute__((aligned(32))), shifts[8] __attribute__((aligned(32)));
        k4_scales(b, scales, shifts);
        for (int j = 0; j < 4; j++) {
            const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
            for (int half = 0; half < 2; half++) {
                const int s = 2 * j + half;
                __m512i q = half ? _mm512_srli_epi16(words, 4) : _mm512_and_si512(words, low4);
                if (type == GGML_Q5_K)
                    q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high, s), one), 4));
                const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(q, small);
                const vec scale = SET(scales[s]);
                for (int r = 0; r < ROWS; r++) { /* two chains: the multiply-add's latency */
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * k + 32 * s);
                    acc[half][r] = FMA(_mm512_dpbf16_ps(ZERO(), w, xv), scale, acc[half][r]);
                }
            }
        }
        const __m256 shift = _mm256_load_ps(shifts);
        for (int r = 0; r < ROWS; r++)
            mins[r] = _mm256_fmadd_ps(shift, _mm256_loadu_ps(xsums + r * (k / 32) + blk * 8), mins[r]);
    }
    for (int r = 0; r < ROWS; r++) {
        const __m128 m = _mm_add_ps(_mm256_castps256_ps128(mins[r]), _mm256_extractf128_ps(mins[r], 1));
        const float total = _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(m, m), _mm_hadd_ps(m, m)));
        store1_bf16(out + r * ldo, HSUM(ADD(acc[0][r], acc[1][r])) - total);
    }
}

static int is_kquant(int64_t type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
}

int quant_linear_bf16(bf16 *restrict out, const bf16 *restrict x, const uint8_t *restrict w,
                      int64_t type, int64_t rows, int64_t n, int64_t k, int64_t ldo) {
    CHECKED(check_blocks(type, rows, n, k));
    REQUIRE(ldo >= n); /* out's row stride */
    if (!rows || !n) return STATUS_OK;
    const int64_t row_bytes = quant_bytes(type, k);
    if (is_kquant(type)) {
        /* bfloat16 bits of 0..31 (small) and of -32..-1 (below: Q6_K's q - 32 below 0) */
        int16_t values[64];
        for (int i = 0; i < 64; i++) {
            const float v = (float)(i < 32 ? i : i - 64);
            uint32_t bits;
            memcpy(&bits, &v, sizeof bits);
            values[i] = (int16_t)(bits >> 16);
        }
        const __m512i small = _mm512_loadu_si512(values), below = _mm512_loadu_si512(values + 32);
        const int64_t groups = k / 32;
        float *xsums = malloc((size_t)(rows * groups) * sizeof(float)); /* each 32's sum of x */
        if (!xsums) return failed(STATUS_NO_MEMORY, "malloc(rows * k / 32 floats)");
        for (int64_t r = 0; r < rows; r++)
            for (int64_t g = 0; g < groups; g++) {
                const bf16 *at = x + r * k + g * 32;
                xsums[r * groups + g] = _mm512_reduce_add_ps(ADD(load_bf16(at, 16), load_bf16(at + 16, 16)));
            }
        _Pragma("omp parallel for schedule(static) if (n > 16)")
        for (int64_t j = 0; j < n; j++)
            for (int64_t r = 0; r < rows; r += QUANT_TILE_ROWS) {
                const uint8_t *wr = w + j * row_bytes;
                const bf16 *xr = x + r * k;
                const float *sr = xsums + r * groups;
                bf16 *o = out + r * ldo + j;
                switch (rows - r < QUANT_TILE_ROWS ? rows - r : QUANT_TILE_ROWS) {
                case 4: kquant_row(4, type, wr, xr, k, sr, o, ldo, small, below); break;
                case 3: kquant_row(3, type, wr, xr, k, sr, o, ldo, small, below); break;
                case 2: kquant_row(2, type, wr, xr, k, sr, o, ldo, small, below); break;
                default: kquant_row(1, type, wr, xr, k, sr, o, ldo, small, below);
                }
            }
        free(xsums);
        return STATUS_OK;
    }
    int status = STATUS_OK; /* the threads' first failure */
    _Pragma("omp parallel if (n > 16)")
    {
        bf16 *row = aligned_alloc(64, (size_t)k * sizeof(bf16));
        if (!row) {
            _Pragma("omp atomic write")
            status = STATUS_NO_MEMORY;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t j = 0; j < n; j++) {
            if (!row) continue;
            dequantize_row_bf16(type, w + j * row_bytes, row, k);
            for (int64_t r = 0; r < rows; r += QUANT_TILE_ROWS) {
                const bf16 *xr = x + r * k;
                bf16 *o = out + r * ldo + j;
                switch (rows - r < QUANT_TILE_ROWS ? rows - r : QUANT_TILE_ROWS) {
                case 4: quant_dot(4, xr, k, row, o, ldo); break;
                case 3: quant_dot(3, xr, k, row, o, ldo); break;
                case 2: quant_dot(2, xr, k, row, o, ldo); break;
                default: quant_dot(1, xr, k, row, o, ldo);
                }
            }
        }
        free(row);
    }
    return status ? failed(status, "aligned_alloc(64, k bfloat16) of a thread's row") : STATUS_OK;
}

/* ---- GGUF blocks times 8-bit activations (AVX-512 VNNI) --------------------------------------
 *
 * out[r, j] = x[r, :] . W[j, :] as llama.cpp computes it on a CPU: each row of x quantized to
 * int8 (round to nearest, one float32 scale per group: 256 for the K-quants, ggml's Q8_K; 32
 * for Q8_0, Q4_0 and Q4_1, its Q8_0), then each block's integer q times those int8 by vpdpbusd
 * (exact int32 sums of 4 products per lane), scaled in float32 by the block's (sub-block's)
 * scale times the group's. The q of a format are unsigned bytes where vpdpbusd wants them:
 * Q4_0's q - 8, Q6_K's q - 32 and Q8_0's w + 128 (its sign bit flipped) carry their offset
 * into each lane's starting value, -offset * (that lane's 4 int8 of x), computed once per call.
 * Q4_K, Q5_K and Q4_1's mins are times the float32 sums of x per 32 (exact, unquantized).
 *
 * What changes against `quant_linear_bf16`: x's rounding, to 8 bits per group instead of
 * bfloat16's 8 significant bits per element (tests/model/test_gguf_quants.py bounds it); a
 * matrix row costs about half the instructions, the unpacking of its blocks shared by up
 * to QI8_TILE_ROWS rows of x. */
#if defined(__AVX512VNNI__)
#define QI8_TILE_ROWS 8

/* x quantized for one call, per row: k int8 in the order the format's q come out of one
 * load (Q4_K and Q5_K: each block's sub-blocks 0, 2, 1, 3, 4, 6, 5, 7; Q8_0, Q4_0 and Q4_1:
 * each run of 4 blocks as their first 16, then their last 16; a last run of fewer blocks in
 * order), k / group scales, and for the runs of 4 blocks per lane of a 16-lane vector:
 * the offset it starts from (formats with one), its block's scale and Q4_1's sum of x / 4
 * (k / 4 entries a row; the K-quants' offsets use all 64 a block, in order); k / 32 sums */
typedef struct {
    int8_t *q;
    float *scale;
    int32_t *offset;
    float *lane_scale;
    float *lane_sum;
    float *sums;
} quantized_x;

#define Q8_RUN 4 /* blocks of 32 per 16-lane vector pair of Q8_0, Q4_0 and Q4_1 */

static int64_t q8_group(int64_t type) { return quant_block_weights(type) == 256 ? 256 : 32; }
static int q8_offset(int64_t type) {
    return type == GGML_Q4_0 ? 8 : type == GGML_Q6_K ? 32 : type == GGML_Q8_0 ? 128 : 0;
}

/* where element i (0-127) of a run of 4 blocks of 32 goes: block i / 32's first or last 16 */
static inline int64_t run_position(int64_t i) { return (i % 32 / 16) * 64 + (i / 32) * 16 + i % 16; }

static void quantize_x(quantized_x *qx, int64_t type, const bf16 *restrict x, int64_t rows,
                       int64_t k) {
    static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    const int kquant = is_kquant(type), reorder = type == GGML_Q4_K || type == GGML_Q5_K;
    const int64_t group = q8_group(type), groups = k / group, runs = k / (32 * Q8_RUN);
    const int offset = q8_offset(type);
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * k;
        int8_t *qr = qx->q + r * k;
        for (int64_t g = 0; g < groups; g++) {
            const bf16 *xg = xr + g * group;
            vec amax = ZERO();
            for (int64_t i = 0; i < group; i += 16)
                amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16(xg + i, 16)));
            const float d = _mm512_reduce_max_ps(amax) / 127.0f;
            const vec inverse = SET(d > 0.0f ? 1.0f / d : 0.0f);
            qx->scale[r * groups + g] = d;
            for (int64_t i = 0; i < group; i += 16) {
                const int64_t at = g * group + i;
                const int64_t to = reorder                        ? g * group + 32 * order[i / 32] + i % 32
                                   : !kquant && at / 128 < runs ? at / 128 * 128 + run_position(at % 128)
                                                                : at;
                const __m512i q = _mm512_cvtps_epi32(MUL(load_bf16(xg + i, 16), inverse));
                _mm_storeu_si128((__m128i *)(qr + to), _mm512_cvtsepi32_epi8(q));
            }
        }
        if (qx->sums)
            for (int64_t g = 0; g < k / 32; g++)
                qx->sums[r * (k / 32) + g] =
                    _mm512_reduce_add_ps(ADD(load_bf16(xr + 32 * g, 16), load_bf16(xr + 32 * g + 16, 16)));
        int32_t *starts = qx->offset ? qx->offset + r * (k / 4) : NULL;
        if (offset) /* -offset times each lane's 4 int8 (k is a multiple of 32) */
            for (int64_t i = 0; i < k; i += 32) {
                const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)offset),
                                                         _mm256_loadu_si256((const __m256i *)(qr + i)));
                _mm256_storeu_si256((__m256i *)(starts + i / 4), _mm256_sub_epi32(_mm256_setzero_si256(), sums));
            }
        if (kquant) continue;
        for (int64_t run = 0; run < runs; run++) { /* lane l of a run: block l / 4 */
            const int64_t at = r * (k / 4) + run * 32, block = r * (k / 32) + run * Q8_RUN;
            const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            _mm512_storeu_ps(qx->lane_scale + at, _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(qx->scale + block))));
            if (qx->lane_sum)
                _mm512_storeu_ps(qx->lane_sum + at, MUL(SET(0.25f), _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(qx->sums + block)))));
            if (offset) { /* a lane's first 16 and last 16 in one start: the 8 lanes of each */
                int32_t *o = starts + run * 32;
                _mm512_storeu_si512(o, _mm512_add_epi32(_mm512_loadu_si512(o), _mm512_loadu_si512(o + 16)));
            }
        }
    }
}

/* ROWS rows of x against one K-quant row of W: per block its 256 q as four vectors of 64
 * bytes, each lane's 4-product int32 sum as float32 times its sub-block's scale, the block's
 * total times the row's group scale. */
static inline __attribute__((always_inline)) void kquant_row_q8(
    const int ROWS, int64_t type, const uint8_t *restrict row, const quantized_x *qx,
    int64_t r0, int64_t k, bf16 *restrict out, int64_t ldo) {
    const int64_t blocks = k / 256, bytes = quant_block_bytes(type);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    /* lanes 0-7 and 8-15 of vector i: Q4_K / Q5_K sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) */
    const __m512i pick[4] = {
        _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
        _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
    vec acc[QI8_TILE_ROWS];
    __m256 mins[QI8_TILE_ROWS];
    for (int r = 0; r < ROWS; r++) {
        acc[r] = ZERO();
        mins[r] = _mm256_setzero_ps();
    }
    const int8_t *xq = qx->q + r0 * k;
    const float *xd = qx->scale + r0 * blocks;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + blk * bytes;
        for (int64_t line = 0; line < bytes; line += 64) prefetch_line(b + QUANT_AHEAD + line);
        __m512i w[4];
        vec scale[4];
        if (type == GGML_Q6_K) {
            const float d = half_f16c(b + 208);
            const vec sc = MUL(SET(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
            const __m512i two_bits = _mm512_set1_epi8(0x30);
            for (int h = 0; h < 2; h++) {
                const __m512i low = _mm512_loadu_si512(b + 64 * h);
                const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
                /* weights 0-63 of the half: bits 0-1 then 2-3 of qh; 64-127: 4-5 then 6-7 */
                const __m512i first = _mm512_slli_epi16(_mm512_srlv_epi16(high, _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1)), 4);
                const __m512i second = _mm512_slli_epi16(_mm512_srlv_epi16(high, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)), 4);
                w[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(low, low4), first, two_bits, 0xf8);
                w[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(low, 4), low4), second, two_bits, 0xf8);
            }
            for (int i = 0; i < 4; i++) /* lane l of vector i: sub-block 4 i + l / 4 */
                scale[i] = _mm512_permutexvar_ps(_mm512_set_epi32(4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 2, 4 * i + 2, 4 * i + 2, 4 * i + 2, 4 * i + 1, 4 * i + 1, 4 * i + 1, 4 * i + 1, 4 * i, 4 * i, 4 * i, 4 * i), sc);
            for (int r = 0; r < ROWS; r++) {
                const int8_t *xb = xq + r * k + blk * 256;
                const int32_t *start = qx->offset + (r0 + r) * (k / 4) + blk * 64;
                vec total = ZERO();
                for (int i = 0; i < 4; i++) {
                    const __m512i sums = _mm512_dpbusd_epi32(_mm512_loadu_si512(start + 16 * i), w[i], _mm512_loadu_si512(xb + 64 * i));
                    total = FMA(_mm512_cvtepi32_ps(sums), scale[i], total);
                }
                acc[r] = FMA(total, SET(xd[r * blocks + blk]), acc[r]);
            }
            continue;
        }
        const uint8_t *qs = type == GGML_Q5_K ? b + 48 : b + 16;
        const __m512i a = _mm512_loadu_si512(qs), c = _mm512_loadu_si512(qs + 64);
        w[0] = _mm512_and_si512(a, low4);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), low4);
        w[2] = _mm512_and_si512(c, low4);
        w[3] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
        if (type == GGML_Q5_K) {
            const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
            static const int first[4] = {0, 1, 4, 5}; /* vector i's sub-blocks: first[i], + 2 */
            for (int i = 0; i < 4; i++) {
                const __m512i counts = _mm512_inserti64x4(_mm512_set1_epi16((short)first[i]), _mm256_set1_epi16((short)(first[i] + 2)), 1);
                const __m512i bit = _mm512_slli_epi16(_mm512_srlv_epi16(high, counts), 4);
                w[i] = _mm512_ternarylogic_epi32(w[i], bit, _mm512_set1_epi8(0x10), 0xf8);
            }
        }
        __m256 sc, shift;
        k4_scale_vectors(b, &sc, &shift);
        for (int i = 0; i < 4; i++) scale[i] = _mm512_permutexvar_ps(pick[i], _mm512_castps256_ps512(sc));
        for (int r = 0; r < ROWS; r++) {
            const int8_t *xb = xq + r * k + blk * 256;
            vec total = ZERO();
            for (int i = 0; i < 4; i++) {
                const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i], _mm512_loadu_si512(xb + 64 * i));
                total = FMA(_mm512_cvtepi32_ps(sums), scale[i], total);
            }
            acc[r] = FMA(total, SET(xd[r * blocks + blk]), acc[r]);
            mins[r] = _mm256_fmadd_ps(shift, _mm256_loadu_ps(qx->sums + (r0 + r) * (k / 32) + blk * 8), mins[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) store1_bf16(out + r * ldo, HSUM(acc[r]) - hsum256(mins[r]));
}

/* ROWS rows of x against one Q8_0, Q4_0 or Q4_1 row of W: runs of 4 blocks as two vectors of
 * their first and last 16 q each (lane l: block l / 4), summed by two vpdpbusd into one int32
 * per lane, times its block's d and x's scale; a last run of fewer blocks one block at a time */
static inline __attribute__((always_inline)) void small_row_q8(
    const int ROWS, int64_t type, const uint8_t *restrict row, const quantized_x *qx,
    int64_t r0, int64_t k, bf16 *restrict out, int64_t ldo) {
    const int64_t blocks = k / 32, runs = blocks / Q8_RUN, bytes = quant_block_bytes(type);
    const int64_t at_q = type == GGML_Q4_0 ? 2 : 4; /* Q4_0 / Q4_1's nibbles; Q8_0: q at 2 */
    const __m512i low4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    const __m128i strides = _mm_set_epi32(3 * (int)bytes, 2 * (int)bytes, (int)bytes, 0);
    const __m512i even = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    vec acc[QI8_TILE_ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = ZERO();
    for (int64_t run = 0; run < runs; run++) {
        const uint8_t *b = row + run * Q8_RUN * bytes;
        for (int64_t line = 0; line < Q8_RUN * bytes; line += 64) prefetch_line(b + QUANT_AHEAD + line);
        __m512i first, last;
        if (type == GGML_Q8_0) {
            const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                                 _mm256_loadu_si256((const __m256i *)(b + bytes + 2)), 1);
            const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2 * bytes + 2))),
                                                 _mm256_loadu_si256((const __m256i *)(b + 3 * bytes + 2)), 1);
            first = _mm512_xor_si512(_mm512_shuffle_i64x2(a, c, _MM_SHUFFLE(2, 0, 2, 0)), flip);
            last = _mm512_xor_si512(_mm512_shuffle_i64x2(a, c, _MM_SHUFFLE(3, 1, 3, 1)), flip);
        } else {
            __m512i nibbles = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + at_q)));
            nibbles = _mm512_inserti32x4(nibbles, _mm_loadu_si128((const __m128i *)(b + bytes + at_q)), 1);
            nibbles = _mm512_inserti32x4(nibbles, _mm_loadu_si128((const __m128i *)(b + 2 * bytes + at_q)), 2);
            nibbles = _mm512_inserti32x4(nibbles, _mm_loadu_si128((const __m128i *)(b + 3 * bytes + at_q)), 3);
            first = _mm512_and_si512(nibbles, low4);
            last = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low4);
        }
        /* each block's first 4 bytes (d, and Q4_1's m) as 8 halves: d0 m0 d1 m1 ... */
        const __m256 halves = _mm256_cvtph_ps(_mm_i32gather_epi32((const int *)b, strides, 1));
        const vec d = _mm512_permutexvar_ps(even, _mm512_castps256_ps512(halves));
        const vec m = type == GGML_Q4_1 ? _mm512_permutexvar_ps(odd, _mm512_castps256_ps512(halves)) : ZERO();
        for (int r = 0; r < ROWS; r++) {
            const int64_t lanes = (r0 + r) * (k / 4) + run * 32;
            const int8_t *xq = qx->q + (r0 + r) * k + run * 128;
            const __m512i start = type == GGML_Q4_1 ? _mm512_setzero_si512() : _mm512_loadu_si512(qx->offset + lanes);
            const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, first, _mm512_loadu_si512(xq)),
                                                     last, _mm512_loadu_si512(xq + 64));
            acc[r] = FMA(_mm512_cvtepi32_ps(sums), MUL(d, _mm512_loadu_ps(qx->lane_scale + lanes)), acc[r]);
            if (type == GGML_Q4_1) acc[r] = FMA(m, _mm512_loadu_ps(qx->lane_sum + lanes), acc[r]);
        }
    }
    const __m256i nibble = _mm256_set1_epi8(0x0f), flip8 = _mm256_set1_epi8((char)0x80);
    float tail[QI8_TILE_ROWS] = {0};
    for (int64_t blk = runs * Q8_RUN; blk < blocks; blk++) {
        const uint8_t *b = row + blk * bytes;
        const float d = half_f16c(b), m = half_f16c(b + 2); /* m: Q4_1's */
        __m256i w;
        if (type == GGML_Q8_0) {
            w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), flip8);
        } else {
            const __m128i nibbles = _mm_loadu_si128((const __m128i *)(b + at_q));
            w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), nibble);
        }
        for (int r = 0; r < ROWS; r++) {
            const int64_t at = (r0 + r) * k + blk * 32;
            const __m256i start = type == GGML_Q4_1 ? _mm256_setzero_si256()
                                                    : _mm256_loadu_si256((const __m256i *)(qx->offset + at / 4));
            const __m256i sums = _mm256_dpbusd_epi32(start, w, _mm256_loadu_si256((const __m256i *)(qx->q + at)));
            tail[r] += d * qx->scale[at / 32] * hsum256(_mm256_cvtepi32_ps(sums));
            if (type == GGML_Q4_1) tail[r] += m * qx->sums[at / 32];
        }
    }
    for (int r = 0; r < ROWS; r++) store1_bf16(out + r * ldo, HSUM(acc[r]) + tail[r]);
}

static void free_quantized_x(quantized_x *qx) {
    free(qx->q);
    free(qx->scale);
    free(qx->offset);
    free(qx->lane_scale);
    free(qx->lane_sum);
    free(qx->sums);
}

int quant_linear_q8_bf16(bf16 *restrict out, const bf16 *restrict x, const uint8_t *restrict w,
                         int64_t type, int64_t rows, int64_t n, int64_t k, int64_t ldo) {
    CHECKED(check_blocks(type, rows, n, k));
    REQUIRE(ldo >= n); /* out's row stride */
    if (!rows || !n) return STATUS_OK;
    const int64_t row_bytes = quant_bytes(type, k);
    const int has_sums = type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q4_1;
    quantized_x qx = {
        .q = malloc((size_t)(rows * k)),
        .scale = malloc((size_t)(rows * (k / q8_group(type))) * sizeof(float)),
        .offset = q8_offset(type) ? malloc((size_t)(rows * (k / 4)) * sizeof(int32_t)) : NULL,
        .lane_scale = is_kquant(type) ? NULL : malloc((size_t)(rows * (k / 4)) * sizeof(float)),
        .lane_sum = type == GGML_Q4_1 ? malloc((size_t)(rows * (k / 4)) * sizeof(float)) : NULL,
        .sums = has_sums ? malloc((size_t)(rows * (k / 32)) * sizeof(float)) : NULL,
    };
    if (!qx.q || !qx.scale || (q8_offset(type) && !qx.offset) || (!is_kquant(type) && !qx.lane_scale) ||
        (type == GGML_Q4_1 && !qx.lane_sum) || (has_sums && !qx.sums)) {
        free_quantized_x(&qx);
        return failed(STATUS_NO_MEMORY, "malloc of x quantized to 8 bits");
    }
    quantize_x(&qx, type, x, rows, k);
    const int kquant = is_kquant(type);
    _Pragma("omp parallel for schedule(static) if (n > 16)")
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < rows; r += QI8_TILE_ROWS) {
            const uint8_t *wr = w + j * row_bytes;
            bf16 *o = out + r * ldo + j;
            const int64_t tile = rows - r < QI8_TILE_ROWS ? rows - r : QI8_TILE_ROWS;
#define QI8_CASE(R)                                                                               \
    case R:                                                                                       \
        if (kquant) kquant_row_q8(R, type, wr, &qx, r, k, o, ldo);                                \
        else small_row_q8(R, type, wr, &qx, r, k, o, ldo);                                        \
        break;
            switch (tile) {
                QI8_CASE(8) QI8_CASE(7) QI8_CASE(6) QI8_CASE(5) QI8_CASE(4) QI8_CASE(3) QI8_CASE(2)
                default:
                    if (kquant) kquant_row_q8(1, type, wr, &qx, r, k, o, ldo);
                    else small_row_q8(1, type, wr, &qx, r, k, o, ldo);
            }
#undef QI8_CASE
        }
    free_quantized_x(&qx);
    return STATUS_OK;
}
#endif

/* ---- GGUF blocks in AMX tiles (AMX-BF16) ------------------------------------------------------
 *
 * out [rows, n] = x @ W.T for steps of more rows than the fused kernels take: W's rows
 * dequantized 16 at a time, a block of 256 weights each (gguf_dequantize_bf16's values: the
 * reference path's bfloat16 weights), into a buffer of the thread's in L1, which tdpbf16ps
 * multiplies as its A tile (16 rows of W x 32 weights) by x as B tiles (32 weights x 16 rows
 * of x, in the pair layout, laid out once per call), accumulating float32 C tiles of 16 W rows
 * x 16 x rows over all of k; C is stored once and rounded to bfloat16. No tile of W ever
 * leaves the cache, so a step costs one pass of dequantization over the blocks whatever its
 * rows up to AMX_PASS_ROWS (beyond, one pass per AMX_PASS_ROWS). Linux lends a process the
 * tile registers only on request (`amx_ready`: arch_prctl ARCH_REQ_XCOMP_PERM); each thread
 * loads the tile configuration itself. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_CHUNKS 3                      /* B and C tile pairs: 16 rows of x each */
#define AMX_PASS_ROWS (16 * AMX_CHUNKS)   /* rows of x per pass over W */
#define AMX_SPAN 256                      /* weights of W dequantized per row at a time */

/* 1 if this process may use the AMX tile registers (asking Linux for them once), else 0 */
int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* x [rows, k] as B tiles: for each step of 32 weights and each chunk of 16 rows of x, 16 pairs
 * of weights x 16 rows x 2 (vdpbf16ps's pair layout), zeros past `rows` */
static void amx_layout_x(bf16 *restrict dst, const bf16 *restrict x, int64_t rows, int64_t k,
                         int64_t chunks) {
    memset(dst, 0, (size_t)(k / 32 * chunks * 512) * sizeof(bf16));
    for (int64_t m = 0; m < rows; m++) {
        const int64_t chunk = m / 16, column = m % 16;
        for (int64_t step = 0; step < k / 32; step++) {
            uint32_t *tile = (uint32_t *)(dst + (step * chunks + chunk) * 512);
            const uint32_t *pairs = (const uint32_t *)(x + m * k + step * 32);
            for (int p = 0; p < 16; p++) tile[p * 16 + column] = pairs[p];
        }
    }
}

static inline __attribute__((always_inline)) void amx_rows(
    const int CHUNKS, int64_t type, const uint8_t *restrict w, int64_t row_bytes, int64_t n, int64_t j0,
    int64_t count, const bf16 *restrict xt, int64_t chunks_total, int64_t chunk0, int64_t k,
    bf16 *restrict buffers, float *restrict c, bf16 *restrict out, int64_t ldo, int64_t rows) {
    const int64_t per = quant_block_weights(type), bytes = quant_block_bytes(type);
    const uint8_t *next = w + (j0 + 16) * row_bytes; /* the next 16 rows: `ahead` bytes */
    const int64_t ahead = (n - j0 - 16 < 16 ? (n - j0 - 16 > 0 ? n - j0 - 16 : 0) : 16) * row_bytes;
    _tile_zero(4);
    if (CHUNKS > 1) _tile_zero(5);
    if (CHUNKS > 2) _tile_zero(6);
    for (int64_t k0 = 0; k0 < k; k0 += AMX_SPAN) {
        const int64_t span = k - k0 < AMX_SPAN ? k - k0 : AMX_SPAN;
        /* two buffers in turn: a span's dequantization need not wait for the tile loads of
         * the one before */
        bf16 *restrict buffer = buffers + (k0 / AMX_SPAN % 2) * 16 * AMX_SPAN;
        /* the 16 rows are read side by side: fetch the next 16 (contiguous) as far ahead as
         * this span is into these */
        for (int64_t at = k0 * ahead / k / 64 * 64; at < (k0 + span) * ahead / k; at += 64)
            prefetch_line(next + at);
        for (int64_t r = 0; r < count; r++) {
            const uint8_t *blocks = w + (j0 + r) * row_bytes + k0 / per * bytes;
            for (int64_t i = 0; i < span / per; i++)
                dequantize_block_bf16(type, blocks + i * bytes, buffer + r * AMX_SPAN + i * per);
        }
        for (int64_t s = 0; s < span / 32; s++) {
            _tile_loadd(0, buffer + 32 * s, AMX_SPAN * sizeof(bf16));
            const bf16 *b = xt + ((k0 / 32 + s) * chunks_total + chunk0) * 512;
            _tile_loadd(1, b, 64);
            _tile_dpbf16ps(4, 0, 1);
            if (CHUNKS > 1) {
                _tile_loadd(2, b + 512, 64);
                _tile_dpbf16ps(5, 0, 2);
            }
            if (CHUNKS > 2) {
                _tile_loadd(3, b + 1024, 64);
                _tile_dpbf16ps(6, 0, 3);
            }
        }
    }
    _tile_stored(4, c, 64);
    if (CHUNKS > 1) _tile_stored(5, c + 256, 64);
    if (CHUNKS > 2) _tile_stored(6, c + 512, 64);
    for (int chunk = 0; chunk < CHUNKS; chunk++)
        for (int64_t m = 0; m < 16 && (chunk0 + chunk) * 16 + m < rows; m++)
            for (int64_t r = 0; r < count; r++)
                store1_bf16(out + ((chunk0 + chunk) * 16 + m) * ldo + j0 + r, c[chunk * 256 + r * 16 + m]);
}

int quant_linear_amx_bf16(bf16 *restrict out, const bf16 *restrict x, const uint8_t *restrict w,
                          int64_t type, int64_t rows, int64_t n, int64_t k, int64_t ldo) {
    CHECKED(check_blocks(type, rows, n, k));
    REQUIRE(ldo >= n); /* out's row stride */
    if (!amx_ready()) return failed(STATUS_UNAVAILABLE, "amx_ready()");
    if (!rows || !n) return STATUS_OK;
    const int64_t row_bytes = quant_bytes(type, k);
    const int64_t chunks = (rows + 15) / 16;
    bf16 *xt = aligned_alloc(64, (size_t)(k / 32 * chunks * 512) * sizeof(bf16));
    if (!xt) return failed(STATUS_NO_MEMORY, "aligned_alloc of x in tiles");
    amx_layout_x(xt, x, rows, k, chunks);
    _Pragma("omp parallel")
    {
        tile_config config;
        memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int t = 0; t < 7; t++) {
            config.colsb[t] = 64;
            config.rows[t] = 16;
        }
        _tile_loadconfig(&config);
        bf16 buffer[2 * 16 * AMX_SPAN] __attribute__((aligned(64)));
        float c[AMX_CHUNKS * 256] __attribute__((aligned(64)));
        _Pragma("omp for schedule(static)")
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t count = n - j0 < 16 ? n - j0 : 16;
            for (int64_t chunk0 = 0; chunk0 < chunks; chunk0 += AMX_CHUNKS) {
                switch (chunks - chunk0 < AMX_CHUNKS ? chunks - chunk0 : AMX_CHUNKS) {
                case 3: amx_rows(3, type, w, row_bytes, n, j0, count, xt, chunks, chunk0, k, buffer, c, out, ldo, rows); break;
                case 2: amx_rows(2, type, w, row_bytes, n, j0, count, xt, chunks, chunk0, k, buffer, c, out, ldo, rows); break;
                default: amx_rows(1, type, w, row_bytes, n, j0, count, xt, chunks, chunk0, k, buffer, c, out, ldo, rows);
                }
            }
        }
        _tile_release();
    }
    free(xt);
    return STATUS_OK;
}
#endif

#endif

/* ---- prefill attention, bfloat16, head size 64 or 128 (AVX-512 BF16) -------------------------
 *
 * One prefill chunk of one sequence: its `num_query` queries (rows query_start.. of qkv, the
 * last positions of the sequence) against its `num_keys` keys and values, read from the paged
 * cache (the chunk's own already written there), causal. Flash-attention style: each tile of
 * 4 query rows of one head streams the key tiles it may see (32 keys each), with an online
 * softmax in float32; q . k and p . v by vdpbf16ps on bfloat16 (exact products, float32
 * sums; p rounded to bfloat16, as flash attention's P @ V does), out rounded once.
 *
 * First every KV head's keys and values are packed into `scratch` (tiles of 32 keys, pairs
 * of bfloat16 in vdpbf16ps's layout, zeros past num_keys), HD the head size:
 *   keys:   [kv_head][tile][HD / 2][32 keys][2]  (a pair of dimensions per key)
 *   values: [kv_head][tile][16 key pairs][HD][2]  (a pair of keys per dimension)
 * scratch holds 2 * num_kv_heads * tiles * 32 * HD bfloat16. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PREFILL_ROWS 4  /* query rows per tile */

static inline __attribute__((always_inline)) void prefill_rows(
    const int HD, const int ROWS, bf16 *restrict out, int64_t out_stride, const bf16 *restrict q,
    int64_t q_stride, const bf16 *restrict keys, const bf16 *restrict values, int64_t first_pos,
    int64_t num_keys, float scale) {
    const int tile = PREFILL_KEYS * HD, outs = HD / 16;
    float run_max[PREFILL_ROWS], run_sum[PREFILL_ROWS];
    vec acc[PREFILL_ROWS][PREFILL_MAX_HD / 16];
    for (int r = 0; r < ROWS; r++) {
        run_max[r] = -INFINITY;
        run_sum[r] = 0.0f;
        for (int c = 0; c < outs; c++) acc[r][c] = ZERO();
    }
    const int64_t last_key = first_pos + ROWS - 1; /* the last row's own position */
    const int64_t end = last_key + 1 < num_keys ? last_key + 1 : num_keys;
    for (int64_t start = 0; start < end; start += PREFILL_KEYS) {
        const bf16 *kt = keys + (start / PREFILL_KEYS) * tile;
        const bf16 *vt = values + (start / PREFILL_KEYS) * tile;
        vec scores[PREFILL_ROWS][2];
        for (int r = 0; r < ROWS; r++) scores[r][0] = scores[r][1] = ZERO();
        for (int pair = 0; pair < HD / 2; pair++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + pair * 64);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + pair * 64 + 32);
            for (int r = 0; r < ROWS; r++) {
                int32_t bits;
                memcpy(&bits, q + r * q_stride + 2 * pair, sizeof bits);
                const __m512bh qq = (__m512bh)_mm512_set1_epi32(bits);
                scores[r][0] = _mm512_dpbf16_ps(scores[r][0], k0, qq);
                scores[r][1] = _mm512_dpbf16_ps(scores[r][1], k1, qq);
            }
        }
        int32_t probs[PREFILL_ROWS][16]; /* bfloat16 pairs (key 2i, key 2i + 1) */
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (int r = 0; r < ROWS; r++) {
            /* keys after the row's own position (and past the sequence) are not seen */
            const int64_t seen = first_pos + r + 1 - start;
            for (int h = 0; h < 2; h++) {
                const __mmask16 visible = _mm512_cmplt_epi32_mask(
                    _mm512_add_epi32(lane, _mm512_set1_epi32(16 * h)),
                    _mm512_set1_epi32((int32_t)(seen < PREFILL_KEYS ? seen : PREFILL_KEYS)));
                scores[r][h] = _mm512_mask_mov_ps(SET(-INFINITY), visible, scores[r][h]);
            }
            const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(scores[r][0], scores[r][1]));
            const float new_max = tile_max > run_max[r] ? tile_max : run_max[r];
            const float rescale = expf((run_max[r] - new_max) * scale);
            run_max[r] = new_max;
            const vec shift = SET(new_max * scale);
            const vec p0 = exp_vec(_mm512_fmsub_ps(scores[r][0], SET(scale), shift));
            const vec p1 = exp_vec(_mm512_fmsub_ps(scores[r][1], SET(scale), shift));
            run_sum[r] = run_sum[r] * rescale + _mm512_reduce_add_ps(ADD(p0, p1));
            for (int c = 0; c < outs; c++) acc[r][c] = MUL(acc[r][c], SET(rescale));
            /* keys 0-31 as consecutive bfloat16: 32-bit lane i is the pair (2i, 2i + 1) */
            _mm512_storeu_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        for (int pair = 0; pair < 16; pair++) {
            __m512bh v[PREFILL_MAX_HD / 16];
            for (int c = 0; c < outs; c++)
                v[c] = (__m512bh)_mm512_loadu_si512(vt + pair * 2 * HD + c * 32);
            for (int r = 0; r < ROWS; r++) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32(probs[r][pair]);
                for (int c = 0; c < outs; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], pp);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        const vec inv = SET(1.0f / run_sum[r]);
        for (int c = 0; c < outs; c++)
            store_bf16(out + r * out_stride + c * 16, MUL(acc[r][c], inv), 16);
    }
}

static inline __attribute__((always_inline)) void prefill_chunk(
    const int HD, bf16 *restrict out, const bf16 *restrict qkv, const bf16 *restrict k_cache,
    const bf16 *restrict v_cache, const int32_t *restrict table, bf16 *restrict scratch,
    int64_t query_start, int64_t num_query, int64_t num_keys, int64_t num_heads,
    int64_t num_kv_heads, int64_t block_size, int64_t num_slots, int64_t qkv_width, float scale) {
    const int64_t tiles = (num_keys + PREFILL_KEYS - 1) / PREFILL_KEYS, tile = PREFILL_KEYS * HD;
    const int64_t group = num_heads / num_kv_heads;
    bf16 *packed_keys = scratch, *packed_values = scratch + num_kv_heads * tiles * tile;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t work = 0; work < num_kv_heads * tiles; work++) {
        const int64_t h = work / tiles, t = work % tiles;
        bf16 *kp = packed_keys + work * tile, *vp = packed_values + work * tile;
        const bf16 *keys = k_cache + h * num_slots * HD, *values = v_cache + h * num_slots * HD;
        for (int64_t j = 0; j < PREFILL_KEYS; j++) {
            const int64_t key = t * PREFILL_KEYS + j;
            const bf16 *k = NULL, *v = NULL;
            if (key < num_keys) {
                const int64_t slot = (int64_t)table[key / block_size] * block_size + key % block_size;
                k = keys + slot * HD;
                v = values + slot * HD;
            }
            for (int64_t d = 0; d < HD; d++) {
                kp[(d / 2) * 64 + j * 2 + d % 2] = k ? k[d] : 0;
                vp[(j / 2) * 2 * HD + d * 2 + j % 2] = v ? v[d] : 0;
            }
        }
    }
    const int64_t row_tiles = (num_query + PREFILL_ROWS - 1) / PREFILL_ROWS;
    const int64_t out_width = num_heads * HD, first = num_keys - num_query;
    _Pragma("omp parallel for schedule(dynamic)")
    for (int64_t work = 0; work < num_heads * row_tiles; work++) {
        const int64_t head = work % num_heads, row = (work / num_heads) * PREFILL_ROWS;
        const int64_t rows = num_query - row < PREFILL_ROWS ? num_query - row : PREFILL_ROWS;
        const int64_t h = head / group;
        bf16 *o = out + (query_start + row) * out_width + head * HD;
        const bf16 *q = qkv + (query_start + row) * qkv_width + head * HD;
        const bf16 *kp = packed_keys + h * tiles * tile;
        const bf16 *vp = packed_values + h * tiles * tile;
#define PREFILL_ROWS_CALL(ROWS) \
    prefill_rows(HD, ROWS, o, out_width, q, qkv_width, kp, vp, first + row, num_keys, scale)
        switch (rows) {
        case 4: PREFILL_ROWS_CALL(4); break;
        case 3: PREFILL_ROWS_CALL(3); break;
        case 2: PREFILL_ROWS_CALL(2); break;
        default: PREFILL_ROWS_CALL(1);
        }
#undef PREFILL_ROWS_CALL
    }
}

/* head_dim: 64 or 128 (fast_paths.PREFILL_KERNEL_HEAD_DIMS) */
int prefill_attention_bf16(bf16 *restrict out, const bf16 *restrict qkv,
                           const bf16 *restrict k_cache, const bf16 *restrict v_cache,
                           const int32_t *restrict table, bf16 *restrict scratch,
                           int64_t query_start, int64_t num_query, int64_t num_keys,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t num_slots, int64_t qkv_width,
                           float scale) {
    REQUIRE(head_dim == 64 || head_dim == PREFILL_MAX_HD);
    REQUIRE(num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0);
    REQUIRE(query_start >= 0 && num_query >= 0 && num_query <= num_keys);
    REQUIRE(block_size > 0 && num_slots > 0);
    REQUIRE(qkv_width >= (num_heads + 2 * num_kv_heads) * head_dim);
#define PREFILL_CHUNK(HD)                                                                        \
    prefill_chunk(HD, out, qkv, k_cache, v_cache, table, scratch, query_start, num_query,        \
                  num_keys, num_heads, num_kv_heads, block_size, num_slots, qkv_width, scale)
    if (head_dim == 64) PREFILL_CHUNK(64);
    else PREFILL_CHUNK(128);
#undef PREFILL_CHUNK
    return STATUS_OK;
}
#endif

/* ---- a whole decoder stack in one call (AVX-512 BF16) ------------------------------------------
 *
 * The layers of a Llama-style model whose four matrices per layer are 4-bit (bfloat16, head
 * size 64, one rank, no biases), each layer exactly as the Python loop runs it (llama.py
 * `LlamaModel.forward` with KernelOps), the same kernels in the same order on the same buffers,
 * so the results are the same bits: what it saves is the Python and ctypes around 13 calls a
 * layer (0.8 ms a step of the default model's 30 layers, whatever the batch).
 *
 * layers[l * STACK_FIELDS + f]: the addresses of layer l's tensors (enum below; a matrix's
 * 4-bit bytes, parameters and panels). dims: see STACK_DIMS. prefills[i * PREFILL_CHUNK_FIELDS
 * + ...]: query_start, num_query, num_keys, block table address (int32) of the step's i-th
 * prefill chunk (PREFILL_CHUNK_LIST). hidden [tokens, hidden_size] is the residual stream
 * (updated); out receives the final norm's output. The buffers x, delta [tokens,
 * hidden_size], attn [tokens, heads * 64], qkv [tokens, qkv width], gate_up [tokens, 2 *
 * intermediate], act [tokens, intermediate], sums (the 4-bit kernel's, int4_max_rows * k / 32
 * floats for the widest k) and prefill_scratch (prefill_attention_bf16's, for the longest
 * chunk) are the caller's. */
/* The fields of layers[] and dims[], in order: the one list that both this file and kernels.py
 * (which reads the names from otel_kernels_contract) build them from. A matrix is three
 * consecutive fields: its 4-bit bytes, its parameters, its panels (stack_linear reads field + 1
 * and field + 2). */
#define STACK_FIELD_LIST(X)                                                                      \
    X(INPUT_NORM, input_norm) X(POST_NORM, post_norm)                                            \
    X(QKV, qkv_packed) X(QKV_PARAMS, qkv_params) X(QKV_PANELS, qkv_panels)                       \
    X(O, o_packed) X(O_PARAMS, o_params) X(O_PANELS, o_panels)                                   \
    X(GATE_UP, gate_up_packed) X(GATE_UP_PARAMS, gate_up_params) X(GATE_UP_PANELS, gate_up_panels) \
    X(DOWN, down_packed) X(DOWN_PARAMS, down_params) X(DOWN_PANELS, down_panels)                 \
    X(K_CACHE, k_cache) X(V_CACHE, v_cache)
#define STACK_DIM_LIST(X)                                                                        \
    X(TOKENS, tokens) X(HIDDEN, hidden) X(INTERMEDIATE, intermediate) X(HEADS, heads)            \
    X(KV_HEADS, kv_heads) X(BLOCK_SIZE, block_size) X(NUM_SLOTS, num_slots)                      \
    X(INT4_MAX_ROWS, int4_max_rows) X(DECODES, decodes) X(MAX_BLOCKS, max_blocks)                \
    X(PREFILLS, prefills) X(LAYERS, layers)
#define STACK_ENUM(E, name) STACK_##E,
#define DIM_ENUM(E, name) DIM_##E,
enum { STACK_FIELD_LIST(STACK_ENUM) STACK_FIELDS };
enum { STACK_DIM_LIST(DIM_ENUM) STACK_DIMS };
#define STACK_HEAD_DIM 64 /* the only head size the stack takes */
/* A prefill chunk's row of prefills[]: int64 fields, in order. */
#define PREFILL_CHUNK_LIST(X)                                                                    \
    X(QUERY_START, query_start) X(NUM_QUERY, num_query) X(NUM_KEYS, num_keys) X(TABLE, table)
#define CHUNK_ENUM(E, name) CHUNK_##E,
enum { PREFILL_CHUNK_LIST(CHUNK_ENUM) PREFILL_CHUNK_FIELDS };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
/* As LlamaModel._linear: the exact 4-bit kernel up to max_rows rows, the panels beyond. */
static int stack_linear(bf16 *out, const bf16 *x, const int64_t *layer, int field, float *sums,
                        int64_t rows, int64_t max_rows, int64_t n, int64_t k) {
    if (rows > max_rows)
        return panel_linear_bf16(out, x, (const bf16 *)(intptr_t)layer[field + 2], rows, n, k);
    return q4_linear_bf16(out, x, (const uint8_t *)(intptr_t)layer[field],
                          (const float *)(intptr_t)layer[field + 1], sums, rows, n, k);
}

int decoder_stack_bf16(bf16 *hidden, bf16 *out, const int64_t *layers, const int64_t *dims,
                       const bf16 *final_norm, const float *cos_sin, const int64_t *positions,
                       const int64_t *slots, const int32_t *decode_tables,
                       const int32_t *decode_lens, const int64_t *prefills, bf16 *x, bf16 *qkv,
                       bf16 *attn, bf16 *delta, bf16 *gate_up, bf16 *act, float *sums,
                       bf16 *prefill_scratch, float eps, float scale) {
    const int64_t tokens = dims[DIM_TOKENS], size = dims[DIM_HIDDEN];
    const int64_t inter = dims[DIM_INTERMEDIATE], heads = dims[DIM_HEADS];
    const int64_t kv_heads = dims[DIM_KV_HEADS], block_size = dims[DIM_BLOCK_SIZE];
    const int64_t num_slots = dims[DIM_NUM_SLOTS], max_rows = dims[DIM_INT4_MAX_ROWS];
    const int64_t hd = STACK_HEAD_DIM, qkv_width = (heads + 2 * kv_heads) * hd;
    REQUIRE(dims[DIM_LAYERS] >= 0 && dims[DIM_DECODES] >= 0 && dims[DIM_PREFILLS] >= 0);
    REQUIRE(max_rows >= 0);
    for (int64_t l = 0; l < dims[DIM_LAYERS]; l++) {
        const int64_t *layer = layers + l * STACK_FIELDS;
        bf16 *k_cache = (bf16 *)(intptr_t)layer[STACK_K_CACHE];
        bf16 *v_cache = (bf16 *)(intptr_t)layer[STACK_V_CACHE];
        CHECKED(add_rms_norm_bf16(hidden, l ? delta : NULL,
                                  (const bf16 *)(intptr_t)layer[STACK_INPUT_NORM], x, tokens, size,
                                  eps));
        CHECKED(stack_linear(qkv, x, layer, STACK_QKV, sums, tokens, max_rows, qkv_width, size));
        CHECKED(rope_and_cache_bf16(qkv, cos_sin, positions, slots, k_cache, v_cache, tokens,
                                    heads, kv_heads, hd, num_slots));
        if (dims[DIM_DECODES])
            CHECKED(decode_attention_bf16(attn, qkv, k_cache, v_cache, decode_tables, decode_lens,
                                          dims[DIM_DECODES], heads, kv_heads, hd, block_size,
                                          dims[DIM_MAX_BLOCKS], num_slots, qkv_width, scale));
        for (int64_t i = 0; i < dims[DIM_PREFILLS]; i++) {
            const int64_t *chunk = prefills + PREFILL_CHUNK_FIELDS * i;
            CHECKED(prefill_attention_bf16(
                attn, qkv, k_cache, v_cache, (const int32_t *)(intptr_t)chunk[CHUNK_TABLE],
                prefill_scratch, chunk[CHUNK_QUERY_START], chunk[CHUNK_NUM_QUERY],
                chunk[CHUNK_NUM_KEYS], heads, kv_heads, hd, block_size, num_slots, qkv_width,
                scale));
        }
        CHECKED(stack_linear(delta, attn, layer, STACK_O, sums, tokens, max_rows, size, heads * hd));
        CHECKED(add_rms_norm_bf16(hidden, delta, (const bf16 *)(intptr_t)layer[STACK_POST_NORM], x,
                                  tokens, size, eps));
        CHECKED(stack_linear(gate_up, x, layer, STACK_GATE_UP, sums, tokens, max_rows, 2 * inter,
                             size));
        CHECKED(silu_mul_bf16(act, gate_up, tokens, inter));
        CHECKED(stack_linear(delta, act, layer, STACK_DOWN, sums, tokens, max_rows, size, inter));
    }
    return add_rms_norm_bf16(hidden, delta, final_norm, out, tokens, size, eps);
}
#endif

/* ---- fault drill ---------------------------------------------------------------------------
 *
 * The faults a broken kernel makes, on purpose, for the engine's fault injector: inside an
 * OpenMP region of two threads, thread `thread` (0: the calling thread, 1: an OpenMP worker)
 * makes fault `kind` while the other waits at the region's end. kind 1: SIGSEGV (a write to
 * address 16); kind 2: SIGFPE (an integer division by zero); kind 3: SIGBUS (a read of
 * `target`, which the caller points into a file mapping past the file's end). Returns
 * STATUS_OK when nothing faulted (a region that got one thread), STATUS_BAD_ARGUMENT for
 * another kind or thread. Exported in every build. */
enum { DRILL_SEGV = 1, DRILL_FPE = 2, DRILL_BUS = 3 };

int fault_drill(int64_t kind, int64_t thread, const void *target) {
    REQUIRE(kind >= DRILL_SEGV && kind <= DRILL_BUS);
    REQUIRE(thread == 0 || thread == 1);
    REQUIRE(kind != DRILL_BUS || target);
    volatile int64_t sink = 0;
    _Pragma("omp parallel num_threads(2)")
    {
        if (omp_get_thread_num() == thread) {
            if (kind == DRILL_SEGV) {
                int *volatile invalid = (int *)(intptr_t)16;
                *(volatile int *)invalid = 1;
            } else if (kind == DRILL_FPE) {
                volatile int64_t one = 1, zero = 0; /* both unknown: a real division */
                sink = one / zero;
            } else {
                sink = *(const volatile uint8_t *)target;
            }
        }
    }
    (void)sink;
    return STATUS_OK;
}

/* ---- the contract with kernels.py ------------------------------------------------------------
 *
 * OTEL_KERNELS_ABI changes whenever an exported function's arguments, the stack's fields,
 * dims or head size, the prefill chunks' fields, the GGML ids, the statuses or a layout
 * constant below change meaning; kernels.py refuses a library whose number
 * or target differs from what it expects. otel_kernels_build_tag is read from the file
 * before it is loaded (a library built for another CPU is never run); otel_kernels_contract()
 * says the rest as key=value pairs, the stack's field and dim names, the prefill chunks'
 * fields and the status names in their order, the GGML types as name:id. */
#define OTEL_KERNELS_ABI 9
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) &&                  \
    defined(__AVX512VL__) && defined(__AVX512BF16__)
#define OTEL_KERNELS_ISA "avx512bf16"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) &&                \
    defined(__AVX512VL__)
#define OTEL_KERNELS_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define OTEL_KERNELS_ISA "avx2"
#elif defined(__x86_64__)
#define OTEL_KERNELS_ISA "baseline"
#else
#define OTEL_KERNELS_ISA "generic"
#endif
#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
#define NAME_ITEM(E, name) #name ","
#define TYPE_ITEM(name, id) #name ":" #id ","

__attribute__((used)) const char otel_kernels_build_tag[] =
    "otel-kernels-build:abi=" STRINGIFY(OTEL_KERNELS_ABI) ";isa=" OTEL_KERNELS_ISA ";";

const char *otel_kernels_contract(void) {
    return "abi=" STRINGIFY(OTEL_KERNELS_ABI) ";isa=" OTEL_KERNELS_ISA
           ";max_block_size=" STRINGIFY(MAX_BLOCK_SIZE) ";int4_group=" STRINGIFY(Q4_GROUP)
           ";panel_blocks=" STRINGIFY(PANEL_BLOCKS) ";prefill_tile_keys=" STRINGIFY(PREFILL_KEYS)
           ";prefill_max_head_dim=" STRINGIFY(PREFILL_MAX_HD)
           ";stack_fields=" STACK_FIELD_LIST(NAME_ITEM) ";stack_dims=" STACK_DIM_LIST(NAME_ITEM)
           ";stack_head_dim=" STRINGIFY(STACK_HEAD_DIM)
           ";prefill_chunk_fields=" PREFILL_CHUNK_LIST(NAME_ITEM)
           ";ggml_types=" GGML_TYPE_LIST(TYPE_ITEM) ";statuses=" STATUS_LIST(NAME_ITEM);
}
