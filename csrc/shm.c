/* shm.c — the CPU transport between the ranks of one node.
 *
 * [Note: shared segment layout]
 * One POSIX shared-memory segment per group and node, created 0600 by local
 * rank 0 under a name that carries a random token agreed through the store,
 * and unlinked as soon as every local rank has mapped it (dptc/group.py), so
 * nothing is left in /dev/shm whatever happens to the processes afterwards.
 *
 *     header | peer[0] ... peer[local_size-1] | slots of rank 0 | ... 
 *
 * Each rank owns a peer record (its step counter, pid and the fingerprints of
 * its last collectives) and a slot region of two staging buffers of
 * slot_bytes each.  A rank writes only its own record and its own slots;
 * it reads everyone's.
 *
 * [Note: rounds and steps]
 * Every collective is cut into rounds.  A round is: write my staging buffer
 * (round % 2), post a step (counter += 1), wait until every peer has posted
 * the same step, then read peers' buffers.  Because a rank posts round r+1
 * only after it finished reading round r, a rank that passes the wait of
 * round r+1 knows that nobody still reads its buffer of round r: writing it
 * again in round r+2 is safe.  Two buffers per rank are therefore enough,
 * with a single wait per round.  The large all-reduce adds a second step
 * inside its round (reduce, post, wait, gather); the same argument holds.
 * Rounds are counted across collectives, so a collective never needs a
 * closing barrier.
 *
 * [Note: waiting]
 * Ranks may outnumber cores.  A waiter spins for a few microseconds, then
 * sleeps on the peer's counter with futex (the segment is shared, so no
 * FUTEX_PRIVATE_FLAG), announcing itself in the peer's `sleepers` word so
 * that posting costs a system call only when someone sleeps.  Sleeps are
 * bounded (20 ms) so the waiter checks its deadline, the abort flag and the
 * liveness of the peer it waits for.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "reduce.h"
#include "transport.h"

#define SHM_MAGIC 0x64707463u /* "dptc" */
#define SHM_VERSION 1u
#define CACHE_LINE 64
#define ALIGN_BYTES 4096
#define SLEEP_SLICE_S 0.02
#define REASON_MAX 512

typedef struct {
    uint32_t op, dtype, redop;
    int32_t root;
    uint64_t count;
    uint64_t seq;
    uint64_t shared;   /* 1 + id of the shared buffer the tensor lies in, or 0 */
    uint64_t offset;   /* the tensor's byte offset in that buffer */
} fingerprint;

typedef struct {
    _Alignas(CACHE_LINE) _Atomic uint32_t counter;  /* steps posted (futex word) */
    _Atomic uint32_t sleepers;                      /* waiters sleeping on counter */
    _Atomic int32_t pid;                            /* for liveness checks */
    fingerprint fp[2];                              /* indexed by seq % 2 */
} peer_record;

typedef struct {
    uint32_t magic, version;
    uint32_t local_size, node;
    uint64_t slot_bytes;
    _Atomic uint32_t aborted;       /* a dptc_status, 0 while healthy */
    _Atomic uint32_t aborter;       /* local rank that aborted first */
    char reason[REASON_MAX];
} shm_header;

typedef struct {
    dptc_transport base;
    dptc_bridge *bridge;          /* cross-node step, owned; NULL on one node */
    char name[256];
    /* Mapping */
    unsigned char *map;
    size_t map_bytes;
    shm_header *header;
    peer_record *peers;
    unsigned char *slots;         /* slots of rank 0; rank r at r * region */
    size_t slot_bytes;            /* one staging buffer */
    size_t region;                /* 2 * slot_bytes: one rank's slot region */
    /* Identity */
    int local_rank, local_size, node, nnodes;
    /* Progress: only the engine's executing thread touches these */
    uint32_t steps;               /* my counter value */
    uint64_t rounds;              /* rounds completed, across collectives */
    int unchecked;                /* the running collective's fingerprint is not compared yet */
    const dptc_shared *in_shared; /* the running collective's shared buffer, or NULL */
    size_t shared_offset;         /* its tensor's byte offset there */
    /* Shared buffers (see [Note: shared buffers] in engine.h); the table is
     * also touched by unshare from Python threads, hence the lock. */
    pthread_mutex_t shared_lock;
    dptc_shared **shared;
    int nshared, shared_cap;
    uint64_t next_shared_id;
    double spin_s;                /* how long to spin before sleeping */
} shm_transport;

/* ------------------------------------------------------------------ */
/* Layout */

/* memcpy that accepts the null pointers of empty tensors. */
static void copy(void *dst, const void *src, size_t nbytes)
{
    if (nbytes)
        memcpy(dst, src, nbytes);
}

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static size_t peers_offset(void) { return round_up(sizeof(shm_header), CACHE_LINE); }

static size_t slots_offset(int local_size)
{
    return round_up(peers_offset() + (size_t)local_size * sizeof(peer_record), ALIGN_BYTES);
}

static unsigned char *slot_buffer(shm_transport *s, int local, uint64_t round)
{
    return s->slots + (size_t)local * s->region + (size_t)(round % 2) * s->slot_bytes;
}

/* ------------------------------------------------------------------ */
/* Futex and liveness */

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

static int pid_alive(pid_t pid)
{
    if (pid <= 0)
        return 1;
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    /* A killed process whose parent has not reaped it yet is a zombie. */
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *close_paren = strrchr(buf, ')');
    if (close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X'))
        return 0;
    return 1;
}

static int step_reached(uint32_t value, uint32_t target)
{
    return (int32_t)(value - target) >= 0;
}

static void shm_abort(dptc_transport *t, dptc_status status, const char *reason);

/* The status and message of an abort recorded in the header. */
static dptc_status aborted_error(shm_transport *s, dptc_error *err)
{
    dptc_status status = (dptc_status)atomic_load(&s->header->aborted);
    int who = (int)atomic_load(&s->header->aborter);
    if (status == DPTC_ERR_MISMATCH || status == DPTC_ERR_TIMEOUT)
        return dptc_fail(err, status, "%s", s->header->reason);
    return dptc_fail(err, DPTC_ERR_PEER_LOST, "local rank %d of node %d aborted the group: %s",
                     who, s->node, s->header->reason);
}

static dptc_status wait_peer(shm_transport *s, int peer, uint32_t target, double deadline,
                             dptc_error *err)
{
    _Atomic uint32_t *word = &s->peers[peer].counter;
    if (step_reached(atomic_load(word), target))
        return DPTC_OK;
    double spin_until = dptc_now() + s->spin_s;
    unsigned spins = 0;
    while (dptc_now() < spin_until) {
        for (int i = 0; i < 64; i++) {
            if (step_reached(atomic_load_explicit(word, memory_order_acquire), target))
                return DPTC_OK;
            __builtin_ia32_pause();
        }
        if (++spins % 16 == 0 && atomic_load(&s->header->aborted))
            break;
    }
    dptc_status status = DPTC_OK;
    atomic_fetch_add(&s->peers[peer].sleepers, 1);
    for (;;) {
        uint32_t seen = atomic_load(word);
        if (step_reached(seen, target))
            break;
        if (atomic_load(&s->header->aborted)) {
            status = aborted_error(s, err);
            break;
        }
        double now = dptc_now();
        if (now >= deadline) {
            status = dptc_fail(err, DPTC_ERR_TIMEOUT,
                               "timed out waiting for global rank %d (local rank %d of node %d) "
                               "at step %u; it is alive but did not arrive: it may be stuck, "
                               "or issuing fewer collectives than this rank",
                               s->node * s->local_size + peer, peer, s->node, target);
            break;
        }
        if (!pid_alive(atomic_load(&s->peers[peer].pid))) {
            status = dptc_fail(err, DPTC_ERR_PEER_LOST,
                               "global rank %d (local rank %d of node %d, pid %d) exited while "
                               "this rank waited for it",
                               s->node * s->local_size + peer, peer, s->node,
                               (int)atomic_load(&s->peers[peer].pid));
            break;
        }
        double slice = deadline - now < SLEEP_SLICE_S ? deadline - now : SLEEP_SLICE_S;
        struct timespec ts = {(time_t)slice, (long)((slice - (double)(time_t)slice) * 1e9)};
        futex(word, FUTEX_WAIT, seen, &ts);
    }
    atomic_fetch_sub(&s->peers[peer].sleepers, 1);
    if (status != DPTC_OK && status != DPTC_ERR_PEER_LOST && !atomic_load(&s->header->aborted))
        shm_abort(&s->base, status, err->message);
    else if (status == DPTC_ERR_PEER_LOST && !atomic_load(&s->header->aborted))
        shm_abort(&s->base, status, err->message);
    return status;
}

/* Posts my next step and waits until every peer has posted it too. */
static dptc_status step(shm_transport *s, double deadline, dptc_error *err)
{
    uint32_t target = ++s->steps;
    peer_record *me = &s->peers[s->local_rank];
    atomic_store(&me->counter, target);
    if (atomic_load(&me->sleepers) > 0)
        futex(&me->counter, FUTEX_WAKE, INT_MAX, NULL);
    for (int p = 0; p < s->local_size; p++) {
        if (p == s->local_rank)
            continue;
        CHECK(wait_peer(s, p, target, deadline, err));
    }
    return DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* Fingerprints (see [Note: collective order] in engine.h) */

static void describe(const fingerprint *f, char *out, size_t n)
{
    if (f->shared) {
        char plain[160];
        fingerprint unshared = *f;
        unshared.shared = 0;
        describe(&unshared, plain, sizeof plain);
        snprintf(out, n, "%s on shared buffer #%llu at byte %llu", plain,
                 (unsigned long long)f->shared - 1, (unsigned long long)f->offset);
    } else if (f->op == DPTC_OP_BARRIER)
        snprintf(out, n, "barrier (collective #%llu)", (unsigned long long)f->seq);
    else if (f->op == DPTC_OP_BROADCAST)
        snprintf(out, n, "broadcast(%s, count=%llu, src=%d) (collective #%llu)",
                 dptc_dtype_name((dptc_dtype)f->dtype), (unsigned long long)f->count, f->root,
                 (unsigned long long)f->seq);
    else
        snprintf(out, n, "%s(%s, count=%llu, op=%s) (collective #%llu)",
                 dptc_op_name((dptc_op)f->op), dptc_dtype_name((dptc_dtype)f->dtype),
                 (unsigned long long)f->count, dptc_redop_name((dptc_redop)f->redop),
                 (unsigned long long)f->seq);
}

static void fingerprint_of(const shm_transport *s, const dptc_coll *c, uint64_t seq,
                           fingerprint *f)
{
    memset(f, 0, sizeof *f);
    f->op = (uint32_t)c->op;
    f->seq = seq;
    if (s->in_shared) {
        f->shared = s->in_shared->id + 1;
        f->offset = s->shared_offset;
    }
    if (c->op == DPTC_OP_BARRIER)
        return;
    f->dtype = (uint32_t)c->dtype;
    f->count = c->count;
    if (c->op == DPTC_OP_BROADCAST)
        f->root = c->root;
    if (c->op == DPTC_OP_ALL_REDUCE || c->op == DPTC_OP_REDUCE_SCATTER)
        f->redop = (uint32_t)c->redop;
}

/* Called after the first step of a collective: every peer's fingerprint of
 * this seq is written.  Every rank compares every peer, so every rank
 * raises the same error. */
static dptc_status check_fingerprints(shm_transport *s, uint64_t seq, dptc_error *err)
{
    const fingerprint *mine = &s->peers[s->local_rank].fp[seq % 2];
    for (int p = 0; p < s->local_size; p++) {
        const fingerprint *theirs = &s->peers[p].fp[seq % 2];
        if (memcmp(mine, theirs, sizeof *mine) == 0)
            continue;
        char a[256], b[256];
        describe(mine, a, sizeof a);
        describe(theirs, b, sizeof b);
        dptc_status status = dptc_fail(
            err, DPTC_ERR_MISMATCH,
            "collective mismatch: global rank %d issued %s but global rank %d issued %s; "
            "every rank must issue the same collectives in the same order",
            s->node * s->local_size + s->local_rank, a, s->node * s->local_size + p, b);
        /* Record it for peers that are still waiting, without overwriting the
         * message of whoever noticed first. */
        shm_abort(&s->base, status, err->message);
        return status;
    }
    return DPTC_OK;
}

/* Publishes my fingerprint and takes the collective's first step. */
static dptc_status first_step(shm_transport *s, const dptc_coll *c, uint64_t seq,
                              double deadline, dptc_error *err)
{
    fingerprint_of(s, c, seq, &s->peers[s->local_rank].fp[seq % 2]);
    CHECK(step(s, deadline, err));
    return check_fingerprints(s, seq, err);
}

/* Across nodes, the rank with my local index on every node compares its
 * fingerprint with mine through the bridge, before any data crosses. */
static dptc_status check_across_nodes(shm_transport *s, const dptc_coll *c, uint64_t seq,
                                      dptc_error *err)
{
    const fingerprint *f = &s->peers[s->local_rank].fp[seq % 2];
    char text[256];
    describe(f, text, sizeof text);
    dptc_status status = dptc_bridge_check(s->bridge, c->op, c->dtype, c->redop, c->count, seq,
                                           c->root, text, err);
    if (status != DPTC_OK)
        shm_abort(&s->base, status, err->message);
    return status;
}

/* The step that opens a round.  The collective's first round also compares
 * fingerprints, unless the cross-node check already did (shm_run). */
static dptc_status begin_round(shm_transport *s, const dptc_coll *c, uint64_t seq,
                               double deadline, dptc_error *err)
{
    if (!s->unchecked)
        return step(s, deadline, err);
    s->unchecked = 0;
    return first_step(s, c, seq, deadline, err);
}

/* ------------------------------------------------------------------ */
/* Algorithms */

static int is_avg(const dptc_coll *c) { return c->redop == DPTC_AVG; }

static dptc_redop base_redop(const dptc_coll *c) { return is_avg(c) ? DPTC_SUM : c->redop; }

/* Elements per round: what fits in one staging buffer, divided as asked,
 * kept a multiple of 64 bytes so that parts stay aligned. */
static size_t elements_per(size_t bytes, size_t elsize)
{
    size_t n = bytes / elsize;
    size_t align = CACHE_LINE / elsize ? CACHE_LINE / elsize : 1;
    return n >= align ? n / align * align : n;
}

static dptc_status bridge(shm_transport *s, dptc_bridge_op op, const dptc_coll *c,
                          const unsigned char *at, const unsigned char *at2, size_t count,
                          int root, dptc_error *err)
{
    unsigned char *base = s->slots + (size_t)s->local_rank * s->region;
    return dptc_bridge_call(s->bridge, op, c->dtype, base_redop(c), (size_t)(at - base),
                            at2 ? (size_t)(at2 - base) : 0, count, root, err);
}

/* Small all-reduce on one node: one step; every rank reduces everything. */
static dptc_status all_reduce_small(shm_transport *s, const dptc_coll *c, uint64_t seq,
                                    double deadline, dptc_error *err)
{
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    copy(slot_buffer(s, s->local_rank, s->rounds), c->input, bytes);
    CHECK(begin_round(s, c, seq, deadline, err));
    const void *srcs[DPTC_MAX_LOCAL];
    for (int p = 0; p < s->local_size; p++)
        srcs[p] = slot_buffer(s, p, s->rounds);
    s->rounds++;
    double scale = is_avg(c) ? 1.0 / (s->local_size * s->nnodes) : 1.0;
    return dptc_reduce(c->output, srcs, s->local_size, c->count, c->dtype, base_redop(c), scale);
}

/* The elements [lo, hi) of count that rank p of n reduces.  Parts are whole
 * multiples of 64 elements (so they start aligned), at most max_part; the
 * last ranks' parts may be short or empty. */
typedef struct {
    size_t lo, hi;
} span;

static span part_of(size_t count, int n, int p, size_t max_part)
{
    size_t part = round_up((count + (size_t)n - 1) / (size_t)n, CACHE_LINE);
    if (part > max_part)
        part = max_part;
    size_t lo = (size_t)p * part < count ? (size_t)p * part : count;
    size_t hi = lo + part < count ? lo + part : count;
    return (span){lo, hi};
}

/* Large all-reduce: per round, each rank stages a chunk, reduces its part
 * of every rank's chunk (then hands that part to the bridge across nodes),
 * and copies every reduced part out. */
static dptc_status all_reduce_large(shm_transport *s, const dptc_coll *c, uint64_t seq,
                                    double deadline, dptc_error *err)
{
    size_t elsize = dptc_dtype_size(c->dtype);
    int n = s->local_size;
    size_t part_max = elements_per(s->slot_bytes / (size_t)n, elsize);
    size_t chunk_max = part_max * (size_t)n;
    int first = 1;
    const unsigned char *in = c->input;
    unsigned char *out = c->output;
    double scale = is_avg(c) ? 1.0 / (n * s->nnodes) : 1.0;
    for (size_t done = 0; done < c->count || first;) {
        size_t chunk = c->count - done < chunk_max ? c->count - done : chunk_max;
        copy(slot_buffer(s, s->local_rank, s->rounds), in + done * elsize, chunk * elsize);
        CHECK(begin_round(s, c, seq, deadline, err));
        first = 0;
        span my = part_of(chunk, n, s->local_rank, part_max);
        size_t lo = my.lo, hi = my.hi;
        unsigned char *mine = slot_buffer(s, s->local_rank, s->rounds) + lo * elsize;
        if (hi > lo) {
            const void *srcs[DPTC_MAX_LOCAL];
            for (int p = 0; p < n; p++)
                srcs[p] = slot_buffer(s, p, s->rounds) + lo * elsize;
            double local_scale = s->bridge ? 1.0 : scale;
            CHECK(dptc_reduce(mine, srcs, n, hi - lo, c->dtype, base_redop(c), local_scale));
            if (s->bridge) {
                CHECK(bridge(s, DPTC_BRIDGE_ALL_REDUCE, c, mine, NULL, hi - lo, 0, err));
                if (scale != 1.0)
                    CHECK(dptc_scale(mine, hi - lo, c->dtype, scale));
            }
        }
        CHECK(step(s, deadline, err));
        for (int p = 0; p < n; p++) {
            span their = part_of(chunk, n, p, part_max);
            copy(out + (done + their.lo) * elsize, slot_buffer(s, p, s->rounds) + their.lo * elsize,
                 (their.hi - their.lo) * elsize);
        }
        s->rounds++;
        done += chunk;
    }
    return DPTC_OK;
}

/* All-reduce in place on a shared buffer (see [Note: shared buffers] in
 * engine.h): after the first step every rank's tensor is final input; rank r
 * reduces part r from every peer's memory into its own tensor, copies that
 * part into every peer's tensor, and the closing step tells everyone the
 * whole tensor is final.  Each rank reads and writes the tensor's size once.
 * Rank p touches only part p of any buffer between the two steps, so the
 * writes never meet. */
static dptc_status all_reduce_shared(shm_transport *s, const dptc_coll *c, uint64_t seq,
                                     double deadline, dptc_error *err)
{
    size_t elsize = dptc_dtype_size(c->dtype);
    int n = s->local_size;
    span my = part_of(c->count, n, s->local_rank, SIZE_MAX);
    size_t lo = my.lo, hi = my.hi;
    CHECK(begin_round(s, c, seq, deadline, err));
    if (hi > lo) {
        const void *srcs[DPTC_MAX_LOCAL];
        size_t at = s->shared_offset + lo * elsize;
        for (int p = 0; p < n; p++)
            srcs[p] = s->in_shared->base[p] + at;
        double scale = is_avg(c) ? 1.0 / n : 1.0;
        CHECK(dptc_reduce(s->in_shared->base[s->local_rank] + at, srcs, n, hi - lo, c->dtype,
                          base_redop(c), scale));
        for (int p = 0; p < n; p++)
            if (p != s->local_rank)
                memcpy(s->in_shared->base[p] + at, s->in_shared->base[s->local_rank] + at,
                       (hi - lo) * elsize);
    }
    return step(s, deadline, err);
}

static dptc_status all_reduce(shm_transport *s, const dptc_coll *c, uint64_t seq,
                              double deadline, dptc_error *err)
{
    if (s->in_shared)
        return all_reduce_shared(s, c, seq, deadline, err);
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    if (s->nnodes == 1 && (bytes <= 16384 || (s->local_size == 1 && bytes <= s->slot_bytes)))
        return all_reduce_small(s, c, seq, deadline, err);
    return all_reduce_large(s, c, seq, deadline, err);
}

static dptc_status broadcast(shm_transport *s, const dptc_coll *c, uint64_t seq,
                             double deadline, dptc_error *err)
{
    size_t elsize = dptc_dtype_size(c->dtype);
    size_t chunk_max = elements_per(s->slot_bytes, elsize);
    int root_node = c->root / s->local_size, root_local = c->root % s->local_size;
    int is_root = c->root == s->node * s->local_size + s->local_rank;
    unsigned char *buf = c->output;
    int first = 1;
    for (size_t done = 0; done < c->count || first;) {
        size_t chunk = c->count - done < chunk_max ? c->count - done : chunk_max;
        unsigned char *staged = slot_buffer(s, root_local, s->rounds);
        if (is_root)
            copy(staged, buf + done * elsize, chunk * elsize);
        if (s->bridge && s->local_rank == root_local && chunk > 0)
            CHECK(bridge(s, DPTC_BRIDGE_BROADCAST, c, staged, NULL, chunk, root_node, err));
        CHECK(begin_round(s, c, seq, deadline, err));
        first = 0;
        if (!is_root)
            copy(buf + done * elsize, staged, chunk * elsize);
        s->rounds++;
        done += chunk;
    }
    return DPTC_OK;
}

/* All-gather into shared outputs: each rank writes its input straight into
 * its block of every peer's output; nobody else writes that block. */
static dptc_status all_gather_shared(shm_transport *s, const dptc_coll *c, uint64_t seq,
                                     double deadline, dptc_error *err)
{
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    size_t at = s->shared_offset + (size_t)s->local_rank * bytes;
    CHECK(begin_round(s, c, seq, deadline, err));
    for (int p = 0; p < s->local_size; p++) {
        unsigned char *dst = s->in_shared->base[p] + at;
        if (dst != (const unsigned char *)c->input)  /* input may be my own block */
            memmove(dst, c->input, bytes);
    }
    return step(s, deadline, err);
}

/* Reduce-scatter from shared inputs: rank r reduces block r of every peer's
 * input into its output (which may be its own block r: nobody else reads
 * it); the closing step tells peers their inputs are free again. */
static dptc_status reduce_scatter_shared(shm_transport *s, const dptc_coll *c, uint64_t seq,
                                         double deadline, dptc_error *err)
{
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    size_t at = s->shared_offset + (size_t)s->local_rank * bytes;
    CHECK(begin_round(s, c, seq, deadline, err));
    const void *srcs[DPTC_MAX_LOCAL];
    for (int p = 0; p < s->local_size; p++)
        srcs[p] = s->in_shared->base[p] + at;
    double scale = is_avg(c) ? 1.0 / s->local_size : 1.0;
    CHECK(dptc_reduce(c->output, srcs, s->local_size, c->count, c->dtype, base_redop(c), scale));
    return step(s, deadline, err);
}

/* All-gather.  Per round, a window of each rank's input is staged; across
 * nodes, the bridge gathers the windows of my local index from every node
 * into my slot; then every rank copies every slot's windows to their place
 * (global rank g = node * local_size + local). */
static dptc_status all_gather(shm_transport *s, const dptc_coll *c, uint64_t seq,
                              double deadline, dptc_error *err)
{
    size_t elsize = dptc_dtype_size(c->dtype);
    size_t parts = s->bridge ? (size_t)s->nnodes + 1 : 1;
    size_t window_max = elements_per(s->slot_bytes / parts, elsize);
    const unsigned char *in = c->input;
    unsigned char *out = c->output;
    if (s->in_shared)
        return all_gather_shared(s, c, seq, deadline, err);
    int first = 1;
    for (size_t done = 0; done < c->count || first;) {
        size_t w = c->count - done < window_max ? c->count - done : window_max;
        unsigned char *mine = slot_buffer(s, s->local_rank, s->rounds);
        /* Across nodes a slot holds [nnodes gathered windows of w][my window]. */
        unsigned char *staged = mine + (size_t)s->nnodes * window_max * elsize;
        copy(s->bridge ? staged : mine, in + done * elsize, w * elsize);
        if (s->bridge && w > 0)
            CHECK(bridge(s, DPTC_BRIDGE_ALL_GATHER, c, staged, mine, w, 0, err));
        CHECK(begin_round(s, c, seq, deadline, err));
        first = 0;
        for (int node = 0; node < s->nnodes; node++)
            for (int p = 0; p < s->local_size; p++) {
                size_t g = (size_t)node * (size_t)s->local_size + (size_t)p;
                copy(out + (g * c->count + done) * elsize,
                       slot_buffer(s, p, s->rounds) + (size_t)node * w * elsize,
                       w * elsize);
            }
        s->rounds++;
        done += w;
    }
    return DPTC_OK;
}

/* Reduce-scatter.  Per round, a window of every rank's n input blocks is
 * staged; each rank reduces, for every node, the block of the rank with its
 * local index on that node into a scratch area; across nodes the bridge
 * reduces the scratch and each rank keeps its node's block. */
static dptc_status reduce_scatter(shm_transport *s, const dptc_coll *c, uint64_t seq,
                                  double deadline, dptc_error *err)
{
    size_t elsize = dptc_dtype_size(c->dtype);
    int n = s->local_size * s->nnodes;
    size_t window_max = elements_per(s->slot_bytes / (size_t)(n + s->nnodes), elsize);
    const unsigned char *in = c->input;
    unsigned char *out = c->output;
    double scale = is_avg(c) ? 1.0 / n : 1.0;
    if (s->in_shared)
        return reduce_scatter_shared(s, c, seq, deadline, err);
    int first = 1;
    for (size_t done = 0; done < c->count || first;) {
        size_t w = c->count - done < window_max ? c->count - done : window_max;
        unsigned char *mine = slot_buffer(s, s->local_rank, s->rounds);
        for (int g = 0; g < n; g++)
            copy(mine + (size_t)g * window_max * elsize,
                   in + ((size_t)g * c->count + done) * elsize, w * elsize);
        CHECK(begin_round(s, c, seq, deadline, err));
        first = 0;
        unsigned char *scratch = mine + (size_t)n * window_max * elsize;
        for (int node = 0; node < s->nnodes; node++) {
            size_t g = (size_t)node * (size_t)s->local_size + (size_t)s->local_rank;
            const void *srcs[DPTC_MAX_LOCAL];
            for (int p = 0; p < s->local_size; p++)
                srcs[p] = slot_buffer(s, p, s->rounds) + g * window_max * elsize;
            void *dst = s->bridge ? scratch + (size_t)node * w * elsize : out + done * elsize;
            if (w > 0)
                CHECK(dptc_reduce(dst, srcs, s->local_size, w, c->dtype, base_redop(c),
                                  s->bridge ? 1.0 : scale));
        }
        if (s->bridge && w > 0) {
            CHECK(bridge(s, DPTC_BRIDGE_ALL_REDUCE, c, scratch, NULL, w * (size_t)s->nnodes, 0,
                         err));
            unsigned char *block = scratch + (size_t)s->node * w * elsize;
            if (scale != 1.0)
                CHECK(dptc_scale(block, w, c->dtype, scale));
            copy(out + done * elsize, block, w * elsize);
        }
        s->rounds++;
        done += w;
    }
    return DPTC_OK;
}

static dptc_status barrier(shm_transport *s, const dptc_coll *c, uint64_t seq, double deadline,
                           dptc_error *err)
{
    CHECK(begin_round(s, c, seq, deadline, err));
    if (s->bridge) {
        /* A one-byte all-reduce across nodes, on my staging buffer. */
        dptc_coll one = {.op = DPTC_OP_ALL_REDUCE, .dtype = DPTC_UINT8, .redop = DPTC_MAX};
        unsigned char *mine = slot_buffer(s, s->local_rank, s->rounds);
        mine[0] = 1;
        if (s->local_rank == 0)
            CHECK(bridge(s, DPTC_BRIDGE_ALL_REDUCE, &one, mine, NULL, 1, 0, err));
        CHECK(step(s, deadline, err));
    }
    s->rounds++;
    return DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* Shared buffers (see [Note: shared buffers] in engine.h) */

static void shared_name(const shm_transport *s, int local, uint64_t id, char *out, size_t n)
{
    snprintf(out, n, "%s-r%d-b%llu", s->name, local, (unsigned long long)id);
}

/* Creates (0600, failing if the name exists) or opens the segment `name` of
 * `bytes` bytes and maps it.  An opened segment of another size means the
 * local ranks disagree on what they are mapping. */
static dptc_status map_shared(const char *name, int create, size_t bytes, unsigned char **out,
                              dptc_error *err)
{
    int fd = shm_open(name, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
    if (fd < 0)
        return dptc_fail(err, DPTC_ERR_SYSTEM, "shm_open(%s) failed: %s", name, strerror(errno));
    dptc_status status = DPTC_OK;
    if (create && ftruncate(fd, (off_t)bytes) != 0) {
        status = dptc_fail(err, DPTC_ERR_SYSTEM, "ftruncate of %s to %zu bytes failed: %s", name,
                           bytes, strerror(errno));
        goto exit;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != bytes) {
        status = dptc_fail(err, DPTC_ERR_SYSTEM,
                           "shared segment %s has %lld bytes, expected %zu: local ranks disagree "
                           "on its size", name, (long long)st.st_size, bytes);
        goto exit;
    }
    void *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        status = dptc_fail(err, DPTC_ERR_SYSTEM, "mmap of %zu shared bytes failed: %s", bytes,
                           strerror(errno));
        goto exit;
    }
    *out = map;
exit:
    close(fd);
    return status;
}

void dptc_shm_shared_free(dptc_shared *sh)
{
    for (int p = 0; p < sh->local_size; p++) {
        if (sh->base[p])
            munmap(sh->base[p], sh->bytes);
        sh->base[p] = NULL;
    }
}

static dptc_status remember_shared(shm_transport *s, dptc_shared *sh, dptc_error *err)
{
    dptc_status status = DPTC_OK;
    pthread_mutex_lock(&s->shared_lock);
    if (s->nshared == s->shared_cap) {
        int cap = s->shared_cap ? 2 * s->shared_cap : 8;
        dptc_shared **grown = realloc(s->shared, (size_t)cap * sizeof *grown);
        if (!grown) {
            status = dptc_fail(err, DPTC_ERR_NOMEM, "out of memory");
            goto unlock;
        }
        s->shared = grown;
        s->shared_cap = cap;
    }
    s->shared[s->nshared++] = sh;
unlock:
    pthread_mutex_unlock(&s->shared_lock);
    return status;
}

void dptc_shm_unshare(dptc_transport *t, dptc_shared *sh)
{
    shm_transport *s = (shm_transport *)t;
    pthread_mutex_lock(&s->shared_lock);
    for (int i = 0; i < s->nshared; i++)
        if (s->shared[i] == sh) {
            s->shared[i] = s->shared[--s->nshared];
            break;
        }
    pthread_mutex_unlock(&s->shared_lock);
}

/* The shared buffer that holds [ptr, ptr + bytes), or NULL. */
static const dptc_shared *find_shared(shm_transport *s, const void *ptr, size_t bytes,
                                      size_t *offset)
{
    const dptc_shared *found = NULL;
    uintptr_t p = (uintptr_t)ptr;
    pthread_mutex_lock(&s->shared_lock);
    for (int i = 0; i < s->nshared && !found; i++) {
        uintptr_t mine = (uintptr_t)s->shared[i]->base[s->local_rank];
        size_t size = s->shared[i]->bytes;
        if (p >= mine && bytes <= size && p - mine <= size - bytes) {
            found = s->shared[i];
            *offset = (size_t)(p - mine);
        }
    }
    pthread_mutex_unlock(&s->shared_lock);
    return found;
}

/* The shared buffer a collective can work in place on (see [Note: shared
 * buffers] in engine.h): the in-place all-reduce's tensor, the all-gather's
 * output, the reduce-scatter's input; on one node only. */
static const dptc_shared *find_shared_operand(shm_transport *s, const dptc_coll *c,
                                              size_t *offset)
{
    if (s->bridge || c->count == 0)
        return NULL;
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    switch (c->op) {
    case DPTC_OP_ALL_REDUCE:
        return c->input == c->output ? find_shared(s, c->input, bytes, offset) : NULL;
    case DPTC_OP_ALL_GATHER:
        return find_shared(s, c->output, bytes * (size_t)s->local_size, offset);
    case DPTC_OP_REDUCE_SCATTER:
        return find_shared(s, c->input, bytes * (size_t)s->local_size, offset);
    default:
        return NULL;
    }
}

/* DPTC_OP_SHARE: every local rank creates its segment, waits for all, maps
 * its peers', waits again, and removes its name, so nothing is left in
 * /dev/shm.  On failure every rank removes every name: a peer that died
 * before removing its own leaves nothing behind either. */
static dptc_status share(shm_transport *s, const dptc_coll *c, uint64_t seq, double deadline,
                         dptc_error *err)
{
    dptc_shared *sh = c->output;
    memset(sh, 0, sizeof *sh);
    sh->id = s->next_shared_id++;
    sh->bytes = round_up(c->count ? c->count : 1, ALIGN_BYTES);
    sh->local_rank = s->local_rank;
    sh->local_size = s->local_size;
    char name[300];
    shared_name(s, s->local_rank, sh->id, name, sizeof name);
    dptc_status status = map_shared(name, 1, sh->bytes, &sh->base[s->local_rank], err);
    if (status != DPTC_OK) {
        shm_abort(&s->base, status, err->message);
        return status;
    }
    CHECK_GOTO(begin_round(s, c, seq, deadline, err), status, fail);
    for (int p = 0; p < s->local_size; p++) {
        if (p == s->local_rank)
            continue;
        shared_name(s, p, sh->id, name, sizeof name);
        CHECK_GOTO(map_shared(name, 0, sh->bytes, &sh->base[p], err), status, fail);
    }
    CHECK_GOTO(step(s, deadline, err), status, fail);
    shared_name(s, s->local_rank, sh->id, name, sizeof name);
    shm_unlink(name);
    CHECK_GOTO(remember_shared(s, sh, err), status, fail);
    return DPTC_OK;
fail:
    for (int p = 0; p < s->local_size; p++) {
        shared_name(s, p, sh->id, name, sizeof name);
        shm_unlink(name);
    }
    dptc_shm_shared_free(sh);
    if (!atomic_load(&s->header->aborted))
        shm_abort(&s->base, status, err->message);
    return status;
}

static dptc_status shm_run(dptc_transport *t, const dptc_coll *c, uint64_t seq,
                           double deadline, dptc_error *err)
{
    shm_transport *s = (shm_transport *)t;
    if (atomic_load(&s->header->aborted))
        return aborted_error(s, err);
    s->unchecked = 1;
    s->in_shared = find_shared_operand(s, c, &s->shared_offset);
    if (s->bridge) {
        /* Locally, then across nodes, before the first byte moves: a bridged
         * step issued by mismatched nodes could otherwise wait in gloo. */
        CHECK(first_step(s, c, seq, deadline, err));
        CHECK(check_across_nodes(s, c, seq, err));
        s->unchecked = 0;
    }
    switch (c->op) {
    case DPTC_OP_ALL_REDUCE:
        return all_reduce(s, c, seq, deadline, err);
    case DPTC_OP_BROADCAST:
        return broadcast(s, c, seq, deadline, err);
    case DPTC_OP_ALL_GATHER:
        return all_gather(s, c, seq, deadline, err);
    case DPTC_OP_REDUCE_SCATTER:
        return reduce_scatter(s, c, seq, deadline, err);
    case DPTC_OP_BARRIER:
        return barrier(s, c, seq, deadline, err);
    case DPTC_OP_SHARE:
        return share(s, c, seq, deadline, err);
    default:
        return dptc_fail(err, DPTC_ERR_INVALID, "unknown collective %d", (int)c->op);
    }
}

/* ------------------------------------------------------------------ */
/* Abort, open, close */

static void shm_abort(dptc_transport *t, dptc_status status, const char *reason)
{
    shm_transport *s = (shm_transport *)t;
    uint32_t expected = 0;
    if (atomic_compare_exchange_strong(&s->header->aborted, &expected, (uint32_t)DPTC_ERR_ABORTED)) {
        snprintf(s->header->reason, REASON_MAX, "%s", reason ? reason : "aborted");
        atomic_store(&s->header->aborter, (uint32_t)s->local_rank);
        atomic_store(&s->header->aborted, (uint32_t)status);
    }
    /* Wake everyone sleeping on any counter of this node. */
    for (int p = 0; p < s->local_size; p++)
        futex(&s->peers[p].counter, FUTEX_WAKE, INT_MAX, NULL);
}

static void shm_destroy(dptc_transport *t)
{
    shm_transport *s = (shm_transport *)t;
    /* Shared buffers belong to their owners; only forget them. */
    free(s->shared);
    pthread_mutex_destroy(&s->shared_lock);
    if (s->map)
        munmap(s->map, s->map_bytes);
    if (s->bridge)
        dptc_bridge_free(s->bridge);
    free(s);
}

static const dptc_transport_ops shm_ops = {
    .name = "shm",
    .run = shm_run,
    .abort = shm_abort,
    .destroy = shm_destroy,
};

void dptc_shm_set_bridge(dptc_transport *t, dptc_bridge *bridge)
{
    shm_transport *s = (shm_transport *)t;
    if (s->bridge)
        dptc_bridge_free(s->bridge);
    s->bridge = bridge;
}

void dptc_shm_unlink(dptc_transport *t)
{
    shm_transport *s = (shm_transport *)t;
    if (s->name[0])
        shm_unlink(s->name);
}

void *dptc_shm_slot(dptc_transport *t, int local, size_t *bytes)
{
    shm_transport *s = (shm_transport *)t;
    if (local < 0 || local >= s->local_size)
        return NULL;
    *bytes = s->region;
    return s->slots + (size_t)local * s->region;
}

static dptc_status map_segment(shm_transport *s, const dptc_group_config *cfg, dptc_error *err)
{
    size_t bytes = slots_offset(cfg->local_size) + (size_t)cfg->local_size * s->region;
    CHECK(map_shared(cfg->shm_name, cfg->create, bytes, &s->map, err));
    s->map_bytes = bytes;
    return DPTC_OK;
}

dptc_status dptc_shm_open(const dptc_group_config *cfg, dptc_transport **out, dptc_error *err)
{
    dptc_status status = DPTC_OK;
    if (cfg->local_size < 1 || cfg->local_size > DPTC_MAX_LOCAL || cfg->local_rank < 0 ||
        cfg->local_rank >= cfg->local_size)
        return dptc_fail(err, DPTC_ERR_INVALID,
                         "local rank %d of %d is out of range (1..%d ranks per node)",
                         cfg->local_rank, cfg->local_size, DPTC_MAX_LOCAL);
    shm_transport *s = calloc(1, sizeof *s);
    if (!s)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory");
    s->base.ops = &shm_ops;
    pthread_mutex_init(&s->shared_lock, NULL);
    s->local_rank = cfg->local_rank;
    s->local_size = cfg->local_size;
    s->node = cfg->node;
    s->nnodes = cfg->nnodes;
    s->slot_bytes = round_up(cfg->slot_bytes < 65536 ? 65536 : cfg->slot_bytes, ALIGN_BYTES);
    s->region = 2 * s->slot_bytes;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    /* Spinning only helps when every rank can own a core. */
    s->spin_s = cpus >= cfg->local_size ? 50e-6 : 2e-6;
    snprintf(s->name, sizeof s->name, "%s", cfg->shm_name);
    CHECK_GOTO(map_segment(s, cfg, err), status, fail);
    s->header = (shm_header *)s->map;
    s->peers = (peer_record *)(s->map + peers_offset());
    s->slots = s->map + slots_offset(cfg->local_size);
    if (cfg->create) {
        s->header->local_size = (uint32_t)cfg->local_size;
        s->header->node = (uint32_t)cfg->node;
        s->header->slot_bytes = s->slot_bytes;
        s->header->version = SHM_VERSION;
        atomic_thread_fence(memory_order_release);
        s->header->magic = SHM_MAGIC;
    } else if (s->header->magic != SHM_MAGIC || s->header->version != SHM_VERSION ||
               s->header->local_size != (uint32_t)cfg->local_size ||
               s->header->slot_bytes != s->slot_bytes) {
        status = dptc_fail(err, DPTC_ERR_SYSTEM,
                           "shared segment %s was not created for this group (magic %x, "
                           "%u local ranks, %llu slot bytes)", cfg->shm_name, s->header->magic,
                           s->header->local_size, (unsigned long long)s->header->slot_bytes);
        goto fail;
    }
    atomic_store(&s->peers[s->local_rank].pid, (int32_t)getpid());
    *out = &s->base;
    return DPTC_OK;
fail:
    shm_destroy(&s->base);
    return status;
}
