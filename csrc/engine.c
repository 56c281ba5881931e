/* engine.c — a group's ordered work queue, its progress thread, work handles,
 * deadlines and abort.
 *
 * [Note: one executor at a time]
 * A group's collectives run strictly in issue order, one at a time.  Work
 * submitted asynchronously goes to a FIFO drained by the group's progress
 * thread (started on first use).  A blocking call (dptc_group_run) that finds
 * the queue empty and nothing running executes on the calling thread instead:
 * no thread hop, which is what keeps small collectives at a few microseconds.
 * `busy` says whether some thread is executing; it and the queue are guarded
 * by `lock`.
 *
 * Failure is sticky: the first failed collective records its status and
 * message in the group, aborts the transport (waking the peers) and fails
 * every later collective at once with the same message.
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
    dptc_coll coll;
    uint64_t seq;
    dptc_work *next;          /* queue link, guarded by the group's lock */
};

struct dptc_group {
    /* Identity */
    int rank, size;
    double timeout_s;
    dptc_transport *transport;

    /* Queue and executor (see [Note: one executor at a time]) */
    pthread_mutex_t lock;
    pthread_cond_t wake;      /* signals the progress thread */
    pthread_cond_t idle;      /* signals blocking callers that busy dropped */
    dptc_work *head, *tail;
    int busy;
    int stopping;
    int thread_started;
    pthread_t thread;
    uint64_t next_seq;        /* numbers collectives in issue order */

    /* Sticky failure */
    _Atomic int failed;
    dptc_status fail_status;
    dptc_error fail_err;
};

/* ------------------------------------------------------------------ */
/* Work handles */

static dptc_work *work_new(const dptc_coll *c)
{
    dptc_work *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    atomic_init(&w->refcount, 1);
    atomic_init(&w->state, WORK_QUEUED);
    w->coll = *c;
    return w;
}

void dptc_work_retain(dptc_work *w) { atomic_fetch_add(&w->refcount, 1); }

void dptc_work_release(dptc_work *w)
{
    if (w && atomic_fetch_sub(&w->refcount, 1) == 1)
        free(w);
}

int dptc_work_is_completed(const dptc_work *w)
{
    return atomic_load(&((dptc_work *)w)->state) == WORK_DONE;
}

static void work_finish(dptc_work *w, dptc_status status, const dptc_error *err)
{
    w->status = status;
    if (status != DPTC_OK && err)
        memcpy(&w->err, err, sizeof w->err);
    atomic_store(&w->state, WORK_DONE);
    syscall(SYS_futex, (uint32_t *)&w->state, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

dptc_status dptc_work_wait(dptc_work *w, double timeout_s, dptc_error *err)
{
    double deadline = dptc_now() + timeout_s;
    for (int spin = 0; spin < 2000; spin++) {
        if (atomic_load_explicit(&w->state, memory_order_acquire) == WORK_DONE)
            goto done;
        __builtin_ia32_pause();
    }
    for (;;) {
        uint32_t state = atomic_load(&w->state);
        if (state == WORK_DONE)
            break;
        double left = deadline - dptc_now();
        if (left <= 0)
            return dptc_fail(err, DPTC_ERR_TIMEOUT,
                             "work (%s, collective #%llu) did not complete within %.1f s",
                             dptc_op_name(w->coll.op), (unsigned long long)w->seq, timeout_s);
        double slice = left < 0.05 ? left : 0.05;
        struct timespec ts = {0, (long)(slice * 1e9)};
        syscall(SYS_futex, (uint32_t *)&w->state, FUTEX_WAIT_PRIVATE, state, &ts, NULL, 0);
    }
done:
    if (w->status != DPTC_OK && err)
        memcpy(err, &w->err, sizeof *err);
    return w->status;
}

/* ------------------------------------------------------------------ */
/* Executing */

static void group_fail(dptc_group *g, dptc_status status, const dptc_error *err)
{
    pthread_mutex_lock(&g->lock);
    if (!atomic_load(&g->failed)) {
        g->fail_status = status;
        memcpy(&g->fail_err, err, sizeof g->fail_err);
        atomic_store(&g->failed, 1);
    }
    pthread_mutex_unlock(&g->lock);
    g->transport->ops->abort(g->transport, status, err->message);
}

/* Runs one collective on the calling thread; records a failure in g. */
static dptc_status execute(dptc_group *g, const dptc_coll *c, uint64_t seq, dptc_error *err)
{
    if (atomic_load(&g->failed)) {
        memcpy(err, &g->fail_err, sizeof *err);
        return g->fail_status;
    }
    double deadline = dptc_now() + g->timeout_s;
    dptc_status status = g->transport->ops->run(g->transport, c, seq, deadline, err);
    if (status != DPTC_OK)
        group_fail(g, status, err);
    return status;
}

static void *progress_main(void *arg)
{
    dptc_group *g = arg;
    pthread_mutex_lock(&g->lock);
    for (;;) {
        while ((!g->head || g->busy) && !g->stopping)
            pthread_cond_wait(&g->wake, &g->lock);
        if (!g->head || (g->stopping && g->busy))
            break;
        dptc_work *w = g->head;
        g->head = w->next;
        if (!g->head)
            g->tail = NULL;
        g->busy = 1;
        pthread_mutex_unlock(&g->lock);

        dptc_error err;
        atomic_store(&w->state, WORK_RUNNING);
        dptc_status status = g->stopping ? dptc_fail(&err, DPTC_ERR_ABORTED,
                                                     "the process group was destroyed")
                                         : execute(g, &w->coll, w->seq, &err);
        work_finish(w, status, &err);
        dptc_work_release(w);

        pthread_mutex_lock(&g->lock);
        g->busy = 0;
        pthread_cond_broadcast(&g->idle);
    }
    pthread_mutex_unlock(&g->lock);
    return NULL;
}

dptc_status dptc_group_submit(dptc_group *g, const dptc_coll *c, dptc_work **out, dptc_error *err)
{
    dptc_work *w = work_new(c);
    if (!w)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory queueing a collective");
    dptc_status status = DPTC_OK;
    pthread_mutex_lock(&g->lock);
    if (g->stopping) {
        status = dptc_fail(err, DPTC_ERR_ABORTED, "the process group was destroyed");
        goto unlock;
    }
    if (!g->thread_started) {
        if (pthread_create(&g->thread, NULL, progress_main, g) != 0) {
            status = dptc_fail(err, DPTC_ERR_SYSTEM, "could not start the progress thread: %s",
                               strerror(errno));
            goto unlock;
        }
        g->thread_started = 1;
    }
    w->seq = g->next_seq++;
    dptc_work_retain(w); /* the queue's reference */
    if (g->tail)
        g->tail->next = w;
    else
        g->head = w;
    g->tail = w;
    pthread_cond_signal(&g->wake);
unlock:
    pthread_mutex_unlock(&g->lock);
    if (status != DPTC_OK) {
        dptc_work_release(w);
        return status;
    }
    *out = w;
    return DPTC_OK;
}

dptc_status dptc_group_run(dptc_group *g, const dptc_coll *c, dptc_error *err)
{
    pthread_mutex_lock(&g->lock);
    if (!g->head && !g->busy && !g->stopping) {
        g->busy = 1;
        uint64_t seq = g->next_seq++;
        pthread_mutex_unlock(&g->lock);
        dptc_status status = execute(g, c, seq, err);
        pthread_mutex_lock(&g->lock);
        g->busy = 0;
        if (g->head)
            pthread_cond_signal(&g->wake);
        pthread_cond_broadcast(&g->idle);
        pthread_mutex_unlock(&g->lock);
        return status;
    }
    pthread_mutex_unlock(&g->lock);
    dptc_work *w;
    CHECK(dptc_group_submit(g, c, &w, err));
    /* The queued work ahead of us has its own deadlines; allow for them. */
    dptc_status status = dptc_work_wait(w, g->timeout_s * 2 + 1, err);
    dptc_work_release(w);
    return status;
}

/* ------------------------------------------------------------------ */
/* Life cycle */

dptc_status dptc_group_create(const dptc_group_config *config, dptc_group **out, dptc_error *err)
{
    if (config->size < 1 || config->rank < 0 || config->rank >= config->size ||
        config->nnodes < 1 || config->local_size * config->nnodes != config->size ||
        config->rank != config->node * config->local_size + config->local_rank)
        return dptc_fail(err, DPTC_ERR_INVALID,
                         "inconsistent group shape: rank %d of %d, local rank %d of %d, node %d "
                         "of %d (dptc needs rank = node * local_size + local_rank)",
                         config->rank, config->size, config->local_rank, config->local_size,
                         config->node, config->nnodes);
    if (!(config->timeout_s > 0))
        return dptc_fail(err, DPTC_ERR_INVALID, "timeout must be > 0, got %g", config->timeout_s);
    dptc_group *g = calloc(1, sizeof *g);
    if (!g)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory");
    g->rank = config->rank;
    g->size = config->size;
    g->timeout_s = config->timeout_s;
    pthread_mutex_init(&g->lock, NULL);
    pthread_cond_init(&g->wake, NULL);
    pthread_cond_init(&g->idle, NULL);
    dptc_status status = dptc_shm_open(config, &g->transport, err);
    if (status != DPTC_OK) {
        pthread_mutex_destroy(&g->lock);
        pthread_cond_destroy(&g->wake);
        pthread_cond_destroy(&g->idle);
        free(g);
        return status;
    }
    *out = g;
    return DPTC_OK;
}

void dptc_group_set_bridge(dptc_group *g, void *bridge)
{
    dptc_shm_set_bridge(g->transport, bridge);
}

dptc_status dptc_group_share(dptc_group *g, size_t nbytes, dptc_shared *out, dptc_error *err)
{
    dptc_coll c = {.op = DPTC_OP_SHARE, .dtype = DPTC_UINT8, .output = out, .count = nbytes};
    return dptc_group_run(g, &c, err);
}

void dptc_group_unshare(dptc_group *g, dptc_shared *sh) { dptc_shm_unshare(g->transport, sh); }

void dptc_shared_free(dptc_shared *sh) { dptc_shm_shared_free(sh); }

void dptc_group_unlink(dptc_group *g) { dptc_shm_unlink(g->transport); }

void dptc_group_abort(dptc_group *g, const char *reason)
{
    dptc_error err;
    dptc_fail(&err, DPTC_ERR_ABORTED, "%s", reason);
    group_fail(g, DPTC_ERR_ABORTED, &err);
}

void dptc_group_destroy(dptc_group *g)
{
    if (!g)
        return;
    pthread_mutex_lock(&g->lock);
    g->stopping = 1;
    pthread_cond_broadcast(&g->wake);
    /* Fail what never started: nobody will run it. */
    while (g->head) {
        dptc_work *w = g->head;
        g->head = w->next;
        dptc_error err;
        dptc_fail(&err, DPTC_ERR_ABORTED, "the process group was destroyed before "
                                          "collective #%llu ran", (unsigned long long)w->seq);
        work_finish(w, DPTC_ERR_ABORTED, &err);
        dptc_work_release(w);
    }
    g->tail = NULL;
    while (g->busy)
        pthread_cond_wait(&g->idle, &g->lock);
    int joined = g->thread_started;
    pthread_mutex_unlock(&g->lock);
    if (joined)
        pthread_join(g->thread, NULL);
    g->transport->ops->destroy(g->transport);
    pthread_mutex_destroy(&g->lock);
    pthread_cond_destroy(&g->wake);
    pthread_cond_destroy(&g->idle);
    free(g);
}

int dptc_group_rank(const dptc_group *g) { return g->rank; }

int dptc_group_size(const dptc_group *g) { return g->size; }

double dptc_group_timeout(const dptc_group *g) { return g->timeout_s; }

void *dptc_group_slot(dptc_group *g, int local, size_t *bytes)
{
    return dptc_shm_slot(g->transport, local, bytes);
}
