/* engine.c — a group's ordered streams of work, their progress threads, work
 * handles, deadlines and abort.  It knows transports only through their
 * table (transport.h).
 *
 * [Note: one executor per stream]
 * A stream's collectives run strictly in issue order, one at a time.  Work
 * submitted asynchronously goes to the stream's FIFO, drained by the
 * stream's progress thread (started on first use).  A blocking call
 * (dptc_group_run) that finds the stream's queue empty and nothing running
 * executes on the calling thread instead: no thread hop, which is what keeps
 * small collectives at a few microseconds.  `busy` says whether some thread
 * is executing on the stream; it and the queue are guarded by the stream's
 * `lock`.  Streams share nothing but the group's failure record.
 *
 * Failure is sticky: the first failed collective records its status and
 * message in the group, aborts the transport (waking the peers) and fails
 * every later collective of every stream at once with the same message.
 *
 * [Note: group and work lifetime]
 * Groups are reference counted: the owner (module.c's Group object) holds
 * one reference and every work holds one, so a work can abort its group
 * (dptc_work_wait giving up) even while another thread destroys it.
 * dptc_group_destroy closes the group — fails queued work, waits for running
 * work, joins the threads, destroys the transport — and drops the owner's
 * reference; the memory goes with the last work.
 */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "transport.h"

/* How long a wait that gave up (and aborted the group) still waits for its
 * work to stop before it reports the work unfinished. */
#define ABORT_GRACE_S 5.0
#define WAIT_SLICE_S 0.05

/* Work states; the state word is also the futex waiters sleep on. */
enum {
    WORK_QUEUED = 0,   /* submitted, not yet picked up */
    WORK_RUNNING = 1,  /* an executor is moving its bytes */
    WORK_DONE = 2,     /* finished; status and err are final */
};

struct dptc_work {
    _Atomic int refcount;
    _Atomic uint32_t state;
    dptc_status status;
    dptc_error err;
    dptc_coll coll;           /* outputs/output_counts point into `pieces` */
    void *pieces;             /* copies of the issuer's output arrays, owned */
    dptc_group *group;        /* a reference, see [Note: group and work lifetime] */
    int stream;
    uint64_t seq;
    dptc_work *next;          /* queue link, guarded by the stream's lock */
    /* Issued by a transport that enqueues (see [Note: device transports] in
     * transport.h): what the progress thread waits on, and by when. */
    int issued;
    dptc_completion done;
    double deadline;
    _Atomic int watched;      /* see [Note: watched works] in engine.h */
};

typedef struct {
    dptc_group *group;
    int index;
    pthread_mutex_t lock;
    pthread_cond_t wake;      /* signals the progress thread */
    pthread_cond_t idle;      /* signals that busy dropped */
    dptc_work *head, *tail;
    int busy;
    int thread_started;
    pthread_t thread;
    uint64_t next_seq;        /* numbers the stream's collectives in issue order */
} stream;

struct dptc_group {
    _Atomic int refcount;

    /* Identity */
    int rank, size, nstreams;
    double timeout_s;
    int enqueues;             /* the transport's, see [Note: device transports] */

    /* The transport, and the failure record; guarded by lock.  transport
     * is NULL once the group is closed. */
    pthread_mutex_t lock;
    dptc_transport *transport;
    _Atomic int failed;
    dptc_status fail_status;
    dptc_error fail_err;
    _Atomic int stopping;     /* dptc_group_destroy has begun */

    stream streams[DPTC_MAX_STREAMS];
};

/* ------------------------------------------------------------------ */
/* Group references */

static void group_retain(dptc_group *g) { atomic_fetch_add(&g->refcount, 1); }

static void group_release(dptc_group *g)
{
    if (atomic_fetch_sub(&g->refcount, 1) != 1)
        return;
    for (int i = 0; i < g->nstreams; i++) {
        pthread_mutex_destroy(&g->streams[i].lock);
        pthread_cond_destroy(&g->streams[i].wake);
        pthread_cond_destroy(&g->streams[i].idle);
    }
    pthread_mutex_destroy(&g->lock);
    free(g);
}

/* Records the first failure and aborts the transport, so that every peer
 * wakes up and fails too. */
static void group_fail(dptc_group *g, dptc_status status, const dptc_error *err)
{
    pthread_mutex_lock(&g->lock);
    if (!atomic_load(&g->failed)) {
        g->fail_status = status;
        memcpy(&g->fail_err, err, sizeof g->fail_err);
        atomic_store(&g->failed, 1);
    }
    if (g->transport)
        g->transport->ops->abort(g->transport, status, err->message);
    pthread_mutex_unlock(&g->lock);
}

/* ------------------------------------------------------------------ */
/* Work handles */

static dptc_work *work_new(dptc_group *g, int stream_index, const dptc_coll *c)
{
    dptc_work *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->coll = *c;
    if (c->noutputs > 0) {
        size_t n = (size_t)c->noutputs;
        w->pieces = malloc(n * (sizeof(void *) + sizeof(size_t)));
        if (!w->pieces) {
            free(w);
            return NULL;
        }
        void **outputs = w->pieces;
        size_t *counts = (size_t *)(outputs + n);
        memcpy(outputs, c->outputs, n * sizeof *outputs);
        memcpy(counts, c->output_counts, n * sizeof *counts);
        w->coll.outputs = outputs;
        w->coll.output_counts = counts;
    }
    atomic_init(&w->refcount, 1);
    atomic_init(&w->state, WORK_QUEUED);
    w->group = g;
    w->stream = stream_index;
    group_retain(g);
    return w;
}

void dptc_work_retain(dptc_work *w) { atomic_fetch_add(&w->refcount, 1); }

void dptc_work_release(dptc_work *w)
{
    if (!w || atomic_fetch_sub(&w->refcount, 1) != 1)
        return;
    group_release(w->group);
    free(w->pieces);
    free(w);
}

int dptc_work_is_completed(const dptc_work *w)
{
    return atomic_load(&((dptc_work *)w)->state) == WORK_DONE;
}

void *dptc_work_device_completion(const dptc_work *w)
{
    return w->issued && !dptc_work_is_completed(w) ? w->done.handle : NULL;
}

/* See [Note: watched works] in engine.h. */
static _Atomic uint32_t watched_count;

void dptc_work_watch(dptc_work *w) { atomic_store(&w->watched, 1); }

uint32_t dptc_watched_count(void) { return atomic_load(&watched_count); }

void dptc_watched_wake(void)
{
    atomic_fetch_add(&watched_count, 1);
    syscall(SYS_futex, (uint32_t *)&watched_count, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

void dptc_watched_sleep(uint32_t seen, double timeout_s)
{
    double deadline = dptc_now() + timeout_s;
    while (atomic_load(&watched_count) == seen) {
        struct timespec ts, *limit = NULL;
        if (timeout_s >= 0) {
            double left = deadline - dptc_now();
            if (left <= 0)
                return;
            ts.tv_sec = (time_t)left;
            ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
            limit = &ts;
        }
        syscall(SYS_futex, (uint32_t *)&watched_count, FUTEX_WAIT_PRIVATE, seen, limit, NULL, 0);
    }
}

static void work_finish(dptc_work *w, dptc_status status, const dptc_error *err)
{
    w->status = status;
    if (status != DPTC_OK && err)
        memcpy(&w->err, err, sizeof w->err);
    atomic_store(&w->state, WORK_DONE);
    syscall(SYS_futex, (uint32_t *)&w->state, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    if (atomic_load(&w->watched))
        dptc_watched_wake();
}

/* Sleeps until w is done or `deadline` passes; with `interruptible`, also
 * returns when the thread is interrupted.  Returns 1 when done. */
static int work_sleep_until(dptc_work *w, double deadline, int interruptible)
{
    for (int spin = 0; spin < 2000; spin++) {
        if (atomic_load_explicit(&w->state, memory_order_acquire) == WORK_DONE)
            return 1;
        dptc_cpu_relax();
    }
    for (;;) {
        uint32_t state = atomic_load(&w->state);
        if (state == WORK_DONE)
            return 1;
        double left = deadline - dptc_now();
        if (left <= 0 || (interruptible && dptc_interrupted()))
            return 0;
        double slice = left < WAIT_SLICE_S ? left : WAIT_SLICE_S;
        struct timespec ts = {0, (long)(slice * 1e9)};
        syscall(SYS_futex, (uint32_t *)&w->state, FUTEX_WAIT_PRIVATE, state, &ts, NULL, 0);
    }
}

dptc_status dptc_work_wait(dptc_work *w, double timeout_s, dptc_error *err)
{
    if (work_sleep_until(w, dptc_now() + timeout_s, 1)) {
        if (w->status != DPTC_OK && err)
            memcpy(err, &w->err, sizeof *err);
        return w->status;
    }
    /* Giving up: abort first, so that queued work fails and running work
     * stops at its next wait; only then may the caller think of releasing
     * the work's memory (see [Note: tensors across the C boundary]). */
    dptc_error mine;
    dptc_status status;
    if (dptc_interrupted())
        status = dptc_fail(&mine, DPTC_ERR_INTERRUPTED,
                           "rank %d was interrupted while waiting for %s (collective #%llu of "
                           "stream %d)", w->group->rank, dptc_op_name(w->coll.op),
                           (unsigned long long)w->seq, w->stream);
    else
        status = dptc_fail(&mine, DPTC_ERR_TIMEOUT,
                           "rank %d: %s (collective #%llu of stream %d) did not complete within "
                           "%.1f s", w->group->rank, dptc_op_name(w->coll.op),
                           (unsigned long long)w->seq, w->stream, timeout_s);
    group_fail(w->group, status, &mine);
    work_sleep_until(w, dptc_now() + ABORT_GRACE_S, 0);
    if (err)
        memcpy(err, &mine, sizeof *err);
    return status;
}

/* ------------------------------------------------------------------ */
/* Executing */

static dptc_collective_fn collective_of(const dptc_transport_ops *ops, dptc_op op)
{
    switch (op) {
    case DPTC_OP_ALL_REDUCE:
        return ops->all_reduce;
    case DPTC_OP_BROADCAST:
        return ops->broadcast;
    case DPTC_OP_ALL_GATHER:
        return ops->all_gather;
    case DPTC_OP_REDUCE_SCATTER:
        return ops->reduce_scatter;
    case DPTC_OP_BARRIER:
        return ops->barrier;
    default:
        return NULL;
    }
}

/* Calls the transport's operation for c, leaving its order in *order and
 * what to wait on in *done.  The transport stays open meanwhile: destroy
 * waits for every busy stream, and a transport that enqueues is called with
 * the stream's lock held. */
static dptc_status start(dptc_group *g, int stream_index, const dptc_coll *c, uint64_t seq,
                         dptc_order *order, dptc_completion *done, dptc_error *err)
{
    dptc_transport *t = g->transport;
    *order = (dptc_order){.stream = stream_index, .seq = seq,
                          .deadline = dptc_now() + g->timeout_s};
    *done = (dptc_completion){NULL, NULL};
    if (c->op == DPTC_OP_CALL)
        return c->call(t, order, c->call_arg, err);
    dptc_collective_fn run = collective_of(t->ops, c->op);
    return run ? run(t, order, c, done, err)
               : dptc_fail(err, DPTC_ERR_INVALID, "transport %s has no %s", t->ops->name,
                           dptc_op_name(c->op));
}

/* Runs one collective on the calling thread, the stream's executor; records
 * a failure in g. */
static dptc_status execute(dptc_group *g, int stream_index, const dptc_coll *c, uint64_t seq,
                           dptc_error *err)
{
    CHECK(dptc_group_failure(g, err));
    dptc_order order;
    dptc_completion done;
    dptc_status status = start(g, stream_index, c, seq, &order, &done, err);
    if (status == DPTC_OK && done.wait)
        status = done.wait(done.handle, order.deadline, err);
    if (status != DPTC_OK)
        group_fail(g, status, err);
    return status;
}

/* Issues w with a transport that enqueues, on the calling thread (see
 * [Note: device transports] in transport.h); the stream's lock is held, so
 * issue order is seq order. */
static dptc_status issue(dptc_group *g, dptc_work *w, dptc_error *err)
{
    CHECK(dptc_group_failure(g, err));
    dptc_order order;
    dptc_status status = start(g, w->stream, &w->coll, w->seq, &order, &w->done, err);
    w->deadline = order.deadline;
    return status;
}

/* The progress thread's part of an issued work: its completion. */
static dptc_status complete_issued(dptc_group *g, dptc_work *w, dptc_error *err)
{
    dptc_status status = w->done.wait ? w->done.wait(w->done.handle, w->deadline, err) : DPTC_OK;
    if (status != DPTC_OK)
        group_fail(g, status, err);
    return status;
}

static void *progress_main(void *arg)
{
    stream *s = arg;
    dptc_group *g = s->group;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while ((!s->head || s->busy) && !atomic_load(&g->stopping))
            pthread_cond_wait(&s->wake, &s->lock);
        if (!s->head || s->busy)
            break;  /* stopping */
        dptc_work *w = s->head;
        s->head = w->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->lock);

        dptc_error err;
        atomic_store(&w->state, WORK_RUNNING);
        dptc_status status = w->issued ? complete_issued(g, w, &err)
                                       : execute(g, s->index, &w->coll, w->seq, &err);
        work_finish(w, status, &err);
        dptc_work_release(w);

        pthread_mutex_lock(&s->lock);
        s->busy = 0;
        pthread_cond_broadcast(&s->idle);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

static dptc_status check_stream(const dptc_group *g, int stream_index, dptc_error *err)
{
    if (stream_index < 0 || stream_index >= g->nstreams)
        return dptc_fail(err, DPTC_ERR_INVALID, "stream must be in [0, %d), got %d", g->nstreams,
                         stream_index);
    return DPTC_OK;
}

int dptc_has_pieces(const dptc_coll *c)
{
    return c->op == DPTC_OP_ALL_GATHER && c->noutputs > 1;
}

uint64_t dptc_pieces_digest(const dptc_coll *c)
{
    if (!dptc_has_pieces(c))
        return 0;
    uint64_t h = 1469598103934665603ull;
    for (int j = 0; j < c->noutputs; j++) {
        uint64_t v = (uint64_t)c->output_counts[j];
        for (int b = 0; b < 8; b++) {
            h ^= (v >> (8 * b)) & 0xff;
            h *= 1099511628211ull;
        }
    }
    return h & 0x7fffffffffffffffull;
}

dptc_status dptc_group_submit(dptc_group *g, int stream_index, const dptc_coll *c,
                              dptc_work **out, dptc_error *err)
{
    CHECK(check_stream(g, stream_index, err));
    dptc_work *w = work_new(g, stream_index, c);
    if (!w)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory queueing a collective");
    stream *s = &g->streams[stream_index];
    dptc_status status = DPTC_OK;
    pthread_mutex_lock(&s->lock);
    if (atomic_load(&g->stopping)) {
        status = dptc_fail(err, DPTC_ERR_ABORTED, "the process group was destroyed");
        goto unlock;
    }
    if (!s->thread_started) {
        int rc = pthread_create(&s->thread, NULL, progress_main, s);
        if (rc != 0) {
            status = dptc_fail(err, DPTC_ERR_SYSTEM, "could not start the progress thread: %s",
                               strerror(rc));
            goto unlock;
        }
        s->thread_started = 1;
    }
    w->seq = s->next_seq++;
    if (g->enqueues) {
        dptc_error failure;
        dptc_status issued = issue(g, w, &failure);
        if (issued != DPTC_OK) {
            /* The work carries the failure; nothing is queued. */
            group_fail(g, issued, &failure);
            work_finish(w, issued, &failure);
            goto unlock;
        }
        w->issued = 1;
    }
    dptc_work_retain(w); /* the queue's reference */
    if (s->tail)
        s->tail->next = w;
    else
        s->head = w;
    s->tail = w;
    pthread_cond_signal(&s->wake);
unlock:
    pthread_mutex_unlock(&s->lock);
    if (status != DPTC_OK) {
        dptc_work_release(w);
        return status;
    }
    *out = w;
    return DPTC_OK;
}

dptc_status dptc_group_run(dptc_group *g, int stream_index, const dptc_coll *c,
                           dptc_work **unfinished, dptc_error *err)
{
    *unfinished = NULL;
    CHECK(check_stream(g, stream_index, err));
    stream *s = &g->streams[stream_index];
    pthread_mutex_lock(&s->lock);
    /* A transport that enqueues issues in dptc_group_submit; see below. */
    if (!g->enqueues && !s->head && !s->busy && !atomic_load(&g->stopping)) {
        s->busy = 1;
        uint64_t seq = s->next_seq++;
        pthread_mutex_unlock(&s->lock);
        dptc_status status = execute(g, stream_index, c, seq, err);
        pthread_mutex_lock(&s->lock);
        s->busy = 0;
        if (s->head)
            pthread_cond_signal(&s->wake);
        pthread_cond_broadcast(&s->idle);
        pthread_mutex_unlock(&s->lock);
        return status;
    }
    pthread_mutex_unlock(&s->lock);
    dptc_work *w;
    CHECK(dptc_group_submit(g, stream_index, c, &w, err));
    dptc_status status = dptc_work_wait(w, dptc_group_wait_deadline(g), err);
    if (dptc_work_is_completed(w))
        dptc_work_release(w);
    else
        *unfinished = w;
    return status;
}

/* ------------------------------------------------------------------ */
/* Life cycle */

dptc_status dptc_group_create(const dptc_transport_ops *transport, const dptc_group_config *config,
                              dptc_group **out, dptc_error *err)
{
    if (config->size < 1 || config->rank < 0 || config->rank >= config->size ||
        config->nnodes < 1 || config->local_size < 1 ||
        config->local_size * config->nnodes != config->size ||
        config->rank != config->node * config->local_size + config->local_rank)
        return dptc_fail(err, DPTC_ERR_INVALID,
                         "inconsistent group shape: rank %d of %d, local rank %d of %d, node %d "
                         "of %d (dptc needs rank = node * local_size + local_rank)",
                         config->rank, config->size, config->local_rank, config->local_size,
                         config->node, config->nnodes);
    if (config->nstreams < 1 || config->nstreams > DPTC_MAX_STREAMS)
        return dptc_fail(err, DPTC_ERR_INVALID, "streams must be in [1, %d], got %d",
                         DPTC_MAX_STREAMS, config->nstreams);
    if (!(config->timeout_s > 0))
        return dptc_fail(err, DPTC_ERR_INVALID, "timeout must be > 0, got %g", config->timeout_s);
    dptc_group *g = calloc(1, sizeof *g);
    if (!g)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory");
    atomic_init(&g->refcount, 1);
    g->rank = config->rank;
    g->size = config->size;
    g->nstreams = config->nstreams;
    g->timeout_s = config->timeout_s;
    g->enqueues = transport->enqueues;
    pthread_mutex_init(&g->lock, NULL);
    for (int i = 0; i < g->nstreams; i++) {
        stream *s = &g->streams[i];
        s->group = g;
        s->index = i;
        pthread_mutex_init(&s->lock, NULL);
        pthread_cond_init(&s->wake, NULL);
        pthread_cond_init(&s->idle, NULL);
    }
    dptc_status status = transport->open(config, &g->transport, err);
    if (status != DPTC_OK) {
        group_release(g);
        return status;
    }
    *out = g;
    return DPTC_OK;
}

dptc_transport *dptc_group_transport(dptc_group *g) { return g->transport; }

void dptc_group_retain(dptc_group *g) { group_retain(g); }

void dptc_group_release(dptc_group *g) { group_release(g); }

void dptc_group_abort(dptc_group *g, const char *reason)
{
    dptc_error err;
    dptc_fail(&err, DPTC_ERR_ABORTED, "%s", reason);
    group_fail(g, DPTC_ERR_ABORTED, &err);
}

/* Fails what never started on s, waits for what runs, joins the thread. */
static void stream_stop(stream *s)
{
    pthread_mutex_lock(&s->lock);
    pthread_cond_broadcast(&s->wake);
    while (s->head) {
        dptc_work *w = s->head;
        s->head = w->next;
        dptc_error err;
        dptc_status status = DPTC_ERR_ABORTED;
        if (w->issued) {
            /* Already on the device: it is over only when its completion
             * says so (or its deadline passes, failing the group). */
            status = complete_issued(s->group, w, &err);
        } else {
            dptc_fail(&err, DPTC_ERR_ABORTED, "the process group was destroyed before "
                                              "collective #%llu of stream %d ran",
                      (unsigned long long)w->seq, s->index);
        }
        work_finish(w, status, &err);
        dptc_work_release(w);
    }
    s->tail = NULL;
    while (s->busy)
        pthread_cond_wait(&s->idle, &s->lock);
    int joined = s->thread_started;
    s->thread_started = 0;
    pthread_mutex_unlock(&s->lock);
    if (joined)
        pthread_join(s->thread, NULL);
}

void dptc_group_destroy(dptc_group *g)
{
    if (!g)
        return;
    atomic_store(&g->stopping, 1);
    for (int i = 0; i < g->nstreams; i++)
        stream_stop(&g->streams[i]);
    pthread_mutex_lock(&g->lock);
    dptc_transport *t = g->transport;
    g->transport = NULL;
    pthread_mutex_unlock(&g->lock);
    if (t)
        t->ops->destroy(t);
    group_release(g);
}

dptc_status dptc_group_failure(dptc_group *g, dptc_error *err)
{
    if (!atomic_load(&g->failed))
        return DPTC_OK;
    pthread_mutex_lock(&g->lock);
    dptc_status status = g->fail_status;
    memcpy(err, &g->fail_err, sizeof *err);
    pthread_mutex_unlock(&g->lock);
    return status;
}

int dptc_group_rank(const dptc_group *g) { return g->rank; }

int dptc_group_size(const dptc_group *g) { return g->size; }

int dptc_group_streams(const dptc_group *g) { return g->nstreams; }

double dptc_group_timeout(const dptc_group *g) { return g->timeout_s; }
double dptc_group_wait_deadline(const dptc_group *g) { return g->timeout_s * 2 + 1; }
