/* nccl.c — the NCCL transport; see [Note: the NCCL transport] in nccl.h.
 * Every NCCL and CUDA call goes through the table cudalib.c loaded, and
 * every result is checked and named in the error. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl.h"
#include "transport.h"

/* Completion events per engine stream; see [Note: the NCCL transport]. */
#define RING 64
/* Polls of a completion before the progress thread starts to sleep, and
 * the longest sleep between polls. */
#define SPIN_POLLS 200
#define MAX_SLEEP_S 0.0005
/* How long an abort waits for an issuing thread to leave NCCL before it
 * aborts the communicator under it; see [Note: aborting under an issuer]. */
#define ABORT_LOCK_WAIT_S 1.0

/* Values of NCCL's public enums (nccl.h). */
enum { NCCL_INT8 = 0, NCCL_UINT8 = 1, NCCL_INT32 = 2, NCCL_INT64 = 4, NCCL_FLOAT16 = 6,
       NCCL_FLOAT32 = 7, NCCL_FLOAT64 = 8, NCCL_BFLOAT16 = 9 };
enum { NCCL_SUM = 0, NCCL_PROD = 1, NCCL_MAX = 2, NCCL_MIN = 3, NCCL_AVG = 4 };

typedef struct nccl_transport nccl_transport;

/* [Note: collective order on the device]
 * As on the shared-memory transport, every rank must issue a stream's
 * collectives in the same order (see [Note: collective order] in engine.h),
 * and NCCL does not check it: a rank that differs hangs or reduces the wrong
 * bytes.  So each collective is preceded on its engine stream by an
 * all-gather of a record of what this rank issued (op, dtype, redop, root,
 * count, sequence number, and the digest of a several-output all-gather's
 * pieces, whose NCCL calls differ in count where ranks split it
 * differently), copied in from pinned host memory and the
 * gathered records copied back out, then an event.  The progress thread
 * compares the records as soon as that event has happened, while the
 * collective itself may still run (or hang, because the ranks disagree),
 * and fails the group with DPTC_ERR_MISMATCH naming what each side issued.
 * The issuing thread only writes host memory and enqueues: nothing waits
 * for the device in the hot path.  A ring slot's records are reused only
 * once the progress thread has seen its collective complete.
 * DPTC_NCCL_CHECK_ORDER=0 leaves the check out (one small all-gather less
 * per collective). */
typedef struct {
    int32_t op, dtype, redop, root;
    uint64_t count, seq;
    uint64_t pieces;   /* dptc_pieces_digest: a several-output all-gather's pieces, or 0 */
} record;
_Static_assert(sizeof(record) == 40, "a record is 40 bytes on every rank");

/* What a collective leaves for the engine to wait on (dptc_completion's
 * handle). */
typedef struct {
    nccl_transport *t;
    int stream;
    dptc_cuda_event event;
    /* The order check: this rank's record, every rank's once gathered (pinned
     * host memory), their place on the device, and the event after them. */
    record *mine, *gathered;
    void *device_records;
    dptc_cuda_event checked;
    int check_pending;
} completion;

struct nccl_transport {
    dptc_transport base;
    const dptc_cuda_api *api;
    int rank, size, device, nstreams;
    dptc_nccl_unique_id id;
    dptc_cuda_stream streams[DPTC_MAX_STREAMS];
    dptc_cuda_event ready[DPTC_MAX_STREAMS];      /* recorded on the issuer's stream */
    completion done[DPTC_MAX_STREAMS][RING];
    unsigned next[DPTC_MAX_STREAMS];              /* next ring slot; the issuing thread's */
    _Atomic unsigned observed[DPTC_MAX_STREAMS];  /* completions the progress thread saw */
    int check_order;                              /* [Note: collective order on the device] */
    record *host_records[DPTC_MAX_STREAMS];       /* pinned: RING * (1 + size) records */
    void *device_records[DPTC_MAX_STREAMS];       /* RING * size records */
    int *scratch;                                 /* one int on the device, for barrier */
    /* The communicator: lock orders NCCL calls against abort, after which
     * comm is NULL (see [Note: aborting under an issuer]). */
    pthread_mutex_t lock;
    _Atomic(dptc_nccl_comm) comm;
    /* The failure record, written once under fail_lock, then aborted set. */
    pthread_mutex_t fail_lock;
    _Atomic int aborted;
    dptc_status abort_status;
    dptc_error abort_err;
};

/* [Note: a thread's device]
 * The CUDA runtime makes device 0's primary context current for a thread
 * that calls it before setting a device: hundreds of MiB of GPU 0 for every
 * rank of a node whose progress thread polled an event that way.  So every
 * thread dptc calls the runtime or NCCL from sets the group's device first:
 * the issuing thread in begin, the progress threads, and the threads that
 * abort or destroy.  The device stays set: torch's guards restore the one
 * before only where its context exists, which the runtime API cannot ask,
 * and a script's current device is its rank's anyway (torchrun scripts set
 * it).  A thread remembers the device it set, so the progress thread's polls
 * cost no call. */
static _Thread_local int thread_device = -1;

/* ------------------------------------------------------------------ */
/* Results */

static dptc_status cuda_failed(const dptc_cuda_api *api, dptc_cuda_error rc, const char *call,
                               dptc_error *err)
{
    const char *text = api->cudaGetErrorString(rc);
    return dptc_fail(err, DPTC_ERR_CUDA, "%s failed: %s (cudaError %d)", call,
                     text ? text : "unknown error", rc);
}

static dptc_status nccl_failed(const dptc_cuda_api *api, dptc_nccl_result rc, const char *call,
                               dptc_error *err)
{
    const char *text = api->ncclGetErrorString(rc);
    return dptc_fail(err, DPTC_ERR_CUDA, "%s failed: %s (ncclResult %d)", call,
                     text ? text : "unknown error", rc);
}

#define CUDA(t, call, err)                                                         \
    do {                                                                           \
        dptc_cuda_error cuda_rc_ = (t)->api->call;                                 \
        if (cuda_rc_ != DPTC_CUDA_SUCCESS)                                         \
            return cuda_failed((t)->api, cuda_rc_, #call, (err));                  \
    } while (0)

#define NCCL(t, call, err)                                                         \
    do {                                                                           \
        dptc_nccl_result nccl_rc_ = (t)->api->call;                                \
        if (nccl_rc_ != DPTC_NCCL_SUCCESS)                                         \
            return nccl_failed((t)->api, nccl_rc_, #call, (err));                  \
    } while (0)

static dptc_status aborted_error(nccl_transport *t, dptc_error *err)
{
    pthread_mutex_lock(&t->fail_lock);
    dptc_status status = t->abort_status;
    memcpy(err, &t->abort_err, sizeof *err);
    pthread_mutex_unlock(&t->fail_lock);
    return status;
}

/* Sets the group's device on this thread: see [Note: a thread's device]. */
static dptc_status use_device(nccl_transport *t, dptc_error *err)
{
    CUDA(t, cudaSetDevice(t->device), err);
    thread_device = t->device;
    return DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* Types */

static int nccl_dtype(dptc_dtype dtype)
{
    switch (dtype) {
    case DPTC_FLOAT32: return NCCL_FLOAT32;
    case DPTC_FLOAT64: return NCCL_FLOAT64;
    case DPTC_BFLOAT16: return NCCL_BFLOAT16;
    case DPTC_FLOAT16: return NCCL_FLOAT16;
    case DPTC_INT32: return NCCL_INT32;
    case DPTC_INT64: return NCCL_INT64;
    case DPTC_UINT8: return NCCL_UINT8;
    case DPTC_INT8: return NCCL_INT8;
    case DPTC_BOOL: return NCCL_UINT8;
    default: return -1;
    }
}

/* NCCL's op for redop on dtype: bool's SUM is "any" (MAX on bytes 0/1) and
 * its PRODUCT "all" (MIN), as the shared-memory transport reduces them.
 * NCCL has no bitwise ops (ncclRedOp_t: sum, prod, max, min, avg), so BAND,
 * BOR and BXOR have none here; dptc/collectives.py refuses them on CUDA
 * tensors before they reach C, as torch's NCCL backend does. */
static int nccl_redop(dptc_redop redop, dptc_dtype dtype)
{
    int boolean = dtype == DPTC_BOOL;
    switch (redop) {
    case DPTC_SUM: return boolean ? NCCL_MAX : NCCL_SUM;
    case DPTC_AVG: return boolean ? -1 : NCCL_AVG;
    case DPTC_MAX: return NCCL_MAX;
    case DPTC_MIN: return NCCL_MIN;
    case DPTC_PRODUCT: return boolean ? NCCL_MIN : NCCL_PROD;
    case DPTC_BAND: case DPTC_BOR: case DPTC_BXOR: return -1;
    default: return -1;
    }
}

/* ------------------------------------------------------------------ */
/* Completions */

static void sleep_seconds(double s)
{
    struct timespec ts = {0, (long)(s * 1e9)};
    nanosleep(&ts, NULL);
}

/* "all_reduce float32 SUM of 10 elements, root 0 (collective #3 of the
 * stream)": the reduce op only for the collectives that reduce, and ",
 * pieces digest 0x..." after the root where the record has one. */
static void describe(const record *r, char *out, size_t size)
{
    const char *op = r->op >= 0 && r->op < DPTC_OP_COUNT ? dptc_op_name((dptc_op)r->op) : "?";
    const char *dtype = r->dtype >= 0 && r->dtype < DPTC_DTYPE_COUNT
                            ? dptc_dtype_name((dptc_dtype)r->dtype) : "?";
    char redop[24] = "";
    if (r->op == DPTC_OP_ALL_REDUCE || r->op == DPTC_OP_REDUCE_SCATTER)
        snprintf(redop, sizeof redop, " %s",
                 r->redop >= 0 && r->redop < DPTC_REDOP_COUNT
                     ? dptc_redop_name((dptc_redop)r->redop) : "?");
    char pieces[48] = "";
    if (r->pieces)
        snprintf(pieces, sizeof pieces, ", pieces digest %#llx", (unsigned long long)r->pieces);
    snprintf(out, size, "%s %s%s of %llu elements, root %d%s (collective #%llu of the stream)",
             op, dtype, redop, (unsigned long long)r->count, (int)r->root, pieces,
             (unsigned long long)r->seq);
}

/* Compares every rank's record with this one's; see [Note: collective
 * order on the device]. */
static dptc_status check_records(nccl_transport *t, completion *c, dptc_error *err)
{
    for (int r = 0; r < t->size; r++) {
        if (memcmp(&c->gathered[r], c->mine, sizeof(record)) == 0)
            continue;
        char mine[192], theirs[192];
        describe(c->mine, mine, sizeof mine);
        describe(&c->gathered[r], theirs, sizeof theirs);
        return dptc_fail(err, DPTC_ERR_MISMATCH, "ranks issued different collectives on NCCL "
                         "stream %d: rank %d issued %s, rank %d issued %s", c->stream, t->rank,
                         mine, r, theirs);
    }
    return DPTC_OK;
}

/* The order check's part of a poll: compares the records once their event
 * has happened.  DPTC_OK while they are still on their way. */
static dptc_status poll_check(nccl_transport *t, completion *c, dptc_error *err)
{
    if (!c->check_pending)
        return DPTC_OK;
    dptc_cuda_error rc = t->api->cudaEventQuery(c->checked);
    if (rc == DPTC_CUDA_ERROR_NOT_READY)
        return DPTC_OK;
    if (rc != DPTC_CUDA_SUCCESS)
        return cuda_failed(t->api, rc, "cudaEventQuery", err);
    c->check_pending = 0;
    return check_records(t, c, err);
}

/* done->wait: polls the completion event until it has happened, the
 * deadline passes, NCCL reports an asynchronous error or the transport is
 * aborted; and the order check's records meanwhile.  On the progress
 * thread; never on the issuing path. */
static dptc_status completion_wait(void *handle, double deadline, dptc_error *err)
{
    completion *c = handle;
    nccl_transport *t = c->t;
    const dptc_cuda_api *api = t->api;
    if (thread_device != t->device)
        CHECK(use_device(t, err));
    double pause = 0.00001;
    for (unsigned polls = 0;; polls++) {
        /* After an abort the communicator's kernels end early and the events
         * behind them complete: no completion counts once it is aborted. */
        if (atomic_load(&t->aborted))
            return aborted_error(t, err);
        CHECK(poll_check(t, c, err));
        dptc_cuda_error rc = api->cudaEventQuery(c->event);
        if (rc == DPTC_CUDA_SUCCESS) {
            CHECK(poll_check(t, c, err));    /* its event came first on the stream */
            if (atomic_load(&t->aborted))    /* set before ncclCommAbort ends kernels */
                return aborted_error(t, err);
            atomic_fetch_add(&t->observed[c->stream], 1);
            return DPTC_OK;
        }
        if (rc != DPTC_CUDA_ERROR_NOT_READY)
            return cuda_failed(api, rc, "cudaEventQuery", err);
        if (polls < SPIN_POLLS) {
            dptc_cpu_relax();
            continue;
        }
        if (dptc_now() > deadline)
            return dptc_fail(err, DPTC_ERR_TIMEOUT, "rank %d: a NCCL collective on stream %d "
                             "did not complete by its deadline (a peer did not join it, or the "
                             "device work it follows is stuck)%s", t->rank, c->stream,
                             c->check_pending ? "; not every rank reached it" : "");
        /* An issuing thread may hold the lock inside NCCL for long (see [Note:
         * aborting under an issuer]); then the asynchronous error waits for a
         * later poll, and the deadline above still holds. */
        dptc_nccl_result async = DPTC_NCCL_SUCCESS, result = DPTC_NCCL_SUCCESS;
        if (pthread_mutex_trylock(&t->lock) == 0) {
            dptc_nccl_comm comm = t->comm;
            if (comm)
                result = api->ncclCommGetAsyncError(comm, &async);
            pthread_mutex_unlock(&t->lock);
        }
        if (result != DPTC_NCCL_SUCCESS)
            return nccl_failed(api, result, "ncclCommGetAsyncError", err);
        if (async != DPTC_NCCL_SUCCESS && async != DPTC_NCCL_IN_PROGRESS) {
            const char *text = api->ncclGetErrorString(async);
            return dptc_fail(err, DPTC_ERR_CUDA, "rank %d: NCCL reported an asynchronous error "
                             "on stream %d: %s (ncclResult %d)", t->rank, c->stream,
                             text ? text : "unknown error", async);
        }
        sleep_seconds(pause);
        pause = pause * 2 < MAX_SLEEP_S ? pause * 2 : MAX_SLEEP_S;
    }
}

dptc_status dptc_nccl_stream_wait(void *handle, void *stream, dptc_error *err)
{
    completion *c = handle;
    if (thread_device != c->t->device)
        CHECK(use_device(c->t, err));
    CUDA(c->t, cudaStreamWaitEvent((dptc_cuda_stream)stream, c->event, 0), err);
    return DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* Issuing; see [Note: device transports] in transport.h */

/* Orders the engine stream's CUDA stream after the issuer's stream.
 * t->lock held. */
static dptc_status begin(nccl_transport *t, const dptc_order *order, const dptc_coll *c,
                         dptc_error *err)
{
    if (!t->comm)  /* aborted */
        return aborted_error(t, err);
    CHECK(use_device(t, err));
    CUDA(t, cudaEventRecord(t->ready[order->stream], (dptc_cuda_stream)c->device_stream), err);
    CUDA(t, cudaStreamWaitEvent(t->streams[order->stream], t->ready[order->stream], 0), err);
    return DPTC_OK;
}

/* Waits (on the issuing thread, rarely) until the ring slot of the next
 * collective on the stream is free: RING collectives behind it have
 * completed.  Without t->lock. */
static dptc_status slot_free(nccl_transport *t, const dptc_order *order, dptc_error *err)
{
    int s = order->stream;
    while (atomic_load(&t->observed[s]) + RING <= t->next[s]) {
        if (atomic_load(&t->aborted))
            return aborted_error(t, err);
        if (dptc_now() > order->deadline)
            return dptc_fail(err, DPTC_ERR_TIMEOUT, "rank %d: %d NCCL collectives of stream %d "
                             "were still in flight at the deadline", t->rank, RING, s);
        sleep_seconds(0.00005);
    }
    return DPTC_OK;
}

/* Enqueues the order check of the next collective: see [Note: collective
 * order on the device].  t->lock held. */
static dptc_status enqueue_check(nccl_transport *t, const dptc_order *order, const dptc_coll *c,
                                 dptc_error *err)
{
    int s = order->stream;
    completion *slot = &t->done[s][t->next[s] % RING];
    dptc_cuda_stream stream = t->streams[s];
    *slot->mine = (record){.op = c->op, .dtype = c->dtype, .redop = c->redop, .root = c->root,
                           .count = c->count, .seq = order->seq,
                           .pieces = dptc_pieces_digest(c)};
    char *place = (char *)slot->device_records + (size_t)t->rank * sizeof(record);
    CUDA(t, cudaMemcpyAsync(place, slot->mine, sizeof(record), DPTC_CUDA_MEMCPY_HOST_TO_DEVICE,
                            stream), err);
    NCCL(t, ncclAllGather(place, slot->device_records, sizeof(record), NCCL_UINT8, t->comm,
                          stream), err);
    CUDA(t, cudaMemcpyAsync(slot->gathered, slot->device_records,
                            (size_t)t->size * sizeof(record), DPTC_CUDA_MEMCPY_DEVICE_TO_HOST,
                            stream), err);
    CUDA(t, cudaEventRecord(slot->checked, stream), err);
    slot->check_pending = 1;
    return DPTC_OK;
}

/* Records the collective's completion after what begin..end enqueued.
 * t->lock held. */
static dptc_status end(nccl_transport *t, const dptc_order *order, dptc_completion *done,
                       dptc_error *err)
{
    int s = order->stream;
    completion *slot = &t->done[s][t->next[s]++ % RING];
    CUDA(t, cudaEventRecord(slot->event, t->streams[s]), err);
    done->wait = completion_wait;
    done->handle = slot;
    return DPTC_OK;
}

/* One collective: begin, the order check, the NCCL call(s) of `body`, end;
 * under t->lock. */
typedef dptc_status (*enqueue_fn)(nccl_transport *t, const dptc_coll *c, dptc_cuda_stream stream,
                                  int dtype, int redop, dptc_error *err);

static dptc_status collective(dptc_transport *base, const dptc_order *order, const dptc_coll *c,
                              dptc_completion *done, enqueue_fn body, dptc_error *err)
{
    nccl_transport *t = (nccl_transport *)base;
    int dtype = nccl_dtype(c->dtype);
    int redop = nccl_redop(c->redop, c->dtype);
    if (dtype < 0 || ((c->op == DPTC_OP_ALL_REDUCE || c->op == DPTC_OP_REDUCE_SCATTER) &&
                      redop < 0))
        return dptc_fail(err, DPTC_ERR_INVALID, "NCCL cannot %s %s with %s", dptc_op_name(c->op),
                         dptc_dtype_name(c->dtype), dptc_redop_name(c->redop));
    CHECK(slot_free(t, order, err));  /* the completion events' ring, checked or not */
    pthread_mutex_lock(&t->lock);
    dptc_status status = begin(t, order, c, err);
    if (status == DPTC_OK && t->check_order)
        status = enqueue_check(t, order, c, err);
    if (status == DPTC_OK)
        status = body(t, c, t->streams[order->stream], dtype, redop, err);
    if (status == DPTC_OK)
        status = end(t, order, done, err);
    pthread_mutex_unlock(&t->lock);
    if (status != DPTC_OK && atomic_load(&t->aborted))
        return aborted_error(t, err);  /* the abort's reason, not the call it ended */
    return status;
}

static dptc_status enqueue_all_reduce(nccl_transport *t, const dptc_coll *c,
                                      dptc_cuda_stream stream, int dtype, int redop,
                                      dptc_error *err)
{
    NCCL(t, ncclAllReduce(c->input, c->output, c->count, dtype, redop, t->comm, stream), err);
    return DPTC_OK;
}

static dptc_status enqueue_reduce_scatter(nccl_transport *t, const dptc_coll *c,
                                          dptc_cuda_stream stream, int dtype, int redop,
                                          dptc_error *err)
{
    NCCL(t, ncclReduceScatter(c->input, c->output, c->count, dtype, redop, t->comm, stream),
         err);
    return DPTC_OK;
}

/* The several-output form gathers each piece straight into its output:
 * rank r's piece j lands at outputs[j] + r * output_counts[j]. */
static dptc_status enqueue_all_gather(nccl_transport *t, const dptc_coll *c,
                                      dptc_cuda_stream stream, int dtype, int redop,
                                      dptc_error *err)
{
    (void)redop;
    if (c->noutputs == 0) {
        NCCL(t, ncclAllGather(c->input, c->output, c->count, dtype, t->comm, stream), err);
        return DPTC_OK;
    }
    NCCL(t, ncclGroupStart(), err);
    dptc_status status = DPTC_OK;
    size_t offset = 0, element = dptc_dtype_size(c->dtype);
    for (int j = 0; j < c->noutputs && status == DPTC_OK; j++) {
        dptc_nccl_result rc = t->api->ncclAllGather((const char *)c->input + offset * element,
                                                    c->outputs[j], c->output_counts[j], dtype,
                                                    t->comm, stream);
        if (rc != DPTC_NCCL_SUCCESS)
            status = nccl_failed(t->api, rc, "ncclAllGather", err);
        offset += c->output_counts[j];
    }
    dptc_nccl_result rc = t->api->ncclGroupEnd();
    if (status == DPTC_OK && rc != DPTC_NCCL_SUCCESS)
        status = nccl_failed(t->api, rc, "ncclGroupEnd", err);
    return status;
}

static dptc_status enqueue_broadcast(nccl_transport *t, const dptc_coll *c,
                                     dptc_cuda_stream stream, int dtype, int redop,
                                     dptc_error *err)
{
    (void)redop;
    NCCL(t, ncclBroadcast(c->input, c->output, c->count, dtype, c->root, t->comm, stream), err);
    return DPTC_OK;
}

static dptc_status enqueue_barrier(nccl_transport *t, const dptc_coll *c,
                                   dptc_cuda_stream stream, int dtype, int redop,
                                   dptc_error *err)
{
    (void)c, (void)dtype, (void)redop;
    NCCL(t, ncclAllReduce(t->scratch, t->scratch, 1, NCCL_INT32, NCCL_SUM, t->comm, stream),
         err);
    return DPTC_OK;
}

#define COLLECTIVE(name)                                                                 \
    static dptc_status nccl_##name(dptc_transport *t, const dptc_order *order,           \
                                   const dptc_coll *c, dptc_completion *done,            \
                                   dptc_error *err)                                      \
    {                                                                                    \
        return collective(t, order, c, done, enqueue_##name, err);                       \
    }

COLLECTIVE(all_reduce)
COLLECTIVE(reduce_scatter)
COLLECTIVE(all_gather)
COLLECTIVE(broadcast)
COLLECTIVE(barrier)

/* ------------------------------------------------------------------ */
/* Life cycle */

/* [Note: aborting under an issuer]
 * The communicator is blocking: an NCCL call can wait inside NCCL for its
 * peers (NCCL connects them at a collective's first use), with no deadline
 * of its own and the issuing thread holding t->lock.  An abort (a deadline
 * passed, a peer failed) waits for that lock at most ABORT_LOCK_WAIT_S, then
 * aborts the communicator without it: NCCL's abort may come from another
 * thread and ends such a wait, and the issuer's later calls find comm NULL
 * and fail.  The failure record is written first, under a lock of its own,
 * and then `aborted`, so that whoever sees the flag reads a whole record.
 * Two limits remain.  The stuck call has no deadline of its own: it ends
 * when something aborts the group (a peer's failure through the store,
 * another wait's deadline, Ctrl-C).  And NCCL documents aborting a call in
 * flight on another thread for non-blocking communicators; on a blocking
 * one the returning call may still touch the communicator being freed.  A
 * non-blocking communicator (ncclCommInitRankConfig, blocking = 0, each
 * call's ncclInProgress polled against its deadline with the lock let go)
 * would lift both; it is not built yet. */
static int lock_within(pthread_mutex_t *lock, double seconds)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    long long ns = until.tv_nsec + (long long)(seconds * 1e9);
    until.tv_sec += (time_t)(ns / 1000000000LL);
    until.tv_nsec = (long)(ns % 1000000000LL);
    return pthread_mutex_timedlock(lock, &until) == 0;
}

static void nccl_abort(dptc_transport *base, dptc_status status, const char *reason)
{
    nccl_transport *t = (nccl_transport *)base;
    pthread_mutex_lock(&t->fail_lock);
    int first = !atomic_load(&t->aborted);
    if (first) {
        t->abort_status = status;
        dptc_fail(&t->abort_err, status, "%s", reason);
        atomic_store(&t->aborted, 1);
    }
    pthread_mutex_unlock(&t->fail_lock);
    if (!first)
        return;
    int locked = lock_within(&t->lock, ABORT_LOCK_WAIT_S);
    dptc_nccl_comm comm = atomic_exchange(&t->comm, NULL);
    if (comm) {
        dptc_error ignored;
        use_device(t, &ignored);
        t->api->ncclCommAbort(comm);  /* stops its kernels; nothing to report */
    }
    if (locked)
        pthread_mutex_unlock(&t->lock);
}

/* Frees what open made; t->comm is already destroyed or aborted. */
static void release(nccl_transport *t)
{
    const dptc_cuda_api *api = t->api;
    dptc_error ignored;
    use_device(t, &ignored);
    for (int s = 0; s < t->nstreams; s++) {
        for (int k = 0; k < RING; k++) {
            if (t->done[s][k].event)
                api->cudaEventDestroy(t->done[s][k].event);
            if (t->done[s][k].checked)
                api->cudaEventDestroy(t->done[s][k].checked);
        }
        if (t->host_records[s])
            api->cudaFreeHost(t->host_records[s]);
        if (t->device_records[s])
            api->cudaFree(t->device_records[s]);
        if (t->ready[s])
            api->cudaEventDestroy(t->ready[s]);
        if (t->streams[s])
            api->cudaStreamDestroy(t->streams[s]);
    }
    if (t->scratch)
        api->cudaFree(t->scratch);
    pthread_mutex_destroy(&t->lock);
    pthread_mutex_destroy(&t->fail_lock);
    free(t);
}

static void nccl_destroy(dptc_transport *base)
{
    nccl_transport *t = (nccl_transport *)base;
    /* The engine completed every collective first (dptc_group_destroy). */
    dptc_nccl_comm comm = atomic_exchange(&t->comm, NULL);
    if (comm) {
        dptc_error ignored;
        use_device(t, &ignored);
        t->api->ncclCommDestroy(comm);
    }
    release(t);
}

/* [Note: communicator setup with a deadline]
 * ncclCommInitRank blocks until every member has joined, with no timeout of
 * its own.  It runs on a thread of its own while open waits for it until the
 * group's deadline; past it, open fails with DPTC_ERR_TIMEOUT and leaves the
 * thread behind (stuck in NCCL's bootstrap, which a missing rank never
 * completes).  The setup record is shared by both and freed by the last one
 * to let go of it; a communicator made after the deadline is destroyed. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t done_cond;
    int done, abandoned;
    const dptc_cuda_api *api;
    int device, size, rank;
    dptc_nccl_unique_id id;
    dptc_nccl_comm comm;
    dptc_nccl_result result;
} setup;

static void setup_free(setup *s)
{
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->done_cond);
    free(s);
}

static void *setup_main(void *arg)
{
    setup *s = arg;
    dptc_nccl_comm comm = NULL;
    dptc_nccl_result result = s->api->cudaSetDevice(s->device) == DPTC_CUDA_SUCCESS
                                  ? s->api->ncclCommInitRank(&comm, s->size, s->id, s->rank)
                                  : 1; /* ncclUnhandledCudaError */
    pthread_mutex_lock(&s->lock);
    int abandoned = s->abandoned;
    s->comm = comm;
    s->result = result;
    s->done = 1;
    pthread_cond_signal(&s->done_cond);
    pthread_mutex_unlock(&s->lock);
    if (abandoned) {
        if (result == DPTC_NCCL_SUCCESS)
            s->api->ncclCommDestroy(comm);
        setup_free(s);
    }
    return NULL;
}

/* Makes t->comm, waiting at most timeout_s; see [Note: communicator setup
 * with a deadline]. */
static dptc_status init_comm(nccl_transport *t, double timeout_s, dptc_error *err)
{
    setup *s = calloc(1, sizeof *s);
    if (!s)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory making a NCCL communicator");
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->done_cond, NULL);
    s->api = t->api;
    s->device = t->device;
    s->size = t->size;
    s->rank = t->rank;
    s->id = t->id;
    pthread_t thread;
    int rc = pthread_create(&thread, NULL, setup_main, s);
    if (rc != 0) {
        setup_free(s);
        return dptc_fail(err, DPTC_ERR_SYSTEM, "could not start the NCCL setup thread: %s",
                         strerror(rc));
    }
    pthread_detach(thread);
    double deadline = dptc_now() + timeout_s;
    pthread_mutex_lock(&s->lock);
    while (!s->done && dptc_now() < deadline) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 50 * 1000 * 1000;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->done_cond, &s->lock, &until);
    }
    int done = s->done;
    s->abandoned = !done;
    pthread_mutex_unlock(&s->lock);
    if (!done)
        return dptc_fail(err, DPTC_ERR_TIMEOUT, "rank %d: the NCCL communicator of %d ranks was "
                         "not set up within %.1f s: a member did not reach its first collective "
                         "on CUDA tensors", t->rank, t->size, timeout_s);
    dptc_nccl_result result = s->result;
    t->comm = s->comm;
    setup_free(s);
    if (result != DPTC_NCCL_SUCCESS)
        return nccl_failed(t->api, result, "ncclCommInitRank", err);
    return DPTC_OK;
}

/* The order check's records of stream s: see [Note: collective order on
 * the device]. */
static dptc_status open_records(nccl_transport *t, int s, dptc_error *err)
{
    size_t size = (size_t)t->size;
    void *host = NULL, *device = NULL;
    CUDA(t, cudaHostAlloc(&host, RING * (1 + size) * sizeof(record),
                          DPTC_CUDA_HOST_ALLOC_DEFAULT), err);
    t->host_records[s] = host;
    CUDA(t, cudaMalloc(&device, RING * size * sizeof(record)), err);
    t->device_records[s] = device;
    for (size_t k = 0; k < RING; k++) {
        completion *c = &t->done[s][k];
        c->mine = t->host_records[s] + k * (1 + size);
        c->gathered = c->mine + 1;
        c->device_records = (char *)device + k * size * sizeof(record);
        CUDA(t, cudaEventCreateWithFlags(&c->checked, DPTC_CUDA_EVENT_DISABLE_TIMING), err);
    }
    return DPTC_OK;
}

static dptc_status open_resources(nccl_transport *t, double timeout_s, dptc_error *err)
{
    CHECK(use_device(t, err));
    for (int s = 0; s < t->nstreams; s++) {
        CUDA(t, cudaStreamCreateWithPriority(&t->streams[s], DPTC_CUDA_STREAM_NON_BLOCKING, 0),
             err);
        CUDA(t, cudaEventCreateWithFlags(&t->ready[s], DPTC_CUDA_EVENT_DISABLE_TIMING), err);
        for (int k = 0; k < RING; k++) {
            t->done[s][k].t = t;
            t->done[s][k].stream = s;
            CUDA(t, cudaEventCreateWithFlags(&t->done[s][k].event,
                                             DPTC_CUDA_EVENT_DISABLE_TIMING), err);
        }
        if (t->check_order)
            CHECK(open_records(t, s, err));
    }
    void *scratch = NULL;
    CUDA(t, cudaMalloc(&scratch, sizeof(int)), err);
    t->scratch = scratch;
    return init_comm(t, timeout_s, err);
}

static dptc_status nccl_open(const dptc_group_config *cfg, dptc_transport **out, dptc_error *err)
{
    const dptc_nccl_config *nc = cfg->transport_arg;
    if (!nc || !nc->api)
        return dptc_fail(err, DPTC_ERR_INVALID, "the NCCL transport needs its configuration "
                                                "(dptc_nccl_config with the loaded library)");
    nccl_transport *t = calloc(1, sizeof *t);
    if (!t)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory opening the NCCL transport");
    t->base.ops = &dptc_nccl_transport;
    t->api = nc->api;
    t->rank = cfg->rank;
    t->size = cfg->size;
    t->device = nc->device;
    t->id = nc->id;
    t->nstreams = cfg->nstreams;
    const char *check = getenv("DPTC_NCCL_CHECK_ORDER");
    t->check_order = !(check && strcmp(check, "0") == 0);
    pthread_mutex_init(&t->lock, NULL);
    pthread_mutex_init(&t->fail_lock, NULL);
    dptc_status status = open_resources(t, cfg->timeout_s, err);
    if (status != DPTC_OK) {
        release(t);
        return status;
    }
    *out = &t->base;
    return DPTC_OK;
}

const dptc_transport_ops dptc_nccl_transport = {
    .name = "nccl",
    .enqueues = 1,
    .open = nccl_open,
    .all_reduce = nccl_all_reduce,
    .reduce_scatter = nccl_reduce_scatter,
    .all_gather = nccl_all_gather,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};
