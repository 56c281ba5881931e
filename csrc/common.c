/* common.c — status messages, clocks and the names of codes. */
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "dptc.h"

dptc_status dptc_fail(dptc_error *err, dptc_status status, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
    }
    return status;
}

/* See [Note: interrupts] in dptc.h. */
static _Thread_local struct {
    dptc_interrupt_check check;
    void *arg;
    double next;
    int fired;
} interrupt;

void dptc_set_interrupt_check(dptc_interrupt_check check, void *arg,
                              dptc_interrupt_check *previous, void **previous_arg)
{
    if (previous)
        *previous = interrupt.check;
    if (previous_arg)
        *previous_arg = interrupt.arg;
    interrupt.check = check;
    interrupt.arg = arg;
    interrupt.next = 0;
    interrupt.fired = 0;
}

int dptc_interrupted(void)
{
    if (!interrupt.check)
        return 0;
    if (interrupt.fired)
        return 1;
    double now = dptc_now();
    if (now < interrupt.next)
        return 0;
    interrupt.next = now + DPTC_INTERRUPT_PERIOD_S;
    interrupt.fired = interrupt.check(interrupt.arg) != 0;
    return interrupt.fired;
}

double dptc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const struct {
    const char *name;
    size_t size;
} dtypes[DPTC_DTYPE_COUNT] = {
    [DPTC_FLOAT32] = {"float32", 4}, [DPTC_FLOAT64] = {"float64", 8},
    [DPTC_BFLOAT16] = {"bfloat16", 2}, [DPTC_FLOAT16] = {"float16", 2},
    [DPTC_INT32] = {"int32", 4}, [DPTC_INT64] = {"int64", 8},
    [DPTC_UINT8] = {"uint8", 1}, [DPTC_INT8] = {"int8", 1},
    [DPTC_BOOL] = {"bool", 1},
};

size_t dptc_dtype_size(dptc_dtype dtype)
{
    return (unsigned)dtype < DPTC_DTYPE_COUNT ? dtypes[dtype].size : 0;
}

const char *dptc_dtype_name(dptc_dtype dtype)
{
    return (unsigned)dtype < DPTC_DTYPE_COUNT ? dtypes[dtype].name : "unknown dtype";
}

const char *dptc_op_name(dptc_op op)
{
    static const char *names[DPTC_OP_COUNT] = {"all_reduce", "broadcast", "all_gather_into_tensor",
                                               "reduce_scatter_tensor", "barrier", "call"};
    return (unsigned)op < DPTC_OP_COUNT ? names[op] : "unknown collective";
}

const char *dptc_redop_name(dptc_redop redop)
{
    static const char *names[DPTC_REDOP_COUNT] = {"SUM", "AVG", "MAX", "MIN", "PRODUCT",
                                                  "BAND", "BOR", "BXOR"};
    return (unsigned)redop < DPTC_REDOP_COUNT ? names[redop] : "unknown op";
}
