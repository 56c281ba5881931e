/* test_engine.c — engine.c and shm.c driven by several rank processes and
 * several threads per rank, with no Python, so that ThreadSanitizer (and
 * AddressSanitizer with UBSan) can watch the engine's queues, progress
 * threads, failure record and the transport's shared-buffer table.
 *
 * Built from this file, tests/c/no_bridge.c, csrc/engine.c, csrc/shm.c,
 * csrc/kernels.c and csrc/common.c, and run, by tests/test_engine_tsan.py and tools/tsan.sh.
 * Usage: test_engine [ops_per_stream [deadline_s]].  Exits 0 when every
 * check passes.
 *
 * The parent forks the ranks of a one-node group of 2, then of 3, before
 * any thread exists, and waits for them with a deadline (SIGKILL after it).
 * Each rank:
 *  1. opens group 1 (2 streams): local rank 0 creates the segment and sends
 *     its path (/proc/<pid>/fd/<fd>) through a pipe; the others open it and
 *     acknowledge; then rank 0 calls dptc_shm_unlink;
 *  2. from two threads at once, one per stream, issues a few hundred mixed
 *     collectives, blocking (dptc_group_run) and asynchronous (up to 4 in
 *     flight, waited in and out of order), float32 of 1 to 300k elements,
 *     values chosen so that every result is exact (the slots filled
 *     streamed in the group of 2, cached in the group of 3); each stream
 *     first makes a shared buffer (DPTC_OP_CALL with dptc_shm_share), both
 *     at once, and both streams then work in place on either while the other stream's
 *     collectives look them up; the main thread unshares and frees a third
 *     one meanwhile;
 *  3. keeps both streams busy while a third thread on rank 1 calls
 *     dptc_group_abort: every rank's streams must fail with ABORTED or
 *     PEER_LOST naming the reason, and every later collective at once;
 *  4. destroys group 1 with works queued: each completes with an error;
 *  5. opens group 2, checks it works, then blocks each stream with a local
 *     DPTC_OP_CALL (a gate) with works queued behind it and a blocking run
 *     waiting from another thread, and destroys the group: the queued works
 *     fail as destroyed, the gates complete, nothing hangs;
 *  6. opens group 3 and runs one all-reduce; then every rank but 0 destroys
 *     the group, tells rank 0 through the pipes and stays alive until rank 0
 *     is done: rank 0's next all-reduce must fail as a lost peer that closed
 *     the group ([Note: a rank that leaves] in shm.c), not time out.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../../csrc/engine.h"
#include "../../csrc/shm.h"

#define NSTREAMS 2
#define SLOT_BYTES 65536
#define TIMEOUT_S 20.0
#define IN_FLIGHT 4
#define MAX_COUNT 300000
#define REGION_FLOATS 65536          /* each stream's part of the shared buffer */
#define MAX_PIECES 3
#define ABORTER 1                    /* the rank whose third thread aborts */
#define ABORT_REASON "test_engine: aborted from a third thread"
#define ABORT_OPS_MAX 20000
#define AFTER_ABORT_OPS 6
#define QUEUED 12                    /* works queued behind each gate */
#define PATH_BYTES 256
#define MAX_REPORTS 30
#define DEFAULT_OPS 160
#define DEFAULT_DEADLINE_S 120

/* ------------------------------------------------------------------ */
/* Reporting (per rank process) */

static int my_size, my_rank;
static _Atomic int failures;
static _Atomic long checked;         /* collectives whose result was verified */
static _Atomic long destroyed;       /* queued works failed by dptc_group_destroy itself */

static void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void report(const char *fmt, ...)
{
    if (atomic_fetch_add(&failures, 1) >= MAX_REPORTS)
        return;
    char line[2048];
    va_list args;
    va_start(args, fmt);
    vsnprintf(line, sizeof line, fmt, args);
    va_end(args);
    fprintf(stderr, "FAIL [%d ranks, rank %d] %s\n", my_size, my_rank, line);
}

static void sleep_s(double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static int failed_as_expected(dptc_status status)
{
    return status == DPTC_ERR_ABORTED || status == DPTC_ERR_PEER_LOST;
}

/* xorshift64*: fixed seeds, so that every rank draws the same collectives. */
static uint64_t next_random(uint64_t *state)
{
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return *state * 0x2545f4914f6cdd1du;
}

/* ------------------------------------------------------------------ */
/* Collectives and their expected results */

typedef enum {
    KIND_ALL_REDUCE_SUM,
    KIND_ALL_REDUCE_AVG,
    KIND_ALL_REDUCE_IN_PLACE,
    KIND_ALL_GATHER,
    KIND_ALL_GATHER_PIECES,
    KIND_REDUCE_SCATTER_SUM,
    KIND_REDUCE_SCATTER_AVG,
    KIND_BROADCAST,
    KIND_BARRIER,
    KIND_SHARED_ALL_REDUCE,        /* in place on the stream's region of the shared buffer */
    KIND_SHARED_ALL_GATHER,        /* output in the shared region */
    KIND_SHARED_REDUCE_SCATTER,    /* input in the shared region */
    KIND_COUNT
} kind;

static const char *const kind_names[KIND_COUNT] = {
    "all_reduce SUM", "all_reduce AVG", "all_reduce in place", "all_gather",
    "all_gather into pieces", "reduce_scatter SUM", "reduce_scatter AVG", "broadcast",
    "barrier", "shared all_reduce", "shared all_gather", "shared reduce_scatter",
};

/* Relative frequencies; shared kinds only once the buffer exists. */
static const int kind_weights[KIND_COUNT] = {18, 10, 8, 10, 8, 10, 6, 10, 6, 5, 4, 4};

static int is_shared_kind(kind k) { return k >= KIND_SHARED_ALL_REDUCE; }

/* What every rank issues at one position of a stream. */
typedef struct {
    kind kind;
    size_t count;         /* per rank */
    int root;
    int avg;              /* shared all_reduce / reduce_scatter: AVG instead of SUM */
    size_t offset;        /* element offset in the stream's shared region */
    uint32_t salt;        /* makes every collective's values different */
} spec;

/* Small integers, so that sums of up to 3 ranks are exact in float32. */
static float value(uint32_t salt, int rank, size_t i)
{
    return (float)((salt * 131u + (uint32_t)rank * 977u + (uint32_t)(i % 4099) * 7u) % 2048u) -
           1024.0f;
}

/* AVG inputs: rank r adds 2r - (n - 1), which sums to zero over the ranks,
 * so the average is base exactly (n * base * (float)(1/n) == base for
 * |base| < 2^22 and n <= 3). */
static float avg_input(uint32_t salt, int rank, size_t i)
{
    return value(salt, 0, i) + (float)(2 * rank - (my_size - 1));
}

static float sum_over_ranks(uint32_t salt, size_t i)
{
    float sum = 0;
    for (int r = 0; r < my_size; r++)
        sum += value(salt, r, i);
    return sum;
}

static size_t draw_count(uint64_t *rng, size_t max)
{
    unsigned band = (unsigned)(next_random(rng) % 100);
    size_t n = band < 55   ? 1 + next_random(rng) % 2048
               : band < 88 ? 2049 + next_random(rng) % 30000
                           : 32049 + next_random(rng) % (MAX_COUNT - 32048);
    return n > max ? 1 + n % max : n;
}

static spec next_spec(uint64_t *rng, uint32_t index, int with_shared)
{
    int total = 0;
    for (int k = 0; k < KIND_COUNT; k++)
        total += with_shared || !is_shared_kind((kind)k) ? kind_weights[k] : 0;
    int pick = (int)(next_random(rng) % (uint64_t)total);
    spec s = {.salt = index * 2654435761u + (uint32_t)next_random(rng)};
    for (int k = 0; k < KIND_COUNT; k++) {
        if (!with_shared && is_shared_kind((kind)k))
            continue;
        if (pick < kind_weights[k]) {
            s.kind = (kind)k;
            break;
        }
        pick -= kind_weights[k];
    }
    size_t n = (size_t)my_size;
    switch (s.kind) {
    case KIND_ALL_GATHER:
    case KIND_ALL_GATHER_PIECES:
    case KIND_REDUCE_SCATTER_SUM:
    case KIND_REDUCE_SCATTER_AVG:
        s.count = draw_count(rng, MAX_COUNT / n);
        break;
    case KIND_SHARED_ALL_REDUCE:
        s.count = draw_count(rng, REGION_FLOATS);
        break;
    case KIND_SHARED_ALL_GATHER:
    case KIND_SHARED_REDUCE_SCATTER:
        s.count = draw_count(rng, REGION_FLOATS / n);
        break;
    case KIND_BARRIER:
        break;
    default:
        s.count = draw_count(rng, MAX_COUNT);
    }
    s.root = (int)(next_random(rng) % n);
    s.avg = (int)(next_random(rng) % 2);
    if (is_shared_kind(s.kind)) {
        size_t used = s.kind == KIND_SHARED_ALL_REDUCE ? s.count : s.count * n;
        s.offset = (size_t)(next_random(rng) % (REGION_FLOATS - used + 1));
    }
    return s;
}

/* One issued collective and the buffers it owns until it completes. */
typedef struct {
    spec spec;
    dptc_coll coll;
    float *input, *output;           /* private, or into the shared region */
    int owns_input, owns_output;
    int npieces;
    void *outputs[MAX_PIECES];
    size_t output_counts[MAX_PIECES];
    dptc_work *work;
} op;

static float *floats(size_t n, float fill)
{
    float *p = malloc((n ? n : 1) * sizeof *p);
    if (!p) {
        fprintf(stderr, "test_engine: out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < n; i++)
        p[i] = fill;
    return p;
}

/* region: this rank's region of the shared buffer for the stream (shared kinds). */
static op *op_new(const spec *s, float *region)
{
    op *o = calloc(1, sizeof *o);
    if (!o) {
        fprintf(stderr, "test_engine: out of memory\n");
        exit(2);
    }
    o->spec = *s;
    size_t count = s->count, n = (size_t)my_size;
    uint32_t salt = s->salt;
    dptc_coll *c = &o->coll;
    c->dtype = DPTC_FLOAT32;
    c->redop = DPTC_SUM;
    c->count = count;
    o->owns_input = o->owns_output = 1;
    switch (s->kind) {
    case KIND_ALL_REDUCE_SUM:
    case KIND_ALL_REDUCE_AVG:
        c->op = DPTC_OP_ALL_REDUCE;
        c->redop = s->kind == KIND_ALL_REDUCE_AVG ? DPTC_AVG : DPTC_SUM;
        o->input = floats(count, 0);
        for (size_t i = 0; i < count; i++)
            o->input[i] = c->redop == DPTC_AVG ? avg_input(salt, my_rank, i)
                                               : value(salt, my_rank, i);
        o->output = floats(count, -9999.0f);
        break;
    case KIND_ALL_REDUCE_IN_PLACE:
        c->op = DPTC_OP_ALL_REDUCE;
        o->input = o->output = floats(count, 0);
        o->owns_output = 0;
        for (size_t i = 0; i < count; i++)
            o->input[i] = value(salt, my_rank, i);
        break;
    case KIND_ALL_GATHER:
    case KIND_ALL_GATHER_PIECES:
        c->op = DPTC_OP_ALL_GATHER;
        o->input = floats(count, 0);
        for (size_t i = 0; i < count; i++)
            o->input[i] = value(salt, my_rank, i);
        if (s->kind == KIND_ALL_GATHER) {
            o->output = floats(n * count, -9999.0f);
            break;
        }
        o->owns_output = 0;
        o->npieces = 2 + (int)(salt % 2);
        for (int j = 0, left = (int)count; j < o->npieces; j++) {
            size_t piece = j == o->npieces - 1 ? (size_t)left : count / 3;
            o->output_counts[j] = piece;
            o->outputs[j] = floats(n * piece, -9999.0f);
            left -= (int)piece;
        }
        c->noutputs = o->npieces;
        c->outputs = o->outputs;
        c->output_counts = o->output_counts;
        break;
    case KIND_REDUCE_SCATTER_SUM:
    case KIND_REDUCE_SCATTER_AVG:
        c->op = DPTC_OP_REDUCE_SCATTER;
        c->redop = s->kind == KIND_REDUCE_SCATTER_AVG ? DPTC_AVG : DPTC_SUM;
        o->input = floats(n * count, 0);
        for (size_t i = 0; i < n * count; i++)
            o->input[i] = c->redop == DPTC_AVG ? avg_input(salt, my_rank, i)
                                               : value(salt, my_rank, i);
        o->output = floats(count, -9999.0f);
        break;
    case KIND_BROADCAST:
        c->op = DPTC_OP_BROADCAST;
        c->root = s->root;
        o->input = o->output = floats(count, -5555.0f);
        o->owns_output = 0;
        if (my_rank == s->root)
            for (size_t i = 0; i < count; i++)
                o->input[i] = value(salt, s->root, i);
        break;
    case KIND_BARRIER:
        c->op = DPTC_OP_BARRIER;
        c->count = 0;
        o->owns_input = o->owns_output = 0;
        break;
    case KIND_SHARED_ALL_REDUCE:
        c->op = DPTC_OP_ALL_REDUCE;
        c->redop = s->avg ? DPTC_AVG : DPTC_SUM;
        o->input = o->output = region + s->offset;
        o->owns_input = o->owns_output = 0;
        for (size_t i = 0; i < count; i++)
            o->input[i] = s->avg ? avg_input(salt, my_rank, i) : value(salt, my_rank, i);
        break;
    case KIND_SHARED_ALL_GATHER:
        c->op = DPTC_OP_ALL_GATHER;
        o->input = floats(count, 0);
        for (size_t i = 0; i < count; i++)
            o->input[i] = value(salt, my_rank, i);
        o->output = region + s->offset;
        o->owns_output = 0;
        break;
    case KIND_SHARED_REDUCE_SCATTER:
        c->op = DPTC_OP_REDUCE_SCATTER;
        c->redop = s->avg ? DPTC_AVG : DPTC_SUM;
        o->input = region + s->offset;
        o->owns_input = 0;
        for (size_t i = 0; i < n * count; i++)
            o->input[i] = s->avg ? avg_input(salt, my_rank, i) : value(salt, my_rank, i);
        o->output = floats(count, -9999.0f);
        break;
    default:
        break;
    }
    c->input = o->input;
    c->output = o->output;
    return o;
}

static void op_free(op *o)
{
    if (!o)
        return;
    if (o->owns_input)
        free(o->input);
    if (o->owns_output)
        free(o->output);
    for (int j = 0; j < o->npieces; j++)
        free(o->outputs[j]);
    free(o);
}

/* Reports the first element that differs; 1 when all match. */
static int expect_element(const op *o, int stream, const char *where, size_t i, float got,
                          float want)
{
    if (got == want)
        return 1;
    report("stream %d: %s of %zu elements (salt %u): %s[%zu] = %.9g, expected %.9g", stream,
           kind_names[o->spec.kind], o->spec.count, o->spec.salt, where, i, (double)got,
           (double)want);
    return 0;
}

static void verify(const op *o, int stream)
{
    const spec *s = &o->spec;
    size_t count = s->count, n = (size_t)my_size;
    uint32_t salt = s->salt;
    int ok = 1;
    int avg = o->coll.redop == DPTC_AVG;
    switch (s->kind) {
    case KIND_ALL_REDUCE_SUM:
    case KIND_ALL_REDUCE_AVG:
    case KIND_ALL_REDUCE_IN_PLACE:
    case KIND_SHARED_ALL_REDUCE:
        for (size_t i = 0; i < count && ok; i++)
            ok = expect_element(o, stream, "output", i, o->output[i],
                                avg ? value(salt, 0, i) : sum_over_ranks(salt, i));
        break;
    case KIND_ALL_GATHER:
    case KIND_SHARED_ALL_GATHER:
        for (size_t i = 0; i < n * count && ok; i++)
            ok = expect_element(o, stream, "output", i, o->output[i],
                                value(salt, (int)(i / count), i % count));
        break;
    case KIND_ALL_GATHER_PIECES:
        for (int j = 0, start = 0; j < o->npieces && ok; start += (int)o->output_counts[j], j++) {
            size_t piece = o->output_counts[j];
            const float *out = o->outputs[j];
            for (size_t i = 0; i < n * piece && ok; i++)
                ok = expect_element(o, stream, j == 0 ? "outputs[0]" : j == 1 ? "outputs[1]"
                                                                              : "outputs[2]",
                                    i, out[i],
                                    value(salt, (int)(i / piece), (size_t)start + i % piece));
        }
        break;
    case KIND_REDUCE_SCATTER_SUM:
    case KIND_REDUCE_SCATTER_AVG:
    case KIND_SHARED_REDUCE_SCATTER:
        for (size_t i = 0; i < count && ok; i++) {
            size_t at = (size_t)my_rank * count + i;
            ok = expect_element(o, stream, "output", i, o->output[i],
                                avg ? value(salt, 0, at) : sum_over_ranks(salt, at));
        }
        break;
    case KIND_BROADCAST:
        for (size_t i = 0; i < count && ok; i++)
            ok = expect_element(o, stream, "buffer", i, o->output[i], value(salt, s->root, i));
        break;
    default:
        break;
    }
    if (ok)
        atomic_fetch_add(&checked, 1);
}

/* ------------------------------------------------------------------ */
/* Issuing */

/* Blocking: dptc_group_run.  Returns the status; a work that did not finish
 * keeps its buffers (leaked on purpose). */
static dptc_status run_op(dptc_group *g, int stream, op *o, dptc_error *err)
{
    dptc_work *unfinished = NULL;
    dptc_status status = dptc_group_run(g, stream, &o->coll, &unfinished, err);
    if (unfinished) {
        report("stream %d: %s did not finish: %s", stream, kind_names[o->spec.kind],
               err->message);
        dptc_work_release(unfinished);
        o->input = o->output = NULL;  /* may still be written: leak them */
        o->npieces = 0;
    }
    return status;
}

/* Waits for o's work, releases it and returns its status. */
static dptc_status wait_op(op *o, dptc_error *err)
{
    dptc_status status = dptc_work_wait(o->work, TIMEOUT_S * 2, err);
    if (!dptc_work_is_completed(o->work)) {
        report("%s did not complete after its wait gave up: %s", kind_names[o->spec.kind],
               err->message);
        o->input = o->output = NULL;
        o->npieces = 0;
        o->work = NULL;  /* leak it with its buffers */
        return status;
    }
    dptc_work_release(o->work);
    o->work = NULL;
    return status;
}

/* The asynchronous works of one stream thread, oldest first. */
typedef struct {
    op *ops[IN_FLIGHT];
    int n;
} pending;

static op *pending_take(pending *p, int k)
{
    op *o = p->ops[k];
    memmove(&p->ops[k], &p->ops[k + 1], (size_t)(p->n - k - 1) * sizeof *p->ops);
    p->n--;
    return o;
}

/* In the healthy phase every work must succeed. */
static dptc_status finish_healthy(op *o, int stream)
{
    dptc_error err;
    dptc_status status = wait_op(o, &err);
    if (status == DPTC_OK)
        verify(o, stream);
    else
        report("stream %d: %s of %zu elements failed (%d): %s", stream, kind_names[o->spec.kind],
               o->spec.count, (int)status, err.message);
    op_free(o);
    return status;
}

/* ------------------------------------------------------------------ */
/* Phase 2: mixed collectives on both streams, with shared buffers */

/* Stream s makes buffer s, both at once; a shared collective on stream s
 * uses region s of either.  Stream 0 also makes a scratch buffer halfway,
 * which the main thread unshares and frees while the streams run. */
#define SCRATCH NSTREAMS
typedef struct {
    dptc_shared buffer;
    dptc_shm_share_request request;  /* outlives the share work */
    _Atomic int state;               /* 0 while being made, 1 ready, -1 failed */
} shared_slot;

typedef struct {
    dptc_group *group;
    int stream;
    int ops;
    shared_slot *shared;             /* NSTREAMS + 1 of them */
    /* Abort phase */
    _Atomic int issued;
    dptc_status first_failure;
} worker;

static uint64_t stream_seed(int stream, int phase)
{
    return 0x9e3779b97f4a7c15u ^ ((uint64_t)(stream + 1) << 32) ^ ((uint64_t)my_size << 8) ^
           (uint64_t)phase;
}

/* The issuing mode differs between ranks: it is not part of the collective. */
static uint64_t mode_seed(int stream, int phase)
{
    return stream_seed(stream, phase) * 31u + (uint64_t)my_rank * 0x1000193u + 1u;
}

/* Makes slot's buffer, collectively on the worker's stream. */
static dptc_status make_shared(worker *w, shared_slot *slot, size_t nbytes, uint64_t *mode)
{
    dptc_shm_share_request *request = &slot->request;
    request->nbytes = nbytes;
    request->out = &slot->buffer;
    dptc_coll c = {.op = DPTC_OP_CALL, .dtype = DPTC_UINT8, .count = request->nbytes,
                   .call = dptc_shm_share, .call_arg = request};
    dptc_error err;
    dptc_status status;
    if (next_random(mode) % 2) {
        dptc_work *unfinished = NULL;
        status = dptc_group_run(w->group, w->stream, &c, &unfinished, &err);
        if (unfinished) {
            report("share did not finish: %s", err.message);
            return status;
        }
    } else {
        dptc_work *work;
        status = dptc_group_submit(w->group, w->stream, &c, &work, &err);
        if (status == DPTC_OK) {
            status = dptc_work_wait(work, TIMEOUT_S * 2, &err);
            if (!dptc_work_is_completed(work)) {
                report("share did not complete: %s", err.message);
                return status;
            }
            dptc_work_release(work);
        }
    }
    if (status != DPTC_OK) {
        report("share failed (%d): %s", (int)status, err.message);
        return status;
    }
    dptc_shared *sh = &slot->buffer;
    if (sh->bytes < request->nbytes || sh->local_rank != my_rank || sh->local_size != my_size)
        report("share made %zu bytes for local rank %d of %d", sh->bytes, sh->local_rank,
               sh->local_size);
    for (int p = 0; p < my_size; p++)
        if (!sh->base[p])
            report("share left local rank %d's segment unmapped", p);
    /* Peers write into my segment only in collectives I have issued, so
     * mine is still as made: zero-filled. */
    const unsigned char *mine = sh->base[my_rank];
    for (size_t i = 0; mine && i < sh->bytes; i++)
        if (mine[i]) {
            report("shared buffer byte %zu is %u, expected 0", i, mine[i]);
            break;
        }
    return DPTC_OK;
}

static void *mixed_main(void *arg)
{
    worker *w = arg;
    uint64_t rng = stream_seed(w->stream, 2), mode = mode_seed(w->stream, 2);
    pending p = {.n = 0};
    shared_slot *mine = &w->shared[w->stream];
    atomic_store(&mine->state,
                 make_shared(w, mine, NSTREAMS * REGION_FLOATS * sizeof(float), &mode) == DPTC_OK
                     ? 1 : -1);
    for (int i = 0; i < w->ops; i++) {
        if (w->stream == 0 && i == w->ops / 2) {
            shared_slot *scratch = &w->shared[SCRATCH];
            atomic_store(&scratch->state,
                         make_shared(w, scratch, 1000, &mode) == DPTC_OK ? 1 : -1);
        }
        spec s = next_spec(&rng, (uint32_t)i, 1);
        float *region = NULL;
        if (is_shared_kind(s.kind)) {
            shared_slot *slot = &w->shared[s.salt % NSTREAMS];
            int state;
            double until = dptc_now() + TIMEOUT_S;
            while ((state = atomic_load(&slot->state)) == 0 && dptc_now() < until)
                sleep_s(1e-3);
            if (state != 1) {
                report("stream %d: no shared buffer for collective %d", w->stream, i);
                break;
            }
            region = (float *)slot->buffer.base[my_rank] + (size_t)w->stream * REGION_FLOATS;
        }
        op *o = op_new(&s, region);
        /* A shared collective is blocking: peers write into my region in the
         * next one only after I issue it, i.e. after I checked this one. */
        if (region || next_random(&mode) % 2) {
            dptc_error err;
            dptc_status status = run_op(w->group, w->stream, o, &err);
            if (status != DPTC_OK) {
                report("stream %d: %s of %zu elements failed (%d): %s", w->stream,
                       kind_names[s.kind], s.count, (int)status, err.message);
                op_free(o);
                break;
            }
            verify(o, w->stream);
            op_free(o);
            continue;
        }
        dptc_error err;
        dptc_status status = dptc_group_submit(w->group, w->stream, &o->coll, &o->work, &err);
        if (status != DPTC_OK) {
            report("stream %d: submit failed (%d): %s", w->stream, (int)status, err.message);
            op_free(o);
            break;
        }
        p.ops[p.n++] = o;
        if (p.n == IN_FLIGHT && finish_healthy(pending_take(&p, 0), w->stream) != DPTC_OK)
            break;
        if (next_random(&mode) % 8 == 0)  /* now and then drain, in any order */
            while (p.n > 0)
                finish_healthy(pending_take(&p, (int)(next_random(&mode) % (uint64_t)p.n)),
                               w->stream);
    }
    while (p.n > 0)
        finish_healthy(pending_take(&p, 0), w->stream);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Phase 3: abort from a third thread while the streams are busy */

/* Finishes a work of the abort phase: succeeded (then checked) or failed as
 * an abort does. */
static dptc_status finish_aborting(op *o, worker *w)
{
    dptc_error err;
    dptc_status status = wait_op(o, &err);
    if (status == DPTC_OK) {
        verify(o, w->stream);
    } else {
        if (!failed_as_expected(status))
            report("stream %d: %s failed with %d, expected ABORTED or PEER_LOST: %s", w->stream,
                   kind_names[o->spec.kind], (int)status, err.message);
        if (w->first_failure == DPTC_OK)
            w->first_failure = status;
    }
    op_free(o);
    return status;
}

static void *aborting_main(void *arg)
{
    worker *w = arg;
    uint64_t rng = stream_seed(w->stream, 3), mode = mode_seed(w->stream, 3);
    pending p = {.n = 0};
    int i;
    for (i = 0; i < ABORT_OPS_MAX && w->first_failure == DPTC_OK; i++) {
        spec s = next_spec(&rng, (uint32_t)i, 0);
        op *o = op_new(&s, NULL);
        dptc_error err;
        if (next_random(&mode) % 2) {
            dptc_status status = run_op(w->group, w->stream, o, &err);
            if (status == DPTC_OK) {
                verify(o, w->stream);
            } else {
                if (!failed_as_expected(status))
                    report("stream %d: %s failed with %d, expected ABORTED or PEER_LOST: %s",
                           w->stream, kind_names[s.kind], (int)status, err.message);
                w->first_failure = status;
            }
            op_free(o);
        } else {
            dptc_status status = dptc_group_submit(w->group, w->stream, &o->coll, &o->work, &err);
            if (status != DPTC_OK) {
                report("stream %d: submit failed (%d): %s", w->stream, (int)status, err.message);
                op_free(o);
                w->first_failure = status;
                break;
            }
            p.ops[p.n++] = o;
            if (p.n == IN_FLIGHT)
                finish_aborting(pending_take(&p, 0), w);
        }
        atomic_fetch_add(&w->issued, 1);
    }
    while (p.n > 0)
        finish_aborting(pending_take(&p, 0), w);
    if (w->first_failure == DPTC_OK) {
        report("stream %d: %d collectives and the abort never reached it", w->stream, i);
        return NULL;
    }
    /* Every later collective fails at once, blocking or not. */
    for (int k = 0; k < AFTER_ABORT_OPS; k++) {
        spec s = next_spec(&rng, (uint32_t)(i + k), 0);
        op *o = op_new(&s, NULL);
        dptc_error err = {""};
        double start = dptc_now();
        dptc_status status;
        if (k % 2) {
            status = run_op(w->group, w->stream, o, &err);
        } else {
            status = dptc_group_submit(w->group, w->stream, &o->coll, &o->work, &err);
            if (status == DPTC_OK)
                status = wait_op(o, &err);
        }
        double took = dptc_now() - start;
        if (!failed_as_expected(status) || !strstr(err.message, ABORT_REASON))
            report("stream %d: %s after the abort returned %d (%s), expected ABORTED or "
                   "PEER_LOST naming the abort", w->stream, kind_names[s.kind], (int)status,
                   err.message);
        if (took > 2.0)
            report("stream %d: %s after the abort took %.2f s to fail", w->stream,
                   kind_names[s.kind], took);
        op_free(o);
    }
    return NULL;
}

typedef struct {
    dptc_group *group;
    worker *workers;
} aborter;

static void *abort_main(void *arg)
{
    aborter *a = arg;
    double until = dptc_now() + TIMEOUT_S;
    if (my_rank == ABORTER) {
        /* Let both streams get going, then abort mid-flight. */
        while ((atomic_load(&a->workers[0].issued) < 5 || atomic_load(&a->workers[1].issued) < 5) &&
               dptc_now() < until)
            sleep_s(1e-3);
        sleep_s(0.02);
        dptc_group_abort(a->group, ABORT_REASON);
        dptc_group_abort(a->group, "test_engine: a second abort, which must not replace the first");
        return NULL;
    }
    /* Elsewhere, watch the failure record while the streams write it. */
    dptc_error err;
    while (dptc_group_failure(a->group, &err) == DPTC_OK && dptc_now() < until)
        sleep_s(1e-3);
    return NULL;
}

static void check_abort_record(dptc_group *g)
{
    dptc_error err = {""};
    dptc_status status = dptc_group_failure(g, &err);
    if (my_rank == ABORTER ? status != DPTC_ERR_ABORTED || strcmp(err.message, ABORT_REASON) != 0
                           : !failed_as_expected(status) || !strstr(err.message, ABORT_REASON))
        report("group failure after the abort is %d: \"%s\"", (int)status, err.message);
    memset(&err, 0, sizeof err);
    status = dptc_shm_failure(dptc_group_transport(g), &err);
    char who[64];
    snprintf(who, sizeof who, "global rank %d", ABORTER);
    if (status != DPTC_ERR_PEER_LOST || !strstr(err.message, ABORT_REASON) ||
        !strstr(err.message, who))
        report("the segment's abort record is %d: \"%s\"", (int)status, err.message);
}

/* ------------------------------------------------------------------ */
/* Phase 4 and 5: destroy with works queued */

/* Submits QUEUED collectives of phase `phase` on stream; each keeps its work. */
static void queue_ops(dptc_group *g, int stream, int phase, op **ops, _Atomic int *published)
{
    uint64_t rng = stream_seed(stream, phase);
    for (int k = 0; k < QUEUED; k++) {
        spec s = next_spec(&rng, (uint32_t)k, 0);
        ops[k] = op_new(&s, NULL);
        dptc_error err;
        dptc_status status = dptc_group_submit(g, stream, &ops[k]->coll, &ops[k]->work, &err);
        if (status != DPTC_OK) {
            report("stream %d: queueing work %d failed (%d): %s", stream, k, (int)status,
                   err.message);
            ops[k]->work = NULL;
        }
        if (published)
            atomic_store_explicit(published, k + 1, memory_order_release);
    }
}

/* After dptc_group_destroy: every work completed, with an error, whose
 * message contains `needle` (if not NULL); then frees them. */
static void check_destroyed(dptc_group *g, int stream, op **ops, const char *needle)
{
    for (int k = 0; k < QUEUED; k++) {
        op *o = ops[k];
        if (!o->work)
            continue;
        if (!dptc_work_is_completed(o->work)) {
            report("stream %d: work %d is not complete after dptc_group_destroy", stream, k);
            continue;  /* leak it */
        }
        dptc_error err = {""};
        dptc_status status = dptc_work_wait(o->work, 1.0, &err);
        if (strstr(err.message, "destroyed"))
            atomic_fetch_add(&destroyed, 1);
        if (!failed_as_expected(status) || (needle && !strstr(err.message, needle)))
            report("stream %d: queued work %d (%s) ended with %d: \"%s\"", stream, k,
                   kind_names[o->spec.kind], (int)status, err.message);
    }
    /* Documented safe after destroy while works hold the group: a no-op. */
    int held = 0;
    for (int k = 0; k < QUEUED; k++)
        held |= ops[k]->work != NULL;
    if (held)
        dptc_group_abort(g, "test_engine: abort after destroy");
    for (int k = 0; k < QUEUED; k++) {
        if (ops[k]->work && !dptc_work_is_completed(ops[k]->work))
            continue;
        dptc_work_release(ops[k]->work);
        ops[k]->work = NULL;
        op_free(ops[k]);
    }
}

/* A local step in a stream's order that holds the stream until every work
 * queued behind it has completed, i.e. until destroy failed them. */
typedef struct {
    op *ops[QUEUED];
    _Atomic int published;     /* ops[0, published) hold their works (release) */
    double deadline;
    int stream;
} gate;

static dptc_status gate_call(dptc_transport *t, const dptc_order *order, void *arg,
                             dptc_error *err)
{
    gate *gt = arg;
    (void)t;
    if (order->stream != gt->stream)
        return dptc_fail(err, DPTC_ERR_INVALID, "gate of stream %d ran on stream %d", gt->stream,
                         order->stream);
    for (;;) {
        int n = atomic_load_explicit(&gt->published, memory_order_acquire);
        int done = n == QUEUED;
        for (int k = 0; k < n && done; k++)
            done = !gt->ops[k]->work || dptc_work_is_completed(gt->ops[k]->work);
        if (done)
            return DPTC_OK;
        if (dptc_now() > gt->deadline)
            return dptc_fail(err, DPTC_ERR_TIMEOUT, "gate of stream %d: queued works did not "
                             "complete", gt->stream);
        sleep_s(1e-3);
    }
}

typedef struct {
    dptc_group *group;
    _Atomic int started;
    dptc_status status;
    dptc_error err;
    int unfinished;
} late_runner;

/* Blocks in dptc_group_run behind the gate of stream 1 while destroy runs. */
static void *late_run_main(void *arg)
{
    late_runner *r = arg;
    float x = 1.0f;
    dptc_coll c = {.op = DPTC_OP_ALL_REDUCE, .dtype = DPTC_FLOAT32, .redop = DPTC_SUM,
                   .input = &x, .output = &x, .count = 1};
    dptc_work *unfinished = NULL;
    atomic_store(&r->started, 1);
    r->status = dptc_group_run(r->group, 1, &c, &unfinished, &r->err);
    r->unfinished = unfinished != NULL;
    if (unfinished)
        dptc_work_release(unfinished);
    return NULL;
}

/* A few collectives on a new group, before the destroy test. */
static void check_healthy(dptc_group *g)
{
    for (int stream = 0; stream < NSTREAMS; stream++) {
        spec barrier = {.kind = KIND_BARRIER, .salt = 1};
        spec sum = {.kind = KIND_ALL_REDUCE_SUM, .count = 1000, .salt = 2};
        spec gather = {.kind = KIND_ALL_GATHER, .count = 5000, .salt = 3};
        const spec *specs[] = {&barrier, &sum};
        for (int k = 0; k < 2; k++) {
            op *o = op_new(specs[k], NULL);
            dptc_error err;
            dptc_status status = run_op(g, stream, o, &err);
            if (status == DPTC_OK)
                verify(o, stream);
            else
                report("group 2 stream %d: %s failed (%d): %s", stream,
                       kind_names[specs[k]->kind], (int)status, err.message);
            op_free(o);
        }
        op *o = op_new(&gather, NULL);
        dptc_error err;
        dptc_status status = dptc_group_submit(g, stream, &o->coll, &o->work, &err);
        if (status == DPTC_OK)
            finish_healthy(o, stream);
        else {
            report("group 2 stream %d: submit failed (%d): %s", stream, (int)status, err.message);
            op_free(o);
        }
    }
}

static void destroy_behind_gates(dptc_group *g)
{
    static gate gates[NSTREAMS];
    dptc_work *gate_works[NSTREAMS] = {NULL};
    for (int stream = 0; stream < NSTREAMS; stream++) {
        gate *gt = &gates[stream];
        gt->stream = stream;
        gt->deadline = dptc_now() + TIMEOUT_S;
        atomic_init(&gt->published, 0);
        dptc_coll c = {.op = DPTC_OP_CALL, .call = gate_call, .call_arg = gt};
        dptc_error err;
        if (dptc_group_submit(g, stream, &c, &gate_works[stream], &err) != DPTC_OK) {
            report("stream %d: submitting the gate failed: %s", stream, err.message);
            gate_works[stream] = NULL;
        }
        queue_ops(g, stream, 5, gt->ops, &gt->published);
    }
    late_runner late = {.group = g};
    pthread_t thread;
    if (pthread_create(&thread, NULL, late_run_main, &late) != 0) {
        report("pthread_create failed");
        exit(2);
    }
    while (!atomic_load(&late.started))
        sleep_s(1e-4);
    sleep_s(0.005);
    dptc_group_destroy(g);
    pthread_join(thread, NULL);
    if (late.unfinished || late.status != DPTC_ERR_ABORTED || !strstr(late.err.message, "destroyed"))
        report("a run waiting behind a gate returned %d (unfinished %d): \"%s\"",
               (int)late.status, late.unfinished, late.err.message);
    for (int stream = 0; stream < NSTREAMS; stream++) {
        dptc_work *w = gate_works[stream];
        if (!w)
            continue;
        dptc_error err = {""};
        if (!dptc_work_is_completed(w) || dptc_work_wait(w, 1.0, &err) != DPTC_OK)
            report("stream %d: the gate did not complete cleanly: %s", stream, err.message);
        check_destroyed(g, stream, gates[stream].ops, "destroyed before collective");
        if (dptc_work_is_completed(w))
            dptc_work_release(w);
    }
}

/* ------------------------------------------------------------------ */
/* Rank processes */

typedef struct {
    pid_t parent;
    int path_in;                       /* rank > 0: where rank 0's path arrives */
    int path_out[DPTC_MAX_LOCAL];      /* rank 0: to each other rank */
    int ack_in, ack_out;               /* ranks > 0 tell rank 0 they opened */
} links;

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int read_all(int fd, void *buf, size_t n)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = read(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Local rank 0 creates the segment and sends the path to map it by; the
 * others open it and acknowledge; rank 0 then forgets the name.  NULL when
 * this rank could not take part. */
static dptc_group *open_group(const links *l, int generation)
{
    char name[64], path[PATH_BYTES];
    snprintf(name, sizeof name, "/dptc-test-%d-%d-%d", (int)l->parent, my_size, generation);
    memset(path, 0, sizeof path);
    /* Both stagings of the slots (see [Note: staging] in shm.c): the group
     * of 2 streams, the group of 3 stages cached. */
    dptc_shm_config shm = {my_size == 2 ? DPTC_SHM_STAGING_STREAMED : DPTC_SHM_STAGING_CACHED};
    dptc_group_config cfg = {
        .rank = my_rank, .size = my_size, .local_rank = my_rank, .local_size = my_size,
        .node = 0, .nnodes = 1, .nstreams = NSTREAMS, .create = my_rank == 0,
        .slot_bytes = SLOT_BYTES, .timeout_s = TIMEOUT_S, .transport_arg = &shm,
    };
    dptc_group *g = NULL;
    dptc_error err;
    if (my_rank == 0) {
        cfg.shm_name = name;
        dptc_status status = dptc_group_create(&dptc_shm_transport, &cfg, &g, &err);
        if (status == DPTC_OK) {
            int fd = dptc_shm_segment_fd(dptc_group_transport(g));
            if (fd >= 0)
                snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)getpid(), fd);
            else
                snprintf(path, sizeof path, "%s", name);
        } else {
            report("creating group %d failed (%d): %s", generation, (int)status, err.message);
        }
        for (int r = 1; r < my_size; r++)
            if (write_all(l->path_out[r], path, sizeof path) != 0)
                report("sending the segment path to rank %d failed", r);
        if (!g)
            return NULL;
        for (int r = 1; r < my_size; r++) {
            unsigned char opened = 0;
            if (read_all(l->ack_in, &opened, 1) != 0 || opened != 1)
                report("a rank could not open group %d", generation);
        }
        dptc_shm_unlink(dptc_group_transport(g));
        dptc_shm_unlink(dptc_group_transport(g));  /* safe twice */
        if (dptc_shm_segment_fd(dptc_group_transport(g)) != -1)
            report("the segment descriptor is still open after dptc_shm_unlink");
        return g;
    }
    if (read_all(l->path_in, path, sizeof path) != 0 || !path[0]) {
        report("no segment path from rank 0 for group %d", generation);
        return NULL;
    }
    path[sizeof path - 1] = '\0';
    cfg.shm_name = path;
    dptc_status status = dptc_group_create(&dptc_shm_transport, &cfg, &g, &err);
    if (status != DPTC_OK)
        report("opening group %d at %s failed (%d): %s", generation, path, (int)status,
               err.message);
    unsigned char opened = status == DPTC_OK;
    if (write_all(l->ack_out, &opened, 1) != 0)
        report("acknowledging group %d failed", generation);
    return status == DPTC_OK ? g : NULL;
}

/* Phase 6; see the file's header. */
static void leave_early(const links *l, dptc_group *g)
{
    spec sum = {.kind = KIND_ALL_REDUCE_SUM, .count = 1000, .salt = 4};
    op *o = op_new(&sum, NULL);
    dptc_error err;
    dptc_status status = run_op(g, 0, o, &err);
    if (status == DPTC_OK)
        verify(o, 0);
    else
        report("group 3: the all-reduce before leaving failed (%d): %s", (int)status,
               err.message);
    op_free(o);
    unsigned char byte = 1;
    if (my_rank != 0) {
        dptc_group_destroy(g);
        if (write_all(l->ack_out, &byte, 1) != 0 || read_all(l->path_in, &byte, 1) != 0)
            report("group 3: the exchange with rank 0 failed");
        return;
    }
    for (int r = 1; r < my_size; r++)
        if (read_all(l->ack_in, &byte, 1) != 0)
            report("group 3: a rank did not say it left");
    o = op_new(&sum, NULL);
    status = run_op(g, 0, o, &err);
    if (status != DPTC_ERR_PEER_LOST || !strstr(err.message, "closed the group"))
        report("group 3: the all-reduce after the others left returned %d: \"%s\"",
               (int)status, status == DPTC_OK ? "" : err.message);
    else
        atomic_fetch_add(&checked, 1);
    op_free(o);
    for (int r = 1; r < my_size; r++)
        if (write_all(l->path_out[r], &byte, 1) != 0)
            report("group 3: telling rank %d it may go failed", r);
    dptc_group_destroy(g);
}

static void start(pthread_t *thread, void *(*body)(void *), void *arg)
{
    if (pthread_create(thread, NULL, body, arg) != 0) {
        report("pthread_create failed");
        exit(2);
    }
}

static int rank_main(const links *l, int ops)
{
    dptc_group *g = open_group(l, 1);
    if (!g)
        return 1;

    /* Mixed collectives on both streams, with shared buffers. */
    static shared_slot shared[NSTREAMS + 1];
    memset(shared, 0, sizeof shared);
    worker workers[NSTREAMS];
    pthread_t threads[NSTREAMS + 1];
    for (int s = 0; s < NSTREAMS; s++) {
        workers[s] = (worker){.group = g, .stream = s, .ops = ops, .shared = shared};
        start(&threads[s], mixed_main, &workers[s]);
    }
    /* Unshare the scratch buffer while both streams look buffers up. */
    double until = dptc_now() + TIMEOUT_S;
    while (atomic_load(&shared[SCRATCH].state) == 0 && dptc_now() < until)
        sleep_s(1e-3);
    if (atomic_load(&shared[SCRATCH].state) == 1) {
        dptc_shm_unshare(dptc_group_transport(g), &shared[SCRATCH].buffer);
        dptc_shm_shared_free(&shared[SCRATCH].buffer);
    }
    for (int s = 0; s < NSTREAMS; s++)
        pthread_join(threads[s], NULL);
    for (int b = 0; b < NSTREAMS; b++)
        if (atomic_load(&shared[b].state) == 1) {
            dptc_shm_unshare(dptc_group_transport(g), &shared[b].buffer);
            dptc_shm_shared_free(&shared[b].buffer);
        }
    int healthy = atomic_load(&failures) == 0;

    /* Abort while both streams are busy. */
    if (healthy) {
        for (int s = 0; s < NSTREAMS; s++) {
            workers[s] = (worker){.group = g, .stream = s};
            start(&threads[s], aborting_main, &workers[s]);
        }
        aborter a = {.group = g, .workers = workers};
        start(&threads[NSTREAMS], abort_main, &a);
        for (int s = 0; s <= NSTREAMS; s++)
            pthread_join(threads[s], NULL);
        check_abort_record(g);
    } else {
        dptc_group_abort(g, "test_engine: an earlier check failed");
    }

    /* Destroy the aborted group with works queued on both streams. */
    op *queued[NSTREAMS][QUEUED];
    for (int s = 0; s < NSTREAMS; s++)
        queue_ops(g, s, 4, queued[s], NULL);
    dptc_group_destroy(g);
    for (int s = 0; s < NSTREAMS; s++)
        check_destroyed(g, s, queued[s], NULL);

    /* A new group, destroyed with works queued behind local gates. */
    dptc_group *g2 = open_group(l, 2);
    if (g2) {
        check_healthy(g2);
        destroy_behind_gates(g2);
    }

    /* A new group that every rank but 0 leaves early. */
    dptc_group *g3 = open_group(l, 3);
    if (g3)
        leave_early(l, g3);
    int n = atomic_load(&failures);
    printf("test_engine: %d ranks, rank %d: %ld collectives checked, aborted after %d and %d "
           "issued, %ld queued works failed by destroy, %d failures\n", my_size, my_rank,
           atomic_load(&checked), atomic_load(&workers[0].issued),
           atomic_load(&workers[1].issued), atomic_load(&destroyed), n);
    fflush(stdout);
    return n == 0 ? 0 : 1;
}

/* ------------------------------------------------------------------ */
/* The parent */

static volatile sig_atomic_t deadline_passed;

static void on_alarm(int sig)
{
    (void)sig;
    deadline_passed = 1;
}

static void close_links(int pipes[][2], int size, int ack[2])
{
    for (int r = 1; r < size; r++) {
        close(pipes[r][0]);
        close(pipes[r][1]);
    }
    close(ack[0]);
    close(ack[1]);
}

/* Forks `size` ranks and waits for them; returns the number that failed. */
static int run_group(int size, int ops, int deadline_s)
{
    int pipes[DPTC_MAX_LOCAL][2], ack[2];
    if (pipe(ack) != 0) {
        perror("pipe");
        return size;
    }
    for (int r = 1; r < size; r++)
        if (pipe(pipes[r]) != 0) {
            perror("pipe");
            return size;
        }
    pid_t pids[DPTC_MAX_LOCAL];
    pid_t parent = getpid();
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < size; r++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            perror("fork");
            pids[r] = 0;
            continue;
        }
        if (pids[r] == 0) {
            links l = {.parent = parent, .path_in = -1, .ack_in = -1, .ack_out = -1};
            if (r == 0) {
                for (int k = 1; k < size; k++)
                    l.path_out[k] = dup(pipes[k][1]);
                l.ack_in = dup(ack[0]);
            } else {
                l.path_in = dup(pipes[r][0]);
                l.ack_out = dup(ack[1]);
            }
            close_links(pipes, size, ack);
            my_size = size;
            my_rank = r;
            exit(rank_main(&l, ops));
        }
    }
    close_links(pipes, size, ack);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigaction(SIGALRM, &sa, NULL);  /* no SA_RESTART: waitpid returns EINTR */
    deadline_passed = 0;
    alarm((unsigned)deadline_s);
    int bad = 0, left = 0;
    for (int r = 0; r < size; r++)
        left += pids[r] != 0;
    bad += size - left;
    while (left > 0) {
        int st;
        pid_t pid = waitpid(-1, &st, 0);
        if (pid < 0 && errno == EINTR && deadline_passed) {
            for (int r = 0; r < size; r++)
                if (pids[r]) {
                    fprintf(stderr, "FAIL [%d ranks] rank %d (pid %d) did not finish within "
                            "%d s; killed\n", size, r, (int)pids[r], deadline_s);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                    pids[r] = 0;
                    bad++;
                }
            break;
        }
        if (pid < 0)
            continue;
        for (int r = 0; r < size; r++) {
            if (pids[r] != pid)
                continue;
            pids[r] = 0;
            left--;
            if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
                break;
            bad++;
            if (WIFEXITED(st))
                fprintf(stderr, "FAIL [%d ranks] rank %d exited %d\n", size, r, WEXITSTATUS(st));
            else
                fprintf(stderr, "FAIL [%d ranks] rank %d was killed by signal %d\n", size, r,
                        WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        }
    }
    alarm(0);
    return bad;
}

int main(int argc, char **argv)
{
    int ops = argc > 1 ? atoi(argv[1]) : DEFAULT_OPS;
    int deadline_s = argc > 2 ? atoi(argv[2]) : DEFAULT_DEADLINE_S;
    if (ops < 1 || deadline_s < 1) {
        fprintf(stderr, "usage: %s [ops_per_stream >= 1 [deadline_s >= 1]]\n", argv[0]);
        return 2;
    }
    int bad = 0;
    for (int size = 2; size <= 3; size++)
        bad += run_group(size, ops, deadline_s);
    printf("test_engine: %d rank processes failed\n", bad);
    return bad == 0 ? 0 : 1;
}
