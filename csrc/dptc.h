/* dptc.h — declarations shared by every file of the C core.
 *
 * C never sees torch's types: buffers arrive as a data pointer, an element
 * count and a dtype code (see [Note: tensors across the C boundary] in
 * engine.h).  Every internal function returns a dptc_status; results come
 * back through out-pointers.
 */
#ifndef DPTC_H
#define DPTC_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    DPTC_OK = 0,
    DPTC_ERR_INVALID,     /* bad argument reaching C (Python checks first) */
    DPTC_ERR_NOMEM,
    DPTC_ERR_SYSTEM,      /* a system call failed; message names it and errno */
    DPTC_ERR_TIMEOUT,     /* a wait passed its deadline */
    DPTC_ERR_PEER_LOST,   /* a peer process exited or aborted the group */
    DPTC_ERR_MISMATCH,    /* ranks issued different collectives */
    DPTC_ERR_ABORTED,     /* the group was aborted (locally or by a peer) */
    DPTC_ERR_PYTHON,      /* a Python call failed (bridge, hooks); message holds it */
    DPTC_ERR_INTERRUPTED, /* the waiting thread was interrupted (Ctrl-C); see dptc_interrupted */
    DPTC_ERR_LIBRARY,     /* NCCL or the CUDA runtime cannot be loaded or lacks a function;
                             the message names the file, the function and the remedy */
    DPTC_ERR_CUDA,        /* a CUDA runtime or NCCL call failed; the message names it */
} dptc_status;

/* Element types.  The codes are part of the Python <-> C contract:
 * dptc/_dtypes.py maps torch dtypes to them. */
typedef enum {
    DPTC_FLOAT32 = 0,
    DPTC_FLOAT64 = 1,
    DPTC_BFLOAT16 = 2,
    DPTC_FLOAT16 = 3,
    DPTC_INT32 = 4,
    DPTC_INT64 = 5,
    DPTC_UINT8 = 6,
    DPTC_INT8 = 7,
    DPTC_BOOL = 8,
    DPTC_DTYPE_COUNT
} dptc_dtype;

/* Reduction operators; codes shared with dptc/collectives.py. */
typedef enum {
    DPTC_SUM = 0,
    DPTC_AVG = 1,
    DPTC_MAX = 2,
    DPTC_MIN = 3,
    DPTC_PRODUCT = 4,
    DPTC_BAND = 5,       /* bitwise and, or, exclusive or: integers and bool only */
    DPTC_BOR = 6,
    DPTC_BXOR = 7,
    DPTC_REDOP_COUNT
} dptc_redop;

/* Collective operations; codes shared with dptc/collectives.py. */
typedef enum {
    DPTC_OP_ALL_REDUCE = 0,
    DPTC_OP_BROADCAST = 1,
    DPTC_OP_ALL_GATHER = 2,
    DPTC_OP_REDUCE_SCATTER = 3,
    DPTC_OP_BARRIER = 4,
    DPTC_OP_CALL = 5,    /* a transport's own ordered step (dptc_coll.call), e.g. shm's share */
    DPTC_OP_COUNT
} dptc_op;

size_t dptc_dtype_size(dptc_dtype dtype);
const char *dptc_dtype_name(dptc_dtype dtype);
const char *dptc_op_name(dptc_op op);
const char *dptc_redop_name(dptc_redop redop);

/* Error messages travel with the status.  A dptc_error is a fixed buffer
 * (no allocation on failure paths, safe without the GIL). */
#define DPTC_ERROR_MAX 1024
typedef struct {
    char message[DPTC_ERROR_MAX];
} dptc_error;

/* Formats into err (if not NULL) and returns status, so that callers can
 * write `return dptc_fail(err, DPTC_ERR_TIMEOUT, "...", ...);`. */
dptc_status dptc_fail(dptc_error *err, dptc_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Propagation macros, in the manner of NCCL's checks.h. */
#define CHECK(call)                                \
    do {                                           \
        dptc_status check_status_ = (call);        \
        if (check_status_ != DPTC_OK)              \
            return check_status_;                  \
    } while (0)

#define CHECK_GOTO(call, status, label)            \
    do {                                           \
        (status) = (call);                         \
        if ((status) != DPTC_OK)                   \
            goto label;                            \
    } while (0)

/* Monotonic clock in seconds. */
double dptc_now(void);

/* [Note: interrupts]
 * A thread that waits on behalf of Python (with the GIL released) must let
 * Ctrl-C through.  module.c installs, for the duration of such a wait, a
 * thread-local check that takes the GIL and runs the signal handlers; every
 * slow wait loop in the engine and its transports calls dptc_interrupted(),
 * which runs that check at most every DPTC_INTERRUPT_PERIOD_S and is a no-op
 * on threads without one (progress threads).  A wait that sees it returns
 * DPTC_ERR_INTERRUPTED, which aborts the group like any other failure, so
 * the peers raise too. */
#define DPTC_INTERRUPT_PERIOD_S 0.1
typedef int (*dptc_interrupt_check)(void *arg);   /* nonzero: stop waiting */
/* Installs check for the calling thread (NULL removes it); returns the previous one. */
void dptc_set_interrupt_check(dptc_interrupt_check check, void *arg,
                              dptc_interrupt_check *previous, void **previous_arg);
/* Nonzero once the calling thread's check has fired (sticky until the check is replaced). */
int dptc_interrupted(void);

/* One iteration's pause inside a spin loop (x86's pause, arm's yield). */
static inline void dptc_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

#endif /* DPTC_H */
