/* kernels.c — element-wise reductions used by every CPU transport.
 *
 * [Note: reduction kernels]
 * Each (dtype, op) pair has two kernels generated from one macro: combine
 * (d = a op b) and fold (d = d op s).  dptc_reduce walks the buffers in
 * blocks of BLOCK_BYTES: a block's partial result stays in L1 while every
 * source is folded into it, so memory sees one read per source and one write
 * of dst, whatever nsrc is.
 *
 * Order: sources are always combined in index order, ((s0 op s1) op s2)...,
 * so a floating-point result never depends on which source dst aliases.
 *
 * Aliasing: every kernel declares its pointers restrict, which C allows only
 * when the array a kernel writes is none of the arrays it reads.  The driver
 * guarantees that by choosing where a block is built (see block_site): in
 * dst when dst is no source, on top of srcs[0] when dst is srcs[0], and in a
 * stack block copied out afterwards when dst is a later source.
 *
 * bfloat16 and float16 have their own kernels, which read 16-bit sources
 * and accumulate in a float32 stack block (load, combine, fold), and a
 * store that rounds the block once, to nearest even, into dst.  The store
 * reads only that block, so aliasing cannot matter there.
 *
 * Integers wrap like two's complement: SUM and PRODUCT run on the unsigned
 * type of the same width (which may read a signed object, C11 6.5p7), MAX and
 * MIN compare in the element's own type.  BAND, BOR and BXOR act on the
 * bits, on the unsigned type of the same width (int8 and uint8 share their
 * kernels, as for SUM).  bool: SUM, MAX and BOR are a logical or, MIN,
 * PRODUCT and BAND a logical and, BXOR an exclusive or (over several
 * sources: whether an odd number of them is true); results are 0 or 1,
 * whatever nonzero byte a source holds.  Floating types have no bitwise
 * ops: dptc_reduce refuses them, as torch's gloo does.
 *
 * Floating MAX and MIN propagate NaN, like torch.maximum and torch.minimum.
 *
 * [Note: AVG divides]
 * AVG is SUM followed by a division of the sum by the number of ranks, as
 * torch's gloo computes it (sum / n), not a multiplication by 1/n: 1/n is
 * inexact unless n is a power of two, and x * fl(1/n) then differs from
 * x / n by an ulp for about a third of all x at n = 3.  Where n is a power
 * of two, 1/n is exact and x * (1/n) rounds the same real number as x / n,
 * so the kernels multiply there (the cheaper instruction) and divide
 * otherwise; either way the result is the correctly rounded quotient.
 * bfloat16 and float16 divide their float32 sum and round once.
 */
#include "kernels.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

/* The loops below are only worth anything vectorised.  -O2 in gcc 12
 * vectorises with the "very cheap" cost model, which gives up on loops whose
 * trip count is not known to be a multiple of the vector width; ask for the
 * -O3 vectoriser for this file only. */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__OPTIMIZE_SIZE__)
#pragma GCC optimize("O3")
#endif

/* Hot loops are compiled twice, for the x86-64 baseline and for AVX2 (with
 * F16C and BMI2: x86-64-v3), and the loader picks one per machine (an ifunc,
 * hence glibc).  Memory-bound loops gain little from it; the bfloat16
 * conversions, whose narrowing SSE2 lacks, gain most.
 *
 * Defining DPTC_REDUCE_PORTABLE builds only the baseline loops (no clones,
 * no F16C kernels): the tests build it too, so that the code other machines
 * would run is checked on this one.  ThreadSanitizer builds get none either:
 * the loader runs the clones' ifunc resolvers before TSan's runtime is up. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) \
    && defined(__GLIBC__) && defined(__has_attribute) \
    && !defined(DPTC_REDUCE_PORTABLE) && !defined(__SANITIZE_THREAD__)
#if __has_attribute(target_clones)
#define HOT_LOOP __attribute__((target_clones("default", "arch=x86-64-v3")))
#endif
#endif
#ifndef HOT_LOOP
#define HOT_LOOP
#endif

/* Bytes of one block: each source's block and the partial result together
 * stay well inside L1. */
#define BLOCK_BYTES 8192

/* Stack storage for a block's partial result, typed so that each kernel
 * writes it through a member of its own element type. */
typedef union {
    float f32[BLOCK_BYTES / sizeof(float)];
    double f64[BLOCK_BYTES / sizeof(double)];
    uint64_t u64[BLOCK_BYTES / sizeof(uint64_t)];
    int64_t i64[BLOCK_BYTES / sizeof(int64_t)];
    uint32_t u32[BLOCK_BYTES / sizeof(uint32_t)];
    int32_t i32[BLOCK_BYTES / sizeof(int32_t)];
    uint8_t u8[BLOCK_BYTES];
    int8_t i8[BLOCK_BYTES];
} block_buffer;

/* ---- element operations ---- */

#define ADD(a, b) ((a) + (b))
#define MULTIPLY(a, b) ((a) * (b))
#define GREATER(a, b) ((a) > (b) ? (a) : (b))
#define LESSER(a, b) ((a) < (b) ? (a) : (b))
#define EITHER(a, b) (((a) != 0) | ((b) != 0))
#define BOTH(a, b) (((a) != 0) & ((b) != 0))
#define DIFFER(a, b) (((a) != 0) ^ ((b) != 0))
#define BIT_AND(a, b) ((a) & (b))
#define BIT_OR(a, b) ((a) | (b))
#define BIT_XOR(a, b) ((a) ^ (b))

static inline float max_f32(float a, float b)
{
    return (isnan(a) || a > b) ? a : b;
}

static inline float min_f32(float a, float b)
{
    return (isnan(a) || a < b) ? a : b;
}

static inline double max_f64(double a, double b)
{
    return (isnan(a) || a > b) ? a : b;
}

static inline double min_f64(double a, double b)
{
    return (isnan(a) || a < b) ? a : b;
}

/* ---- bfloat16 and float16 conversions ---- */

static inline uint32_t f32_bits(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

static inline float f32_from_bits(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* cond ? if_true : if_false, computed without a branch.  The conversions
 * below compute both sides of each choice and blend them with a mask: gcc
 * will not move a floating-point operation under a condition it cannot
 * if-convert (it could trap, by default -ftrapping-math), which would keep
 * the conversion loops from vectorising. */
static inline uint32_t select_bits(bool cond, uint32_t if_true,
                                   uint32_t if_false)
{
    uint32_t mask = 0u - (uint32_t)cond;
    return (if_true & mask) | (if_false & ~mask);
}

/* bfloat16 is the top half of a float32. */
static inline float bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

/* Rounds to nearest even; NaN stays NaN, made quiet.  A NaN first loses
 * the low half the rounding would carry out of (and gains the quiet bit),
 * so that rounding leaves it alone: one choice, made on 32-bit lanes. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t bits = f32_bits(f);
    bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    bits = select_bits(nan, (bits | 0x00400000u) & 0xffff0000u, bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. */
static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t magnitude = h & 0x7fffu;
    /* Normal: move the fields into place and rebias 15 -> 127. */
    uint32_t bits = (magnitude << 13) + 0x38000000u;
    /* Infinity and NaN: exponent 31 becomes 255 (the payload moves along). */
    bits = select_bits(magnitude >= 0x7c00u, bits + 0x38000000u, bits);
    /* Zero and subnormal: magnitude units of 2^-24, exact in float32. */
    float subnormal = (float)(int32_t)magnitude * 0x1p-24f;
    bits = select_bits(magnitude < 0x0400u, f32_bits(subnormal), bits);
    return f32_from_bits(bits | sign);
}

/* Rounds to nearest even; overflow gives infinity; NaN stays NaN, quiet. */
static inline uint16_t f32_to_f16(float f)
{
    uint32_t bits = f32_bits(f);
    uint32_t sign = (bits >> 16) & 0x8000u;
    uint32_t magnitude = bits & 0x7fffffffu;
    /* Normal: rebias 127 -> 15, round on the 13 dropped bits; a carry out
     * of the mantissa correctly bumps the exponent (up to infinity). */
    uint32_t normal = (magnitude - 0x38000000u + 0x0fffu
                       + ((magnitude >> 13) & 1u)) >> 13;
    /* Below 2^-14: adding 0.5 leaves the value in [0.5, 1), whose float32
     * spacing is 2^-24, the float16 subnormal step; the FPU's own
     * round-to-nearest-even does the rounding. */
    float shifted = f32_from_bits(magnitude) + 0.5f;
    uint32_t subnormal = f32_bits(shifted) - 0x3f000000u;
    uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
    uint32_t h = select_bits(magnitude < 0x38800000u, subnormal, normal);
    h = select_bits(magnitude >= 0x47800000u, 0x7c00u, h); /* >= 65536, inf */
    h = select_bits(magnitude > 0x7f800000u, nan, h);
    return (uint16_t)(sign | h);
}

/* ---- kernels on one element type ---- */

typedef void (*combine_fn)(void *dst, const void *a, const void *b,
                           size_t n);
typedef void (*fold_fn)(void *dst, const void *src, size_t n);
typedef void (*divide_fn)(void *buf, size_t n, int divisor);

static inline bool is_power_of_two(int n)
{
    return n > 0 && (n & (n - 1)) == 0;
}

/* See [Note: reduction kernels]. */
#define DEFINE_SAME_KERNELS(name, T, OP)                                   \
    HOT_LOOP                                                              \
    static void name##_combine(void *dst, const void *a, const void *b,  \
                               size_t n)                                  \
    {                                                                     \
        T *restrict d = dst;                                              \
        const T *restrict x = a;                                          \
        const T *restrict y = b;                                          \
        for (size_t i = 0; i < n; i++)                                    \
            d[i] = OP(x[i], y[i]);                                        \
    }                                                                     \
    HOT_LOOP                                                              \
    static void name##_fold(void *dst, const void *src, size_t n)         \
    {                                                                     \
        T *restrict d = dst;                                              \
        const T *restrict s = src;                                        \
        for (size_t i = 0; i < n; i++)                                    \
            d[i] = OP(d[i], s[i]);                                        \
    }

DEFINE_SAME_KERNELS(f32_sum, float, ADD)
DEFINE_SAME_KERNELS(f32_max, float, max_f32)
DEFINE_SAME_KERNELS(f32_min, float, min_f32)
DEFINE_SAME_KERNELS(f32_product, float, MULTIPLY)
DEFINE_SAME_KERNELS(f64_sum, double, ADD)
DEFINE_SAME_KERNELS(f64_max, double, max_f64)
DEFINE_SAME_KERNELS(f64_min, double, min_f64)
DEFINE_SAME_KERNELS(f64_product, double, MULTIPLY)
DEFINE_SAME_KERNELS(u64_sum, uint64_t, ADD)
DEFINE_SAME_KERNELS(u64_product, uint64_t, MULTIPLY)
DEFINE_SAME_KERNELS(u64_band, uint64_t, BIT_AND)
DEFINE_SAME_KERNELS(u64_bor, uint64_t, BIT_OR)
DEFINE_SAME_KERNELS(u64_bxor, uint64_t, BIT_XOR)
DEFINE_SAME_KERNELS(i64_max, int64_t, GREATER)
DEFINE_SAME_KERNELS(i64_min, int64_t, LESSER)
DEFINE_SAME_KERNELS(u32_sum, uint32_t, ADD)
DEFINE_SAME_KERNELS(u32_product, uint32_t, MULTIPLY)
DEFINE_SAME_KERNELS(u32_band, uint32_t, BIT_AND)
DEFINE_SAME_KERNELS(u32_bor, uint32_t, BIT_OR)
DEFINE_SAME_KERNELS(u32_bxor, uint32_t, BIT_XOR)
DEFINE_SAME_KERNELS(i32_max, int32_t, GREATER)
DEFINE_SAME_KERNELS(i32_min, int32_t, LESSER)
DEFINE_SAME_KERNELS(u8_sum, uint8_t, ADD)
DEFINE_SAME_KERNELS(u8_product, uint8_t, MULTIPLY)
DEFINE_SAME_KERNELS(u8_max, uint8_t, GREATER)
DEFINE_SAME_KERNELS(u8_min, uint8_t, LESSER)
DEFINE_SAME_KERNELS(u8_band, uint8_t, BIT_AND)
DEFINE_SAME_KERNELS(u8_bor, uint8_t, BIT_OR)
DEFINE_SAME_KERNELS(u8_bxor, uint8_t, BIT_XOR)
DEFINE_SAME_KERNELS(i8_max, int8_t, GREATER)
DEFINE_SAME_KERNELS(i8_min, int8_t, LESSER)
DEFINE_SAME_KERNELS(bool_any, uint8_t, EITHER)
DEFINE_SAME_KERNELS(bool_all, uint8_t, BOTH)
DEFINE_SAME_KERNELS(bool_differ, uint8_t, DIFFER)

/* buf[i] /= divisor, multiplying by the exact 1/divisor where it is a power
 * of two: see [Note: AVG divides]. */
#define DEFINE_DIVIDE(name, T)                                             \
    HOT_LOOP                                                              \
    static void name##_divide(void *buf, size_t n, int divisor)           \
    {                                                                     \
        T *restrict d = buf;                                              \
        T q = (T)divisor;                                                 \
        if (is_power_of_two(divisor)) {                                   \
            T r = (T)1 / q;                                               \
            for (size_t i = 0; i < n; i++)                                \
                d[i] *= r;                                                \
            return;                                                       \
        }                                                                 \
        for (size_t i = 0; i < n; i++)                                    \
            d[i] /= q;                                                    \
    }

DEFINE_DIVIDE(f32, float)
DEFINE_DIVIDE(f64, double)

/* What the driver needs to know of an element type besides its kernels:
 * its size and, for floating types, how to divide a block (AVG). */
typedef struct {
    size_t size;
    divide_fn divide;
} same_type;

static const same_type same_types[DPTC_DTYPE_COUNT] = {
    [DPTC_FLOAT32] = {sizeof(float), f32_divide},
    [DPTC_FLOAT64] = {sizeof(double), f64_divide},
    [DPTC_INT32] = {sizeof(int32_t), NULL},
    [DPTC_INT64] = {sizeof(int64_t), NULL},
    [DPTC_UINT8] = {sizeof(uint8_t), NULL},
    [DPTC_INT8] = {sizeof(int8_t), NULL},
    [DPTC_BOOL] = {sizeof(uint8_t), NULL},
};

typedef struct {
    combine_fn combine;
    fold_fn fold;
} same_kernels;

#define SAME(name) {name##_combine, name##_fold}

/* Indexed by [dtype][op]; bfloat16, float16, AVG and the floating types'
 * bitwise entries stay empty. */
static const same_kernels same_table[DPTC_DTYPE_COUNT][DPTC_REDOP_COUNT] = {
    [DPTC_FLOAT32] = {[DPTC_SUM] = SAME(f32_sum), [DPTC_MAX] = SAME(f32_max),
                      [DPTC_MIN] = SAME(f32_min),
                      [DPTC_PRODUCT] = SAME(f32_product)},
    [DPTC_FLOAT64] = {[DPTC_SUM] = SAME(f64_sum), [DPTC_MAX] = SAME(f64_max),
                      [DPTC_MIN] = SAME(f64_min),
                      [DPTC_PRODUCT] = SAME(f64_product)},
    [DPTC_INT32] = {[DPTC_SUM] = SAME(u32_sum), [DPTC_MAX] = SAME(i32_max),
                    [DPTC_MIN] = SAME(i32_min),
                    [DPTC_PRODUCT] = SAME(u32_product),
                    [DPTC_BAND] = SAME(u32_band), [DPTC_BOR] = SAME(u32_bor),
                    [DPTC_BXOR] = SAME(u32_bxor)},
    [DPTC_INT64] = {[DPTC_SUM] = SAME(u64_sum), [DPTC_MAX] = SAME(i64_max),
                    [DPTC_MIN] = SAME(i64_min),
                    [DPTC_PRODUCT] = SAME(u64_product),
                    [DPTC_BAND] = SAME(u64_band), [DPTC_BOR] = SAME(u64_bor),
                    [DPTC_BXOR] = SAME(u64_bxor)},
    [DPTC_UINT8] = {[DPTC_SUM] = SAME(u8_sum), [DPTC_MAX] = SAME(u8_max),
                    [DPTC_MIN] = SAME(u8_min),
                    [DPTC_PRODUCT] = SAME(u8_product),
                    [DPTC_BAND] = SAME(u8_band), [DPTC_BOR] = SAME(u8_bor),
                    [DPTC_BXOR] = SAME(u8_bxor)},
    [DPTC_INT8] = {[DPTC_SUM] = SAME(u8_sum), [DPTC_MAX] = SAME(i8_max),
                   [DPTC_MIN] = SAME(i8_min),
                   [DPTC_PRODUCT] = SAME(u8_product),
                   [DPTC_BAND] = SAME(u8_band), [DPTC_BOR] = SAME(u8_bor),
                   [DPTC_BXOR] = SAME(u8_bxor)},
    [DPTC_BOOL] = {[DPTC_SUM] = SAME(bool_any), [DPTC_MAX] = SAME(bool_any),
                   [DPTC_MIN] = SAME(bool_all),
                   [DPTC_PRODUCT] = SAME(bool_all),
                   [DPTC_BAND] = SAME(bool_all), [DPTC_BOR] = SAME(bool_any),
                   [DPTC_BXOR] = SAME(bool_differ)},
};

/* ---- kernels on bfloat16 and float16, accumulating in float32 ---- */

/* See [Note: reduction kernels].  Widening each source inside the op's
 * loop, rather than into a block of its own first, measured up to twice as
 * fast with four sources in memory (fewer passes, more streams at once). */
typedef void (*half_load_fn)(float *acc, const void *src, size_t n);
typedef void (*half_combine_fn)(float *acc, const void *a, const void *b,
                                size_t n);
typedef void (*half_fold_fn)(float *acc, const void *src, size_t n);
typedef void (*half_store_fn)(void *dst, const float *acc, size_t n,
                              int divisor);

typedef struct {
    half_load_fn load;
    half_combine_fn combine;
    half_fold_fn fold;
    half_store_fn store;
} half_kernels;

/* A format's conversions: load a block, store one divided (see [Note: AVG
 * divides]; divisor 1 for every other op) and rounded. */
#define DEFINE_HALF_FORMAT(fmt)                                            \
    HOT_LOOP                                                              \
    static void fmt##_load(float *acc, const void *src, size_t n)         \
    {                                                                     \
        float *restrict d = acc;                                          \
        const uint16_t *restrict s = src;                                 \
        for (size_t i = 0; i < n; i++)                                    \
            d[i] = fmt##_to_f32(s[i]);                                    \
    }                                                                     \
    HOT_LOOP                                                              \
    static void fmt##_store(void *dst, const float *acc, size_t n,        \
                            int divisor)                                  \
    {                                                                     \
        uint16_t *restrict d = dst;                                       \
        const float *restrict s = acc;                                    \
        float q = (float)divisor;                                         \
        if (is_power_of_two(divisor)) {                                   \
            float r = 1.0f / q;                                           \
            for (size_t i = 0; i < n; i++)                                \
                d[i] = f32_to_##fmt(s[i] * r);                            \
            return;                                                       \
        }                                                                 \
        for (size_t i = 0; i < n; i++)                                    \
            d[i] = f32_to_##fmt(s[i] / q);                                \
    }

DEFINE_HALF_FORMAT(bf16)
DEFINE_HALF_FORMAT(f16)

#define DEFINE_HALF_KERNELS(name, fmt, OP)                                 \
    HOT_LOOP                                                              \
    static void name##_combine(float *acc, const void *a, const void *b, \
                               size_t n)                                  \
    {                                                                     \
        float *restrict d = acc;                                          \
        const uint16_t *restrict x = a;                                   \
        const uint16_t *restrict y = b;                                   \
        for (size_t i = 0; i < n; i++)                                    \
            d[i] = OP(fmt##_to_f32(x[i]), fmt##_to_f32(y[i]));            \
    }                                                                     \
    HOT_LOOP                                                              \
    static void name##_fold(float *acc, const void *src, size_t n)        \
    {                                                                     \
        float *restrict d = acc;                                          \
        const uint16_t *restrict s = src;                                 \
        for (size_t i = 0; i < n; i++)                                    \
            d[i] = OP(d[i], fmt##_to_f32(s[i]));                          \
    }

DEFINE_HALF_KERNELS(bf16_sum, bf16, ADD)
DEFINE_HALF_KERNELS(bf16_max, bf16, max_f32)
DEFINE_HALF_KERNELS(bf16_min, bf16, min_f32)
DEFINE_HALF_KERNELS(bf16_product, bf16, MULTIPLY)
DEFINE_HALF_KERNELS(f16_sum, f16, ADD)
DEFINE_HALF_KERNELS(f16_max, f16, max_f32)
DEFINE_HALF_KERNELS(f16_min, f16, min_f32)
DEFINE_HALF_KERNELS(f16_product, f16, MULTIPLY)

#define HALF(fmt, name) {fmt##_load, name##_combine, name##_fold, fmt##_store}

/* Indexed by op; the AVG entries stay empty. */
static const half_kernels bf16_table[DPTC_REDOP_COUNT] = {
    [DPTC_SUM] = HALF(bf16, bf16_sum), [DPTC_MAX] = HALF(bf16, bf16_max),
    [DPTC_MIN] = HALF(bf16, bf16_min),
    [DPTC_PRODUCT] = HALF(bf16, bf16_product),
};

static const half_kernels f16_table[DPTC_REDOP_COUNT] = {
    [DPTC_SUM] = HALF(f16, f16_sum), [DPTC_MAX] = HALF(f16, f16_max),
    [DPTC_MIN] = HALF(f16, f16_min), [DPTC_PRODUCT] = HALF(f16, f16_product),
};

/* ---- float16 with F16C (x86-64) ---- */

/* The portable float16 conversions cost a dozen instructions an element;
 * F16C (every x86-64 processor since about 2012) converts eight at once,
 * rounding to nearest even exactly like them (tests/c/test_reduce.c checks
 * every pattern).  These kernels are chosen at run time, when the processor
 * has it; each does whole vectors and leaves the tail to its portable
 * twin.  Vector MAX and MIN keep the scalar semantics: maxps(a, b) is
 * a > b ? a : b, and a NaN in a is then put back. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(DPTC_REDUCE_PORTABLE)
#include <immintrin.h>
#define HAVE_F16C_KERNELS 1
#define F16C_TARGET __attribute__((target("avx,f16c")))

F16C_TARGET static inline __m256 f16c_widen(const uint16_t *src)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
}

F16C_TARGET static inline __m256 f16c_add(__m256 a, __m256 b)
{
    return _mm256_add_ps(a, b);
}

F16C_TARGET static inline __m256 f16c_multiply(__m256 a, __m256 b)
{
    return _mm256_mul_ps(a, b);
}

F16C_TARGET static inline __m256 f16c_max(__m256 a, __m256 b)
{
    __m256 a_nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_max_ps(a, b), a, a_nan);
}

F16C_TARGET static inline __m256 f16c_min(__m256 a, __m256 b)
{
    __m256 a_nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_min_ps(a, b), a, a_nan);
}

F16C_TARGET static void f16c_load(float *acc, const void *src, size_t n)
{
    const uint16_t *s = src;
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, f16c_widen(s + i));
    f16_load(acc + i, s + i, n - i);
}

F16C_TARGET static void f16c_store(void *dst, const float *acc, size_t n,
                                   int divisor)
{
    uint16_t *d = dst;
    int multiply = is_power_of_two(divisor);
    __m256 q = _mm256_set1_ps((float)divisor);
    __m256 r = _mm256_set1_ps(1.0f / (float)divisor);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(acc + i);
        x = multiply ? _mm256_mul_ps(x, r) : _mm256_div_ps(x, q);
        __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(d + i), h);
    }
    f16_store(d + i, acc + i, n - i, divisor);
}

#define DEFINE_F16C_KERNELS(name, VOP)                                     \
    F16C_TARGET static void f16c_##name##_combine(float *acc,             \
                                                  const void *a,          \
                                                  const void *b, size_t n) \
    {                                                                     \
        const uint16_t *x = a, *y = b;                                    \
        size_t i = 0;                                                     \
        for (; i + 8 <= n; i += 8)                                        \
            _mm256_storeu_ps(acc + i, VOP(f16c_widen(x + i),              \
                                          f16c_widen(y + i)));            \
        f16_##name##_combine(acc + i, x + i, y + i, n - i);               \
    }                                                                     \
    F16C_TARGET static void f16c_##name##_fold(float *acc,                \
                                               const void *src, size_t n) \
    {                                                                     \
        const uint16_t *s = src;                                          \
        size_t i = 0;                                                     \
        for (; i + 8 <= n; i += 8)                                        \
            _mm256_storeu_ps(acc + i, VOP(_mm256_loadu_ps(acc + i),       \
                                          f16c_widen(s + i)));            \
        f16_##name##_fold(acc + i, s + i, n - i);                         \
    }

DEFINE_F16C_KERNELS(sum, f16c_add)
DEFINE_F16C_KERNELS(max, f16c_max)
DEFINE_F16C_KERNELS(min, f16c_min)
DEFINE_F16C_KERNELS(product, f16c_multiply)

#define F16C(name) \
    {f16c_load, f16c_##name##_combine, f16c_##name##_fold, f16c_store}

static const half_kernels f16c_table[DPTC_REDOP_COUNT] = {
    [DPTC_SUM] = F16C(sum), [DPTC_MAX] = F16C(max), [DPTC_MIN] = F16C(min),
    [DPTC_PRODUCT] = F16C(product),
};
#endif

/* The kernels of a bfloat16 or float16 op on this processor. */
static const half_kernels *half_kernels_for(dptc_dtype dtype, dptc_redop op)
{
    if (dtype == DPTC_BFLOAT16)
        return &bf16_table[op];
#ifdef HAVE_F16C_KERNELS
    if (__builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c"))
        return &f16c_table[op];
#endif
    return &f16_table[op];
}

/* ---- drivers ---- */

static const void *source_at(const void *src, size_t byte_offset)
{
    return (const char *)src + byte_offset;
}

/* Where every block of one reduction is built.
 * See [Note: reduction kernels] for why it matters. */
typedef enum {
    SITE_DST,       /* dst is no source: dst = s0 op s1, then fold the rest */
    SITE_FIRST,     /* dst is srcs[0] and no other: fold srcs[1..] into it */
    SITE_SECOND,    /* nsrc == 2, dst is srcs[1] only: fold srcs[0] into it
                     * (every op commutes, so the result is the same) */
    SITE_SCRATCH,   /* dst is a later source: build on the stack, copy out */
} block_site;

static block_site choose_block_site(const void *dst, const void *const *srcs,
                                    int nsrc)
{
    int matches = 0, last_match = -1;
    for (int k = 0; k < nsrc; k++) {
        if (srcs[k] == dst) {
            matches++;
            last_match = k;
        }
    }
    if (matches == 0)
        return SITE_DST;
    if (matches == 1 && last_match == 0)
        return SITE_FIRST;
    if (matches == 1 && last_match == 1 && nsrc == 2)
        return SITE_SECOND;
    return SITE_SCRATCH;
}

/* Reduces n elements at byte_offset of every source into target. */
static void build_same_block(const same_kernels *k, block_site site,
                             void *target, const void *const *srcs, int nsrc,
                             size_t byte_offset, size_t n, size_t size)
{
    int next = 1;
    if (site == SITE_SECOND) {
        k->fold(target, source_at(srcs[0], byte_offset), n);
        return;
    }
    if (site != SITE_FIRST) {
        if (nsrc == 1) {
            memcpy(target, source_at(srcs[0], byte_offset), n * size);
            return;
        }
        k->combine(target, source_at(srcs[0], byte_offset),
                   source_at(srcs[1], byte_offset), n);
        next = 2;
    }
    for (int s = next; s < nsrc; s++)
        k->fold(target, source_at(srcs[s], byte_offset), n);
}

/* divisor != 1 only for floating types (checked by dptc_reduce). */
static void reduce_same(const same_type *type, const same_kernels *k,
                        void *dst, const void *const *srcs, int nsrc,
                        size_t count, int divisor)
{
    block_buffer scratch;
    block_site site = choose_block_site(dst, srcs, nsrc);
    size_t size = type->size;
    size_t per_block = BLOCK_BYTES / size;
    for (size_t start = 0; start < count; start += per_block) {
        size_t n = count - start < per_block ? count - start : per_block;
        size_t byte_offset = start * size;
        char *out = (char *)dst + byte_offset;
        void *target = site == SITE_SCRATCH ? (void *)&scratch : out;
        build_same_block(k, site, target, srcs, nsrc, byte_offset, n, size);
        if (divisor != 1)
            type->divide(target, n, divisor);
        if (site == SITE_SCRATCH)
            memcpy(out, target, n * size);
    }
}

/* bfloat16 and float16: every block is built in float32 on the stack and
 * stored into dst last, so dst may alias any source. */
static void reduce_half(const half_kernels *k, void *dst,
                        const void *const *srcs, int nsrc, size_t count,
                        int divisor)
{
    float acc[BLOCK_BYTES / sizeof(float)];
    size_t per_block = BLOCK_BYTES / sizeof(float);
    for (size_t start = 0; start < count; start += per_block) {
        size_t n = count - start < per_block ? count - start : per_block;
        size_t byte_offset = start * sizeof(uint16_t);
        if (nsrc == 1)
            k->load(acc, source_at(srcs[0], byte_offset), n);
        else
            k->combine(acc, source_at(srcs[0], byte_offset),
                       source_at(srcs[1], byte_offset), n);
        for (int s = 2; s < nsrc; s++)
            k->fold(acc, source_at(srcs[s], byte_offset), n);
        k->store((char *)dst + byte_offset, acc, n, divisor);
    }
}

static void divide_half(const half_kernels *k, void *buf, size_t count,
                        int divisor)
{
    float block[BLOCK_BYTES / sizeof(float)];
    size_t per_block = BLOCK_BYTES / sizeof(float);
    for (size_t start = 0; start < count; start += per_block) {
        size_t n = count - start < per_block ? count - start : per_block;
        char *at = (char *)buf + start * sizeof(uint16_t);
        k->load(block, at, n);
        k->store(at, block, n, divisor);
    }
}

/* ---- entry points ---- */

static bool is_valid_dtype(dptc_dtype dtype)
{
    return (unsigned)dtype < DPTC_DTYPE_COUNT;
}

static bool is_floating(dptc_dtype dtype)
{
    return dtype == DPTC_FLOAT32 || dtype == DPTC_FLOAT64
           || dtype == DPTC_BFLOAT16 || dtype == DPTC_FLOAT16;
}

static bool is_bitwise(dptc_redop op)
{
    return op == DPTC_BAND || op == DPTC_BOR || op == DPTC_BXOR;
}

static bool is_valid_redop(dptc_redop op)
{
    return op == DPTC_SUM || op == DPTC_MAX || op == DPTC_MIN
           || op == DPTC_PRODUCT || is_bitwise(op);
}

static bool has_null_buffer(const void *dst, const void *const *srcs,
                            int nsrc)
{
    if (dst == NULL || srcs == NULL)
        return true;
    for (int k = 0; k < nsrc; k++) {
        if (srcs[k] == NULL)
            return true;
    }
    return false;
}

dptc_status dptc_reduce(void *dst, const void *const *srcs, int nsrc,
                        size_t count, dptc_dtype dtype, dptc_redop op,
                        int divisor, dptc_error *err)
{
    if (!is_valid_dtype(dtype))
        return dptc_fail(err, DPTC_ERR_INVALID, "reduce: dtype code %d is not a dtype",
                         (int)dtype);
    if (!is_valid_redop(op))
        return dptc_fail(err, DPTC_ERR_INVALID,
                         "reduce of %s: op %s (code %d) is not one the kernels run "
                         "(AVG arrives as SUM with divisor n)",
                         dptc_dtype_name(dtype), dptc_redop_name(op), (int)op);
    if (is_bitwise(op) && is_floating(dtype))
        return dptc_fail(err, DPTC_ERR_INVALID,
                         "reduce %s of %s: bitwise ops need an integer or bool dtype",
                         dptc_redop_name(op), dptc_dtype_name(dtype));
    if (nsrc < 1)
        return dptc_fail(err, DPTC_ERR_INVALID, "reduce %s of %s: needs a source, got nsrc %d",
                         dptc_redop_name(op), dptc_dtype_name(dtype), nsrc);
    if (divisor < 1 || (divisor != 1 && !is_floating(dtype)))
        return dptc_fail(err, DPTC_ERR_INVALID,
                         "reduce %s of %s: divisor %d must be 1 for integer dtypes and >= 1 "
                         "for floating ones", dptc_redop_name(op), dptc_dtype_name(dtype),
                         divisor);
    if (count == 0)
        return DPTC_OK;
    if (has_null_buffer(dst, srcs, nsrc))
        return dptc_fail(err, DPTC_ERR_INVALID, "reduce %s of %zu %s elements: a buffer is NULL",
                         dptc_redop_name(op), count, dptc_dtype_name(dtype));
    if (dtype == DPTC_BFLOAT16 || dtype == DPTC_FLOAT16) {
        reduce_half(half_kernels_for(dtype, op), dst, srcs, nsrc, count,
                    divisor);
        return DPTC_OK;
    }
    reduce_same(&same_types[dtype], &same_table[dtype][op], dst, srcs, nsrc,
                count, divisor);
    return DPTC_OK;
}

dptc_status dptc_divide(void *buf, size_t count, dptc_dtype dtype,
                        int divisor, dptc_error *err)
{
    if (!is_valid_dtype(dtype) || !is_floating(dtype))
        return dptc_fail(err, DPTC_ERR_INVALID,
                         "divide by %d: %s (code %d) is not a floating dtype", divisor,
                         dptc_dtype_name(dtype), (int)dtype);
    if (divisor < 1)
        return dptc_fail(err, DPTC_ERR_INVALID, "divide %s by %d: the divisor must be >= 1",
                         dptc_dtype_name(dtype), divisor);
    if (count == 0 || divisor == 1)
        return DPTC_OK;
    if (buf == NULL)
        return dptc_fail(err, DPTC_ERR_INVALID, "divide %zu %s elements by %d: buffer is NULL",
                         count, dptc_dtype_name(dtype), divisor);
    switch (dtype) {
    case DPTC_FLOAT32:
        f32_divide(buf, count, divisor);
        break;
    case DPTC_FLOAT64:
        f64_divide(buf, count, divisor);
        break;
    default:
        divide_half(half_kernels_for(dtype, DPTC_SUM), buf, count, divisor);
        break;
    }
    return DPTC_OK;
}

/* ---- conversions (DDP's compression hooks) ---- */

static int is_wide(dptc_dtype t) { return t == DPTC_FLOAT32 || t == DPTC_FLOAT64; }

static int is_half(dptc_dtype t) { return t == DPTC_BFLOAT16 || t == DPTC_FLOAT16; }

static float wide_at(const void *src, dptc_dtype t, size_t i)
{
    return t == DPTC_FLOAT32 ? ((const float *)src)[i] : (float)((const double *)src)[i];
}

dptc_status dptc_convert(void *dst, dptc_dtype dst_dtype, const void *src, dptc_dtype src_dtype,
                         size_t count, dptc_error *err)
{
    if (is_wide(src_dtype) && is_half(dst_dtype)) {
        uint16_t *out = dst;
        if (dst_dtype == DPTC_BFLOAT16)
            for (size_t i = 0; i < count; i++)
                out[i] = f32_to_bf16(wide_at(src, src_dtype, i));
        else
            for (size_t i = 0; i < count; i++)
                out[i] = f32_to_f16(wide_at(src, src_dtype, i));
        return DPTC_OK;
    }
    if (is_half(src_dtype) && is_wide(dst_dtype)) {
        const uint16_t *in = src;
        for (size_t i = 0; i < count; i++) {
            float value = src_dtype == DPTC_BFLOAT16 ? bf16_to_f32(in[i]) : f16_to_f32(in[i]);
            if (dst_dtype == DPTC_FLOAT32)
                ((float *)dst)[i] = value;
            else
                ((double *)dst)[i] = value;
        }
        return DPTC_OK;
    }
    return dptc_fail(err, DPTC_ERR_INVALID,
                     "convert %s to %s: only float32 or float64 to or from bfloat16 or float16",
                     dptc_dtype_name(src_dtype), dptc_dtype_name(dst_dtype));
}
