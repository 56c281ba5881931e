/* test_reduce.c — dptc_reduce and dptc_divide against references computed
 * in double precision, and the refusals of all three entry points.
 *
 * Built from this file, csrc/kernels.c and csrc/common.c (for dptc_fail and
 * the dtype names) alone, and run, by
 * tests/test_reduce_kernels.py.  Exits 0 when every check passes; prints the
 * first failures in full and a summary otherwise.
 *
 * References:
 * - floating types accumulate in double and round to float32 after every
 *   step (float64: stay in double).  double carries more than 2 * 24 + 2
 *   bits, so this equals float32 arithmetic exactly, and the comparison is
 *   exact;
 * - bfloat16 and float16 round that float32 result with an independent
 *   frexp/nearbyint rounding (ties to even) and compare values exactly;
 * - integers wrap in uint64_t (SUM, PRODUCT) or compare as int64_t (MAX,
 *   MIN), then keep the element's width: an exact integer reference, which
 *   double could not be for int64.  BAND, BOR and BXOR combine the raw bits
 *   (bool: the truth values, so the result is 0 or 1).
 */
#include "kernels.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SOURCES 4
#define GUARD_BYTES 64
#define GUARD_BYTE 0xa5
#define MAX_REPORTS 20

static long failures;
static long cases_run;
static long elements_checked;

/* ---- random numbers: xorshift64*, fixed seed so failures reproduce ---- */

static uint64_t random_state = 0x9e3779b97f4a7c15u;

static uint64_t next_random(void)
{
    random_state ^= random_state >> 12;
    random_state ^= random_state << 25;
    random_state ^= random_state >> 27;
    return random_state * 0x2545f4914f6cdd1du;
}

/* ---- dtypes ---- */

typedef struct {
    const char *name;
    size_t size;
    bool floating;
    bool is_signed;
} dtype_info;

static const dtype_info dtypes[DPTC_DTYPE_COUNT] = {
    [DPTC_FLOAT32] = {"float32", 4, true, true},
    [DPTC_FLOAT64] = {"float64", 8, true, true},
    [DPTC_BFLOAT16] = {"bfloat16", 2, true, true},
    [DPTC_FLOAT16] = {"float16", 2, true, true},
    [DPTC_INT32] = {"int32", 4, false, true},
    [DPTC_INT64] = {"int64", 8, false, true},
    [DPTC_UINT8] = {"uint8", 1, false, false},
    [DPTC_INT8] = {"int8", 1, false, true},
    [DPTC_BOOL] = {"bool", 1, false, false},
};

static const char *const op_names[DPTC_REDOP_COUNT] = {
    [DPTC_SUM] = "SUM", [DPTC_AVG] = "AVG", [DPTC_MAX] = "MAX",
    [DPTC_MIN] = "MIN", [DPTC_PRODUCT] = "PRODUCT", [DPTC_BAND] = "BAND",
    [DPTC_BOR] = "BOR", [DPTC_BXOR] = "BXOR",
};

/* ---- reading elements, independently of kernels.c ---- */

/* The raw bits of element i, zero-extended. */
static uint64_t load_raw(dptc_dtype dtype, const void *buf, size_t i)
{
    size_t size = dtypes[dtype].size;
    const unsigned char *p = (const unsigned char *)buf + i * size;
    uint8_t u8;
    uint16_t u16;
    uint32_t u32;
    uint64_t u64;
    switch (size) {
    case 1:
        memcpy(&u8, p, 1);
        return u8;
    case 2:
        memcpy(&u16, p, 2);
        return u16;
    case 4:
        memcpy(&u32, p, 4);
        return u32;
    default:
        memcpy(&u64, p, 8);
        return u64;
    }
}

/* A binary floating value from its fields: mantissa_bits stored bits,
 * exponent_bits of exponent with the IEEE bias. */
static double decode_float_bits(uint64_t bits, int exponent_bits,
                                int mantissa_bits)
{
    int bias = (1 << (exponent_bits - 1)) - 1;
    int exponent_max = (1 << exponent_bits) - 1;
    uint64_t mantissa = bits & ((1u << mantissa_bits) - 1);
    int exponent = (int)((bits >> mantissa_bits) & (unsigned)exponent_max);
    double sign = (bits >> (mantissa_bits + exponent_bits)) & 1 ? -1.0 : 1.0;
    if (exponent == exponent_max)
        return mantissa != 0 ? NAN : sign * INFINITY;
    if (exponent == 0)
        return sign * ldexp((double)mantissa, 1 - bias - mantissa_bits);
    return sign * ldexp((double)(mantissa | (1u << mantissa_bits)),
                        exponent - bias - mantissa_bits);
}

static double load_float(dptc_dtype dtype, const void *buf, size_t i)
{
    uint64_t bits = load_raw(dtype, buf, i);
    float f32;
    double f64;
    switch (dtype) {
    case DPTC_FLOAT32:
        memcpy(&f32, (const char *)buf + 4 * i, 4);
        return f32;
    case DPTC_FLOAT64:
        memcpy(&f64, (const char *)buf + 8 * i, 8);
        return f64;
    case DPTC_BFLOAT16:
        return decode_float_bits(bits, 8, 7);
    default:
        return decode_float_bits(bits, 5, 10);
    }
}

/* Element i as an integer: sign-extended for signed types. */
static int64_t load_int(dptc_dtype dtype, const void *buf, size_t i)
{
    const unsigned char *p = (const unsigned char *)buf
                             + i * dtypes[dtype].size;
    int8_t i8;
    int32_t i32;
    int64_t i64;
    switch (dtype) {
    case DPTC_INT8:
        memcpy(&i8, p, sizeof i8);
        return i8;
    case DPTC_INT32:
        memcpy(&i32, p, sizeof i32);
        return i32;
    case DPTC_INT64:
        memcpy(&i64, p, sizeof i64);
        return i64;
    default:
        return (int64_t)load_raw(dtype, buf, i);
    }
}

/* ---- references ---- */

/* x rounded to nearest even into a binary format of `precision` bits
 * (implicit bit included) whose smallest step is 2^min_step_exponent;
 * overflow gives infinity. */
static double round_to_format(double x, int precision, int min_step_exponent,
                              double max_finite)
{
    if (isnan(x) || isinf(x) || x == 0.0)
        return x;
    int exponent;
    frexp(x, &exponent);
    int step_exponent = exponent - precision;
    if (step_exponent < min_step_exponent)
        step_exponent = min_step_exponent;
    double steps = nearbyint(ldexp(x, -step_exponent));
    double rounded = ldexp(steps, step_exponent);
    if (fabs(rounded) > max_finite)
        return copysign(INFINITY, x);
    return copysign(rounded, x);
}

static double round_to_dtype(dptc_dtype dtype, double x)
{
    switch (dtype) {
    case DPTC_FLOAT64:
        return x;
    case DPTC_FLOAT32:
        return (float)x;
    case DPTC_BFLOAT16:
        return round_to_format(x, 8, -133, ldexp(255.0, 120));
    default:
        return round_to_format(x, 11, -24, 65504.0);
    }
}

static double combine_float(dptc_redop op, double a, double b)
{
    if ((op == DPTC_MAX || op == DPTC_MIN) && (isnan(a) || isnan(b)))
        return NAN;
    switch (op) {
    case DPTC_SUM:
        return a + b;
    case DPTC_PRODUCT:
        return a * b;
    case DPTC_MAX:
        return a > b ? a : b;
    default:
        return a < b ? a : b;
    }
}

static uint64_t width_mask(dptc_dtype dtype)
{
    size_t size = dtypes[dtype].size;
    return size == 8 ? UINT64_MAX : (1ull << (8 * size)) - 1;
}

/* A reduction's inputs: the original contents of every source. */
typedef struct {
    dptc_dtype dtype;
    dptc_redop op;
    int divisor;
    int nsrc;
    const void *sources[MAX_SOURCES];
} reduction;

/* The expected value of element i: float32 accumulation (float64 stays in
 * double), divided in the accumulation type, rounded once to the dtype. */
static double reference_float(const reduction *r, size_t i)
{
    bool wide = r->dtype == DPTC_FLOAT64;
    double acc = load_float(r->dtype, r->sources[0], i);
    for (int k = 1; k < r->nsrc; k++) {
        acc = combine_float(r->op, acc, load_float(r->dtype, r->sources[k], i));
        acc = wide ? acc : (float)acc;
    }
    if (r->divisor != 1)
        acc = wide ? acc / r->divisor : (float)((float)acc / (float)r->divisor);
    return round_to_dtype(r->dtype, acc);
}

static bool is_bitwise(dptc_redop op)
{
    return op == DPTC_BAND || op == DPTC_BOR || op == DPTC_BXOR;
}

/* The expected raw bits of element i of a BAND, BOR or BXOR. */
static uint64_t reference_bitwise(const reduction *r, size_t i)
{
    bool boolean = r->dtype == DPTC_BOOL;
    uint64_t acc = load_raw(r->dtype, r->sources[0], i);
    acc = boolean ? acc != 0 : acc;
    for (int k = 1; k < r->nsrc; k++) {
        uint64_t x = load_raw(r->dtype, r->sources[k], i);
        x = boolean ? x != 0 : x;
        acc = r->op == DPTC_BAND ? acc & x : r->op == DPTC_BOR ? acc | x : acc ^ x;
    }
    return acc & width_mask(r->dtype);
}

/* The expected raw bits of element i of an integer or bool reduction. */
static uint64_t reference_int(const reduction *r, size_t i)
{
    if (is_bitwise(r->op))
        return reference_bitwise(r, i);
    bool any = r->op == DPTC_SUM || r->op == DPTC_MAX;
    int64_t ordered = load_int(r->dtype, r->sources[0], i);
    uint64_t wrapped = (uint64_t)ordered;
    for (int k = 1; k < r->nsrc; k++) {
        int64_t x = load_int(r->dtype, r->sources[k], i);
        if (r->dtype == DPTC_BOOL)
            ordered = any ? (ordered != 0 || x != 0) : (ordered != 0 && x != 0);
        else if (r->op == DPTC_MAX)
            ordered = x > ordered ? x : ordered;
        else if (r->op == DPTC_MIN)
            ordered = x < ordered ? x : ordered;
        else if (r->op == DPTC_SUM)
            wrapped += (uint64_t)x;
        else
            wrapped *= (uint64_t)x;
    }
    if (r->dtype == DPTC_BOOL && r->nsrc == 1)
        return (uint64_t)ordered;
    bool wraps = r->dtype != DPTC_BOOL
                 && (r->op == DPTC_SUM || r->op == DPTC_PRODUCT);
    return (wraps ? wrapped : (uint64_t)ordered) & width_mask(r->dtype);
}

/* Equal values, or both NaN.  The sign of zero counts except for MAX and
 * MIN, whose choice between +0 and -0 is unspecified. */
static bool same_float(double expected, double got, dptc_redop op)
{
    if (isnan(expected) || isnan(got))
        return isnan(expected) && isnan(got);
    if (expected != got)
        return false;
    return op == DPTC_MAX || op == DPTC_MIN
           || signbit(expected) == signbit(got);
}

/* ---- reporting ---- */

static void report(const char *what, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void report(const char *what, const char *fmt, ...)
{
    failures++;
    if (failures > MAX_REPORTS)
        return;
    va_list args;
    va_start(args, fmt);
    printf("FAIL %s: ", what);
    vprintf(fmt, args);
    printf("\n");
    va_end(args);
}

static void describe(char *out, size_t size, const reduction *r, size_t count,
                     const char *placement)
{
    snprintf(out, size, "%s %s divisor=%d nsrc=%d count=%zu %s",
             dtypes[r->dtype].name, op_names[r->op], r->divisor, r->nsrc,
             count, placement);
}

static void report_element(const char *what, const reduction *r, size_t i,
                           const void *dst)
{
    char inputs[256] = "";
    size_t used = 0;
    for (int k = 0; k < r->nsrc && used < sizeof inputs; k++) {
        double v = dtypes[r->dtype].floating
                       ? load_float(r->dtype, r->sources[k], i)
                       : (double)load_int(r->dtype, r->sources[k], i);
        used += (size_t)snprintf(inputs + used, sizeof inputs - used, " %.17g",
                                 v);
    }
    if (dtypes[r->dtype].floating)
        report(what, "[%zu] expected %.17g got %.17g (bits %#llx); inputs%s",
               i, reference_float(r, i), load_float(r->dtype, dst, i),
               (unsigned long long)load_raw(r->dtype, dst, i), inputs);
    else
        report(what, "[%zu] expected %#llx got %#llx; inputs%s", i,
               (unsigned long long)reference_int(r, i),
               (unsigned long long)load_raw(r->dtype, dst, i), inputs);
}

/* Compares dst with the reference; reports the first bad element. */
static void check_elements(const char *what, const reduction *r,
                           const void *dst, size_t count)
{
    bool floating = dtypes[r->dtype].floating;
    for (size_t i = 0; i < count; i++) {
        bool ok = floating
                      ? same_float(reference_float(r, i),
                                   load_float(r->dtype, dst, i), r->op)
                      : reference_int(r, i) == load_raw(r->dtype, dst, i);
        elements_checked++;
        if (!ok) {
            report_element(what, r, i, dst);
            return;
        }
    }
}

/* ---- buffers ---- */

static double random_double(void)
{
    static const double specials[] = {
        NAN, -NAN, INFINITY, -INFINITY, 0.0, -0.0, FLT_MAX, -FLT_MAX,
        1e-45, 1e-39, -1e-40, DBL_MAX, 5e-324, 65504.0, 1e-7, 6e-8,
    };
    uint64_t r = next_random();
    if (r % 32 == 0)
        return specials[(r >> 8) % (sizeof specials / sizeof specials[0])];
    double mantissa = 1.0 + (double)(r >> 11) * 0x1p-53;
    int exponent = (int)((r >> 5) % 21) - 10;
    return ldexp(r & 16 ? -mantissa : mantissa, exponent);
}

/* Half the time any bit pattern, a quarter of the time a value near 1 whose
 * sums and products round often (and often tie), otherwise a tiny value
 * (subnormal or just above) whose results round in the subnormal range. */
static uint16_t random_half_bits(int exponent_bits, int mantissa_bits,
                                 int exponent_low, int exponent_span)
{
    uint64_t r = next_random();
    if (r & 1)
        return (uint16_t)(r >> 8);
    uint64_t sign = (r >> 16) & 1;
    uint64_t low = r & 2 ? (uint64_t)exponent_low : 0;
    uint64_t span = r & 2 ? (unsigned)exponent_span : 3;
    uint64_t exponent = low + (r >> 17) % span;
    uint64_t mantissa = (r >> 24) & ((1u << mantissa_bits) - 1);
    return (uint16_t)(sign << (exponent_bits + mantissa_bits)
                      | exponent << mantissa_bits | mantissa);
}

static void fill_random(dptc_dtype dtype, void *buf, size_t count)
{
    unsigned char *p = buf;
    for (size_t i = 0; i < count; i++) {
        float f32 = (float)random_double();
        double f64 = random_double();
        uint16_t half = dtype == DPTC_BFLOAT16
                            ? random_half_bits(8, 7, 122, 10)
                            : random_half_bits(5, 10, 10, 10);
        uint64_t bits = next_random();
        uint8_t flag = (uint8_t)(bits & 1);
        size_t size = dtypes[dtype].size;
        if (dtype == DPTC_FLOAT32)
            memcpy(p + i * size, &f32, size);
        else if (dtype == DPTC_FLOAT64)
            memcpy(p + i * size, &f64, size);
        else if (dtype == DPTC_BFLOAT16 || dtype == DPTC_FLOAT16)
            memcpy(p + i * size, &half, size);
        else if (dtype == DPTC_BOOL)
            memcpy(p + i * size, &flag, size);
        else
            memcpy(p + i * size, &bits, size);  /* little-endian low bytes */
    }
}

/* A buffer of `bytes` followed by GUARD_BYTES of GUARD_BYTE. */
static unsigned char *guarded_alloc(size_t bytes)
{
    unsigned char *p = malloc(bytes + GUARD_BYTES);
    if (p == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    memset(p, GUARD_BYTE, bytes + GUARD_BYTES);
    return p;
}

static bool guard_intact(const unsigned char *p, size_t bytes)
{
    for (size_t i = 0; i < GUARD_BYTES; i++) {
        if (p[bytes + i] != GUARD_BYTE)
            return false;
    }
    return true;
}

/* ---- reductions ---- */

/* How a case lays its buffers out: source k is buffer source_buffer[k];
 * dst is buffer dst_buffer, or a buffer of its own when dst_buffer < 0. */
typedef struct {
    const char *name;
    int nsrc;
    int source_buffer[MAX_SOURCES];
    int dst_buffer;
} layout;

typedef struct {
    dptc_dtype dtype;
    dptc_redop op;
    int divisor;
    size_t count;
} reduce_case;

static int buffer_count(const layout *l)
{
    int n = 0;
    for (int k = 0; k < l->nsrc; k++) {
        if (l->source_buffer[k] + 1 > n)
            n = l->source_buffer[k] + 1;
    }
    return n;
}

/* Source buffers left alone by the call must still hold their input. */
static void check_buffers(const char *what, unsigned char *const *buffers,
                          unsigned char *const *originals, int nbuffers,
                          const unsigned char *dst, size_t bytes)
{
    for (int b = 0; b < nbuffers; b++) {
        if (!guard_intact(buffers[b], bytes))
            report(what, "wrote past the end of buffer %d", b);
        if (buffers[b] != dst && memcmp(buffers[b], originals[b], bytes) != 0)
            report(what, "changed source buffer %d, which is not dst", b);
    }
    if (!guard_intact(dst, bytes))
        report(what, "wrote past the end of dst");
}

static void run_reduce_case(const reduce_case *c, const layout *l)
{
    size_t bytes = c->count * dtypes[c->dtype].size;
    int nbuffers = buffer_count(l);
    unsigned char *originals[MAX_SOURCES], *buffers[MAX_SOURCES];
    for (int b = 0; b < nbuffers; b++) {
        originals[b] = guarded_alloc(bytes);
        fill_random(c->dtype, originals[b], c->count);
        buffers[b] = guarded_alloc(bytes);
        memcpy(buffers[b], originals[b], bytes);
    }
    unsigned char *own_dst = l->dst_buffer < 0 ? guarded_alloc(bytes) : NULL;
    unsigned char *dst = own_dst != NULL ? own_dst : buffers[l->dst_buffer];
    const void *srcs[MAX_SOURCES];
    reduction r = {c->dtype, c->op, c->divisor, l->nsrc, {NULL}};
    for (int k = 0; k < l->nsrc; k++) {
        srcs[k] = buffers[l->source_buffer[k]];
        r.sources[k] = originals[l->source_buffer[k]];
    }
    char what[160];
    describe(what, sizeof what, &r, c->count, l->name);
    dptc_error err = {""};
    dptc_status status = dptc_reduce(dst, srcs, l->nsrc, c->count, c->dtype,
                                     c->op, c->divisor, &err);
    if (status != DPTC_OK)
        report(what, "returned status %d: %s", (int)status, err.message);
    else
        check_elements(what, &r, dst, c->count);
    check_buffers(what, buffers, originals, nbuffers, dst, bytes);
    cases_run++;
    for (int b = 0; b < nbuffers; b++) {
        free(originals[b]);
        free(buffers[b]);
    }
    free(own_dst);
}

/* Out of place, dst = srcs[0] and dst = srcs[last], for nsrc sources. */
static void standard_layouts(int nsrc, layout out[3])
{
    static const char *const names[3] = {"out-of-place", "dst=srcs[0]",
                                         "dst=srcs[last]"};
    static const int dst_buffer_of[3] = {-1, 0, -2};
    for (int p = 0; p < 3; p++) {
        out[p].name = names[p];
        out[p].nsrc = nsrc;
        for (int k = 0; k < nsrc; k++)
            out[p].source_buffer[k] = k;
        out[p].dst_buffer = dst_buffer_of[p] == -2 ? nsrc - 1
                                                   : dst_buffer_of[p];
    }
}

static void test_all_reductions(void)
{
    /* 20011 spans two whole BLOCK_BYTES blocks (8192 B) of the narrowest
     * dtype and more of the wider ones, then a ragged tail. */
    static const size_t counts[] = {0, 1, 7, 1000, 20011};
    static const dptc_redop ops[] = {DPTC_SUM, DPTC_MAX, DPTC_MIN,
                                     DPTC_PRODUCT, DPTC_AVG, DPTC_BAND,
                                     DPTC_BOR, DPTC_BXOR};
    for (int dtype = 0; dtype < DPTC_DTYPE_COUNT; dtype++) {
        for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
            bool average = ops[o] == DPTC_AVG;
            if (average && !dtypes[dtype].floating)
                continue;
            if (is_bitwise(ops[o]) && dtypes[dtype].floating)
                continue;   /* refused: test_invalid_reduce */
            for (int nsrc = 1; nsrc <= MAX_SOURCES; nsrc++) {
                layout layouts[3];
                standard_layouts(nsrc, layouts);
                for (size_t n = 0; n < sizeof counts / sizeof counts[0]; n++) {
                    /* AVG is SUM divided by n, as callers pass it. */
                    reduce_case c = {(dptc_dtype)dtype,
                                     average ? DPTC_SUM : ops[o],
                                     average ? nsrc : 1, counts[n]};
                    for (int p = 0; p < 3; p++)
                        run_reduce_case(&c, &layouts[p]);
                }
            }
        }
    }
}

/* dst aliasing a middle source, and one buffer passed as two sources. */
static void test_unusual_layouts(void)
{
    static const layout layouts[] = {
        {"dst=srcs[1] of 3", 3, {0, 1, 2}, 1},
        {"srcs={a,a}, dst=a", 2, {0, 0}, 0},
        {"srcs={a,a}, dst apart", 2, {0, 0}, -1},
        {"srcs={a,a,b}, dst=a", 3, {0, 0, 1}, 0},
        {"srcs={a,b,a}, dst=b", 3, {0, 1, 0}, 1},
        {"srcs={a,b,b,c}, dst=b", 4, {0, 1, 1, 2}, 1},
    };
    static const dptc_dtype types[] = {DPTC_FLOAT32, DPTC_BFLOAT16,
                                       DPTC_INT64, DPTC_BOOL};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++) {
            reduce_case c = {types[t], DPTC_SUM, 1, 10007};
            run_reduce_case(&c, &layouts[l]);
            c.op = DPTC_MAX;
            run_reduce_case(&c, &layouts[l]);
            if (dtypes[types[t]].floating)
                continue;
            c.op = DPTC_BXOR;
            run_reduce_case(&c, &layouts[l]);
        }
    }
}

/* ---- conversions and dptc_divide ---- */

/* Every bfloat16/float16 pattern survives a one-source reduction
 * (NaN stays NaN). */
static void test_half_round_trip(dptc_dtype dtype)
{
    static uint16_t in[65536], out[65536];
    for (size_t i = 0; i < 65536; i++)
        in[i] = (uint16_t)i;
    const void *srcs[1] = {in};
    dptc_status status = dptc_reduce(out, srcs, 1, 65536, dtype, DPTC_SUM, 1,
                                     NULL);
    if (status != DPTC_OK)
        report(dtypes[dtype].name, "round trip returned status %d",
               (int)status);
    for (size_t i = 0; status == DPTC_OK && i < 65536; i++) {
        bool nan = isnan(load_float(dtype, in, i));
        bool ok = nan ? isnan(load_float(dtype, out, i)) : out[i] == in[i];
        if (!ok) {
            report(dtypes[dtype].name, "round trip of %#zx gave %#x", i,
                   out[i]);
            break;
        }
    }
    elements_checked += 65536;
}

/* Every bfloat16/float16 pattern divided by each divisor: float32
 * quotient, one rounding (see [Note: AVG divides] in kernels.c). */
static void test_half_divide(dptc_dtype dtype)
{
    static const int divisors[] = {2, 3, 4, 5, 6, 7, 8, 1000, 1024};
    static uint16_t patterns[65536], buf[65536];
    for (size_t i = 0; i < 65536; i++)
        patterns[i] = (uint16_t)i;
    for (size_t s = 0; s < sizeof divisors / sizeof divisors[0]; s++) {
        memcpy(buf, patterns, sizeof buf);
        dptc_status status = dptc_divide(buf, 65536, dtype, divisors[s], NULL);
        if (status != DPTC_OK)
            report(dtypes[dtype].name, "dptc_divide returned status %d",
                   (int)status);
        for (size_t i = 0; status == DPTC_OK && i < 65536; i++) {
            double x = load_float(dtype, patterns, i);
            double expected = round_to_dtype(
                dtype, (float)((float)x / (float)divisors[s]));
            double got = load_float(dtype, buf, i);
            if (!same_float(expected, got, DPTC_SUM)) {
                report(dtypes[dtype].name,
                       "divide by %d of %#zx: expected %.17g got %.17g (%#x)",
                       divisors[s], i, expected, got, buf[i]);
                break;
            }
        }
        elements_checked += 65536;
    }
}

/* float32 and float64 divided by divisors that are powers of two (where the
 * kernels multiply by the exact reciprocal) and that are not (where they
 * divide): both must give the correctly rounded quotient. */
static void test_float_divide(dptc_dtype dtype)
{
    static const int divisors[] = {2, 3, 4, 5, 7, 8, 12};
    size_t count = 10007, bytes = count * dtypes[dtype].size;
    unsigned char *original = guarded_alloc(bytes);
    unsigned char *buf = guarded_alloc(bytes);
    fill_random(dtype, original, count);
    for (size_t d = 0; d < sizeof divisors / sizeof divisors[0]; d++) {
        memcpy(buf, original, bytes);
        reduction r = {dtype, DPTC_SUM, divisors[d], 1, {original}};
        dptc_status status = dptc_divide(buf, count, dtype, r.divisor, NULL);
        if (status != DPTC_OK)
            report(dtypes[dtype].name, "dptc_divide returned status %d",
                   (int)status);
        else
            check_elements("dptc_divide", &r, buf, count);
        if (!guard_intact(buf, bytes))
            report(dtypes[dtype].name, "dptc_divide wrote past the end");
    }
    free(original);
    free(buf);
}

/* ---- arguments ---- */

/* The error buffer of the call being checked, emptied by fresh_error() as
 * that call's arguments are evaluated, so that a message found afterwards
 * can only have come from that call. */
static dptc_error last_error;

static dptc_error *fresh_error(void)
{
    last_error.message[0] = '\0';
    return &last_error;
}

static void expect_status(const char *what, dptc_status got,
                          dptc_status expected)
{
    if (got != expected)
        report(what, "returned %d, expected %d", (int)got, (int)expected);
}

/* A refusal: DPTC_ERR_INVALID, with a message in last_error that contains
 * each of the given words (NULL ends the list). */
static void expect_refusal(const char *what, dptc_status got, ...)
{
    expect_status(what, got, DPTC_ERR_INVALID);
    if (last_error.message[0] == '\0') {
        report(what, "refused without a message");
        return;
    }
    va_list words;
    va_start(words, got);
    for (const char *word = va_arg(words, const char *); word != NULL;
         word = va_arg(words, const char *)) {
        if (strstr(last_error.message, word) == NULL)
            report(what, "message \"%s\" does not name \"%s\"",
                   last_error.message, word);
    }
    va_end(words);
}

static void test_invalid_reduce(void)
{
    float a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 4};
    int32_t ints[4] = {1, 2, 3, 4};
    const void *srcs[2] = {a, b};
    const void *int_srcs[1] = {ints};
    const void *null_srcs[2] = {a, NULL};
    expect_refusal("AVG", dptc_reduce(a, srcs, 2, 4, DPTC_FLOAT32, DPTC_AVG,
                                      0.5, fresh_error()),
                   "AVG", "float32", NULL);
    expect_refusal("BAND of float32",
                   dptc_reduce(a, srcs, 2, 4, DPTC_FLOAT32, DPTC_BAND, 1,
                               fresh_error()),
                   "BAND", "float32", "integer or bool", NULL);
    expect_refusal("BXOR of bfloat16",
                   dptc_reduce(a, srcs, 2, 4, DPTC_BFLOAT16, DPTC_BXOR, 1,
                               fresh_error()),
                   "BXOR", "bfloat16", NULL);
    expect_refusal("BOR of int32, divided",
                   dptc_reduce(ints, int_srcs, 1, 4, DPTC_INT32, DPTC_BOR, 2,
                               fresh_error()),
                   "int32", "BOR", "divisor 2", NULL);
    expect_refusal("op out of range",
                   dptc_reduce(a, srcs, 2, 4, DPTC_FLOAT32, DPTC_REDOP_COUNT,
                               1, fresh_error()),
                   "float32", NULL);
    expect_refusal("dtype out of range",
                   dptc_reduce(a, srcs, 2, 4, DPTC_DTYPE_COUNT, DPTC_SUM, 1,
                               fresh_error()),
                   "dtype", NULL);
    expect_refusal("nsrc 0", dptc_reduce(a, srcs, 0, 4, DPTC_FLOAT32,
                                         DPTC_SUM, 1, fresh_error()),
                   "float32", NULL);
    expect_refusal("int divisor", dptc_reduce(ints, int_srcs, 1, 4, DPTC_INT32,
                                              DPTC_SUM, 3, fresh_error()),
                   "int32", "SUM", "divisor 3", NULL);
    expect_refusal("bool divisor", dptc_reduce(ints, int_srcs, 1, 4, DPTC_BOOL,
                                               DPTC_SUM, 2, fresh_error()),
                   "bool", "divisor 2", NULL);
    expect_refusal("divisor 0", dptc_reduce(a, srcs, 2, 4, DPTC_FLOAT32,
                                            DPTC_SUM, 0, fresh_error()),
                   "float32", "divisor 0", NULL);
    expect_refusal("NULL source",
                   dptc_reduce(a, null_srcs, 2, 4, DPTC_FLOAT32, DPTC_SUM,
                               1, fresh_error()),
                   "float32", "NULL", NULL);
    expect_refusal("NULL dst", dptc_reduce(NULL, srcs, 2, 4, DPTC_FLOAT32,
                                           DPTC_SUM, 1, fresh_error()),
                   "float32", "NULL", NULL);
    expect_status("count 0", dptc_reduce(NULL, null_srcs, 2, 0, DPTC_FLOAT32,
                                         DPTC_SUM, 1, NULL), DPTC_OK);
    /* err may be NULL: the status alone comes back. */
    expect_status("int divisor, no error buffer",
                  dptc_reduce(ints, int_srcs, 1, 4, DPTC_INT32, DPTC_SUM, 2,
                              NULL),
                  DPTC_ERR_INVALID);
}

static void test_invalid_divide(void)
{
    float a[4] = {1, 2, 3, 4};
    int32_t ints[4] = {1, 2, 3, 4};
    expect_refusal("divide int32",
                   dptc_divide(ints, 4, DPTC_INT32, 2, fresh_error()),
                   "int32", "2", NULL);
    expect_refusal("divide bool",
                   dptc_divide(ints, 4, DPTC_BOOL, 2, fresh_error()),
                   "bool", NULL);
    expect_refusal("divide dtype out of range",
                   dptc_divide(a, 4, DPTC_DTYPE_COUNT, 2, fresh_error()),
                   "dtype", NULL);
    expect_refusal("divide by 0",
                   dptc_divide(a, 4, DPTC_FLOAT32, 0, fresh_error()),
                   "float32", "0", NULL);
    expect_refusal("divide NULL", dptc_divide(NULL, 4, DPTC_FLOAT32, 2,
                                              fresh_error()),
                   "float32", "NULL", NULL);
    expect_status("divide int32, no error buffer",
                  dptc_divide(ints, 4, DPTC_INT32, 2, NULL),
                  DPTC_ERR_INVALID);
    expect_status("divide float32",
                  dptc_divide(a, 4, DPTC_FLOAT32, 2, NULL), DPTC_OK);
    if (a[3] != 2.0f)
        report("divide float32", "a[3] = %g, expected 2", a[3]);
}

static void test_invalid_convert(void)
{
    int32_t ints[4] = {1, 2, 3, 4};
    float floats[4] = {1, 2, 3, 4};
    uint16_t halves[4] = {0};
    double wide[4] = {0};
    expect_refusal("convert int32 to bfloat16",
                   dptc_convert(halves, DPTC_BFLOAT16, ints, DPTC_INT32, 4,
                                fresh_error()),
                   "int32", "bfloat16", NULL);
    expect_refusal("convert float16 to int64",
                   dptc_convert(ints, DPTC_INT64, halves, DPTC_FLOAT16, 2,
                                fresh_error()),
                   "float16", "int64", NULL);
    expect_refusal("convert float32 to float64",
                   dptc_convert(wide, DPTC_FLOAT64, floats, DPTC_FLOAT32, 4,
                                fresh_error()),
                   "float32", "float64", NULL);
    expect_status("convert int32 to bfloat16, no error buffer",
                  dptc_convert(halves, DPTC_BFLOAT16, ints, DPTC_INT32, 4,
                               NULL),
                  DPTC_ERR_INVALID);
    expect_status("convert float32 to bfloat16",
                  dptc_convert(halves, DPTC_BFLOAT16, floats, DPTC_FLOAT32, 4,
                               NULL),
                  DPTC_OK);
    /* 4.0f is 0x40800000: its top half is the bfloat16. */
    if (halves[3] != 0x4080)
        report("convert float32 to bfloat16", "4.0 became %#x, expected 0x4080",
               halves[3]);
}

int main(void)
{
    test_invalid_reduce();
    test_invalid_divide();
    test_invalid_convert();
    test_half_round_trip(DPTC_BFLOAT16);
    test_half_round_trip(DPTC_FLOAT16);
    test_half_divide(DPTC_BFLOAT16);
    test_half_divide(DPTC_FLOAT16);
    test_float_divide(DPTC_FLOAT32);
    test_float_divide(DPTC_FLOAT64);
    test_unusual_layouts();
    test_all_reductions();
    printf("%ld reductions, %ld elements checked, %ld failures\n", cases_run,
           elements_checked, failures);
    return failures == 0 ? 0 : 1;
}
