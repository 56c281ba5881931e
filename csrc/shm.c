/* shm.c — the CPU transport between the ranks of one node.
 *
 * [Note: shared segment layout]
 * One shared segment per group and node (see [Note: segments] for how it is
 * made and found), created by local rank 0:
 *
 *     header | records of stream 0 (one per local rank) | ... of stream S-1
 *            | slots of stream 0 (one region per local rank) | ... 
 *
 * Each rank owns, per stream, a peer record (its step counter, pid and the
 * fingerprints of its last collectives) and a slot region of two staging
 * buffers of slot_bytes each.  A rank writes only its own records and its
 * own slots; it reads everyone's.  The header holds the abort record.
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
 * closing barrier.  The price: a rank's return from a collective does not
 * free its slots, as peers may still read its last round's buffer until
 * they post their next step.  Only collectives write the slots (see [Note:
 * slots between collectives]).
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
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"
#include "shm.h"

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

#define SHM_MAGIC 0x64707463u /* "dptc" */
#define SHM_VERSION 3u
#define CACHE_LINE 64
#define ALIGN_BYTES 4096
#define SLEEP_SLICE_S 0.02
#define REASON_MAX 512
/* See [Note: all-reduce rounds]. */
#define ALL_REDUCE_ROUND_BYTES (256 * 1024)

/* The first piece counts a fingerprint shows in a mismatch's message. */
#define FINGERPRINT_PIECES 4

typedef struct {
    uint32_t op, dtype, redop;
    int32_t root;
    uint64_t count;
    uint64_t seq;
    uint64_t shared;   /* 1 + id of the shared buffer the tensor lies in, or 0 */
    uint64_t offset;   /* the tensor's byte offset in that buffer */
    /* An all-gather into several outputs places each rank's elements by its pieces, so ranks
     * must agree on them, not only on the count (see [Note: several pieces]); 0 elsewhere. */
    uint64_t npieces;                    /* its number of outputs */
    uint64_t pieces_digest;              /* of every piece's count (dptc_pieces_digest) */
    uint64_t piece[FINGERPRINT_PIECES];  /* the first counts, for the message */
} fingerprint;

/* The collectives whose data goes through the staging slots, each staged
 * its own way (see [Note: staging]). */
typedef enum {
    STAGED_ALL_REDUCE,
    STAGED_ALL_GATHER,
    STAGED_REDUCE_SCATTER,
    STAGED_BROADCAST,
    STAGED_OPS
} staged_op;

/* One rank's record in one stream's channel. */
typedef struct {
    _Alignas(CACHE_LINE) _Atomic uint32_t counter;  /* steps posted (futex word) */
    _Atomic uint32_t sleepers;                      /* waiters sleeping on counter */
    _Atomic int32_t pid;                            /* for liveness checks */
    _Atomic uint32_t left;                          /* 1 once it closed the group, see
                                                       [Note: a rank that leaves] */
    _Atomic int32_t share_fd;                       /* memfd of the shared buffer being made */
    _Atomic uint32_t staging[STAGED_OPS];           /* local rank 0's choice for the next large
                                                       collective, see [Note: staging] */
    fingerprint fp[2];                              /* indexed by seq % 2 */
} peer_record;

/* [Note: abort record]
 * The first rank to abort claims `claimed`, writes the reason and its local
 * rank, and only then publishes the status in `aborted` (release): a peer
 * that sees `aborted` non-zero (acquire) reads a complete reason. */
typedef struct {
    uint32_t magic, version;
    uint32_t local_size, node, nstreams;
    uint64_t slot_bytes;
    _Atomic uint32_t claimed;       /* 1 once some rank is writing the abort record */
    _Atomic uint32_t aborted;       /* a dptc_status, 0 while healthy; published last */
    _Atomic uint32_t aborter;       /* local rank that aborted first */
    char reason[REASON_MAX];
} shm_header;

typedef struct shm_transport shm_transport;

/* How many of the current staging's costs its median takes (see [Note:
 * staging]). */
#define STAGING_RECENT 5

/* How local rank 0 chooses the staging of one kind of collective (see
 * [Note: staging]). */
typedef struct {
    double cost[2];               /* seconds per byte of each staging: the current one's
                                     median over `recent`, the other's last try; 0: unmeasured */
    double recent[STAGING_RECENT];  /* the current one's last costs, a ring */
    uint32_t nrecent;             /* how many of them are filled */
    double best;                  /* the current one's lowest cost since it became current */
    uint32_t current;             /* the staging that measured cheaper */
    uint32_t since_trial;         /* measured collectives since the other one was tried */
    uint32_t trial_every;         /* measured collectives between two tries */
} staging_chooser;

/* [Note: channels]
 * Each stream of the group (see [Note: streams] in engine.h) has its own
 * channel: its own peer records (step counters, fingerprints) and staging
 * slots in the segment, its own round count and its own bridge.  Only the
 * stream's executing thread touches a channel, so streams never wait for
 * each other; they share the abort record and the table of shared buffers. */
typedef struct {
    shm_transport *s;
    int index;
    peer_record *peers;           /* local_size records */
    unsigned char *slots;         /* slots of local rank 0; rank r at r * region */
    dptc_bridge *bridge;          /* cross-node step, owned; NULL on one node */
    /* Progress */
    uint32_t steps;               /* my counter value */
    uint64_t rounds;              /* rounds completed, across collectives */
    int unchecked;                /* the running collective's fingerprint is not compared yet */
    const dptc_shared *in_shared; /* the running collective's shared buffer, or NULL */
    size_t shared_offset;         /* its tensor's byte offset there */
    uint64_t shared_made;         /* shared buffers made on this channel (their ids) */
    staging_chooser choosers[STAGED_OPS];     /* local rank 0's, see [Note: staging] */
    _Atomic uint64_t staged[STAGED_OPS][2];   /* large collectives staged each way
                                                 (dptc_shm_stagings) */
    _Atomic uint64_t sentinel_fills;          /* see [Note: slots between collectives] */
} channel;

struct shm_transport {
    dptc_transport base;
    char name[256];               /* /dev/shm name, or "" for a memfd segment */
    int fd;                       /* the creator's memfd until unlinked, else -1 */
    /* Mapping */
    unsigned char *map;
    size_t map_bytes;
    shm_header *header;
    size_t slot_bytes;            /* one staging buffer */
    size_t region;                /* 2 * slot_bytes: one rank's slot region */
    /* Identity */
    int local_rank, local_size, node, nnodes, nstreams;
    int *global_ranks;            /* of every group rank, for messages */
    channel channels[DPTC_MAX_STREAMS];
    /* Shared buffers (see [Note: shared buffers] in shm.h); the table is
     * touched by every stream and by unshare from Python threads, hence the
     * lock. */
    pthread_mutex_t shared_lock;
    dptc_shared **shared;
    int nshared, shared_cap;
    double spin_s;                /* how long to spin before sleeping */
    size_t all_reduce_round;      /* staged bytes per rank in a large all-reduce's
                                     round, see [Note: all-reduce rounds] */
    dptc_shm_staging staging;     /* DPTC_SHM_STAGING_AUTO, or the one to use always */
    /* Tests only: the byte local rank 0 fills every slot with between two
     * collectives, or -1; see [Note: slots between collectives]. */
    _Atomic int sentinel;
};

/* ------------------------------------------------------------------ */
/* Layout */

/* memcpy that accepts the null pointers of empty tensors. */
static void copy(void *dst, const void *src, size_t nbytes)
{
    if (nbytes)
        memcpy(dst, src, nbytes);
}

/* Copies with non-temporal stores where the processor has them (x86-64:
 * SSE2), so that the bytes go to memory without taking their lines into this
 * core's cache, nor needing a peer's copy of a line invalidated before each
 * store (see [Note: staging]); a plain copy elsewhere.  The closing fence
 * orders the stores before the step posted next. */
static void copy_streaming(void *dst, const void *src, size_t nbytes)
{
#if defined(__x86_64__) && defined(__SSE2__)
    unsigned char *d = dst;
    const unsigned char *from = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > nbytes)
        head = nbytes;
    copy(d, from, head);
    d += head;
    from += head;
    nbytes -= head;
    size_t body = nbytes & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(from + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(from + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(from + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(from + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    copy(d + body, from + body, nbytes - body);
    _mm_sfence();
#else
    copy(dst, src, nbytes);
#endif
}

typedef void (*copy_fn)(void *dst, const void *src, size_t nbytes);

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static size_t peers_offset(void) { return round_up(sizeof(shm_header), CACHE_LINE); }

static size_t slots_offset(int local_size, int nstreams)
{
    return round_up(peers_offset() + (size_t)(local_size * nstreams) * sizeof(peer_record),
                    ALIGN_BYTES);
}

static unsigned char *slot_buffer(channel *ch, int local, uint64_t round)
{
    return ch->slots + (size_t)local * ch->s->region + (size_t)(round % 2) * ch->s->slot_bytes;
}

/* The global rank of local rank `local` of this node, for messages. */
static int global_rank(const shm_transport *s, int local)
{
    return s->global_ranks[s->node * s->local_size + local];
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

/* The status and message of an abort recorded in the header (see [Note:
 * abort record]); call once `aborted` was seen non-zero. */
static dptc_status aborted_error(shm_transport *s, dptc_error *err)
{
    dptc_status status = (dptc_status)atomic_load_explicit(&s->header->aborted,
                                                           memory_order_acquire);
    int who = (int)atomic_load(&s->header->aborter);
    /* A mismatch is every rank's error alike; anything else (a timeout, an
     * interrupt, a failed step) happened to the aborter: here, a peer is lost. */
    if (status == DPTC_ERR_MISMATCH)
        return dptc_fail(err, status, "%s", s->header->reason);
    /* Named by global rank: a group's local ranks and node index are its own,
     * not the launcher's (global rank 3 is local rank 1 of node 0 in a group
     * [2, 3] of a job's second node).  Messages say whose node they mean, as
     * they travel to other nodes (the store's abort key, dptc/group.py). */
    return dptc_fail(err, DPTC_ERR_PEER_LOST, "global rank %d aborted the group: %s",
                     global_rank(s, who), s->header->reason);
}

static dptc_status wait_peer(channel *ch, int peer, uint32_t target, double deadline,
                             dptc_error *err)
{
    shm_transport *s = ch->s;
    _Atomic uint32_t *word = &ch->peers[peer].counter;
    if (step_reached(atomic_load(word), target))
        return DPTC_OK;
    double spin_until = dptc_now() + s->spin_s;
    unsigned spins = 0;
    while (dptc_now() < spin_until) {
        for (int i = 0; i < 64; i++) {
            if (step_reached(atomic_load_explicit(word, memory_order_acquire), target))
                return DPTC_OK;
            dptc_cpu_relax();
        }
        if (++spins % 16 == 0 && atomic_load(&s->header->aborted))
            break;
    }
    dptc_status status = DPTC_OK;
    atomic_fetch_add(&ch->peers[peer].sleepers, 1);
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
                               "timed out waiting for global rank %d (pid %d, on the node of "
                               "global rank %d) at step %u of stream %d; it is alive but did "
                               "not arrive: it may be stuck, or issuing fewer collectives than "
                               "global rank %d", global_rank(s, peer),
                               (int)atomic_load(&ch->peers[peer].pid),
                               global_rank(s, s->local_rank), target, ch->index,
                               global_rank(s, s->local_rank));
            break;
        }
        if (dptc_interrupted()) {
            status = dptc_fail(err, DPTC_ERR_INTERRUPTED,
                               "global rank %d was interrupted while waiting in a collective",
                               global_rank(s, s->local_rank));
            break;
        }
        if (atomic_load(&ch->peers[peer].left) &&
            !step_reached(atomic_load(word), target)) {
            status = dptc_fail(err, DPTC_ERR_PEER_LOST,
                               "global rank %d (pid %d) closed the group "
                               "(destroy_process_group, or its process exiting) while global "
                               "rank %d, on its node, waited for it at step %u of stream %d",
                               global_rank(s, peer), (int)atomic_load(&ch->peers[peer].pid),
                               global_rank(s, s->local_rank), target, ch->index);
            break;
        }
        if (!pid_alive(atomic_load(&ch->peers[peer].pid))) {
            status = dptc_fail(err, DPTC_ERR_PEER_LOST,
                               "global rank %d (pid %d) exited while global rank %d, on its "
                               "node, waited for it", global_rank(s, peer),
                               (int)atomic_load(&ch->peers[peer].pid),
                               global_rank(s, s->local_rank));
            break;
        }
        double slice = deadline - now < SLEEP_SLICE_S ? deadline - now : SLEEP_SLICE_S;
        struct timespec ts = {(time_t)slice, (long)((slice - (double)(time_t)slice) * 1e9)};
        futex(word, FUTEX_WAIT, seen, &ts);
    }
    atomic_fetch_sub(&ch->peers[peer].sleepers, 1);
    if (status != DPTC_OK && !atomic_load(&s->header->aborted))
        shm_abort(&s->base, status, err->message);
    return status;
}

/* Posts my next step and waits until every peer has posted it too. */
static dptc_status step(channel *ch, double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    uint32_t target = ++ch->steps;
    peer_record *me = &ch->peers[s->local_rank];
    atomic_store(&me->counter, target);
    if (atomic_load(&me->sleepers) > 0)
        futex(&me->counter, FUTEX_WAKE, INT_MAX, NULL);
    for (int p = 0; p < s->local_size; p++) {
        if (p == s->local_rank)
            continue;
        CHECK(wait_peer(ch, p, target, deadline, err));
    }
    return DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* Fingerprints (see [Note: collective order] in engine.h) */

/* ", pieces [2, 4]" (the first FINGERPRINT_PIECES, then how many), or "". */
static void describe_pieces(const fingerprint *f, char *out, size_t n)
{
    out[0] = '\0';
    if (f->npieces == 0)
        return;
    size_t used = (size_t)snprintf(out, n, ", pieces [");
    uint64_t shown = f->npieces < FINGERPRINT_PIECES ? f->npieces : FINGERPRINT_PIECES;
    for (uint64_t j = 0; j < shown && used < n; j++)
        used += (size_t)snprintf(out + used, n - used, "%s%llu", j ? ", " : "",
                                 (unsigned long long)f->piece[j]);
    if (used < n && f->npieces > shown)
        used += (size_t)snprintf(out + used, n - used, ", ... %llu pieces",
                                 (unsigned long long)f->npieces);
    if (used < n)
        snprintf(out + used, n - used, "]");
}

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
    else if (f->op == DPTC_OP_ALL_REDUCE || f->op == DPTC_OP_REDUCE_SCATTER)
        snprintf(out, n, "%s(%s, count=%llu, op=%s) (collective #%llu)",
                 dptc_op_name((dptc_op)f->op), dptc_dtype_name((dptc_dtype)f->dtype),
                 (unsigned long long)f->count, dptc_redop_name((dptc_redop)f->redop),
                 (unsigned long long)f->seq);
    else {  /* no reduce op to name: an all-gather, or a transport's own step */
        char pieces[128];
        describe_pieces(f, pieces, sizeof pieces);
        snprintf(out, n, "%s(%s, count=%llu%s) (collective #%llu)",
                 dptc_op_name((dptc_op)f->op), dptc_dtype_name((dptc_dtype)f->dtype),
                 (unsigned long long)f->count, pieces, (unsigned long long)f->seq);
    }
}

static void fingerprint_of(channel *ch, const dptc_coll *c, uint64_t seq,
                           fingerprint *f)
{
    memset(f, 0, sizeof *f);
    f->op = (uint32_t)c->op;
    f->seq = seq;
    if (ch->in_shared) {
        f->shared = ch->in_shared->id + 1;
        f->offset = ch->shared_offset;
    }
    if (c->op == DPTC_OP_BARRIER)
        return;
    f->dtype = (uint32_t)c->dtype;
    f->count = c->count;
    if (c->op == DPTC_OP_BROADCAST)
        f->root = c->root;
    if (c->op == DPTC_OP_ALL_REDUCE || c->op == DPTC_OP_REDUCE_SCATTER)
        f->redop = (uint32_t)c->redop;
    if (dptc_has_pieces(c)) {
        f->npieces = (uint64_t)c->noutputs;
        f->pieces_digest = dptc_pieces_digest(c);
        for (int j = 0; j < c->noutputs && j < FINGERPRINT_PIECES; j++)
            f->piece[j] = (uint64_t)c->output_counts[j];
    }
}

/* Called after the first step of a collective: every peer's fingerprint of
 * this seq is written.  Every rank compares every peer, so every rank
 * raises the same error. */
static dptc_status check_fingerprints(channel *ch, uint64_t seq, dptc_error *err)
{
    shm_transport *s = ch->s;
    const fingerprint *mine = &ch->peers[s->local_rank].fp[seq % 2];
    for (int p = 0; p < s->local_size; p++) {
        const fingerprint *theirs = &ch->peers[p].fp[seq % 2];
        if (memcmp(mine, theirs, sizeof *mine) == 0)
            continue;
        char a[256], b[256];
        describe(mine, a, sizeof a);
        describe(theirs, b, sizeof b);
        dptc_status status = dptc_fail(
            err, DPTC_ERR_MISMATCH,
            "collective mismatch: global rank %d issued %s but global rank %d issued %s; "
            "every rank must issue the same collectives in the same order",
            global_rank(s, s->local_rank), a, global_rank(s, p), b);
        /* Record it for peers that are still waiting, without overwriting the
         * message of whoever noticed first. */
        shm_abort(&ch->s->base, status, err->message);
        return status;
    }
    return DPTC_OK;
}

/* Publishes my fingerprint and takes the collective's first step. */
static dptc_status first_step(channel *ch, const dptc_coll *c, uint64_t seq,
                              double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    fingerprint_of(ch, c, seq, &ch->peers[s->local_rank].fp[seq % 2]);
    CHECK(step(ch, deadline, err));
    return check_fingerprints(ch, seq, err);
}

/* Across nodes, the rank with my local index on every node compares its
 * fingerprint with mine through the bridge, before any data crosses. */
static dptc_status check_across_nodes(channel *ch, const dptc_coll *c, uint64_t seq,
                                      dptc_error *err)
{
    shm_transport *s = ch->s;
    const fingerprint *f = &ch->peers[s->local_rank].fp[seq % 2];
    char text[256];
    describe(f, text, sizeof text);
    dptc_status status = dptc_bridge_check(ch->bridge, c->op, c->dtype, c->redop, c->count, seq,
                                           c->root, f->pieces_digest, text, err);
    if (status != DPTC_OK)
        shm_abort(&ch->s->base, status, err->message);
    return status;
}

/* The step that opens a round.  The collective's first round also compares
 * fingerprints, unless the cross-node check already did (shm_run). */
static dptc_status begin_round(channel *ch, const dptc_coll *c, uint64_t seq,
                               double deadline, dptc_error *err)
{
    if (!ch->unchecked)
        return step(ch, deadline, err);
    ch->unchecked = 0;
    return first_step(ch, c, seq, deadline, err);
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

/* A round must move at least one element, or a collective never ends. */
static dptc_status check_window(const shm_transport *s, size_t elements, dptc_error *err)
{
    if (elements > 0)
        return DPTC_OK;
    return dptc_fail(err, DPTC_ERR_INVALID,
                     "a staging slot of %zu bytes cannot hold one element per rank of this "
                     "group; raise DPTC_SLOT_BYTES", s->slot_bytes);
}

static dptc_status bridge(channel *ch, dptc_bridge_op op, const dptc_coll *c,
                          const unsigned char *at, const unsigned char *at2, size_t count,
                          int root, dptc_error *err)
{
    shm_transport *s = ch->s;
    unsigned char *base = ch->slots + (size_t)s->local_rank * s->region;
    return dptc_bridge_call(ch->bridge, op, c->dtype, base_redop(c), (size_t)(at - base),
                            at2 ? (size_t)(at2 - base) : 0, count, root, err);
}

/* [Note: several pieces]
 * An all-gather into several outputs, and an all-reduce in place on several
 * tensors (noutputs > 0), see their operand as the concatenation of pieces:
 * piece j has output_counts[j] elements at outputs[j], or, for the
 * all-gather, group size blocks of them there.  DDP all-reduces its
 * gradients where autograd left them this way, with no bucket copy.  The
 * pieces do not choose the algorithm (small or large all-reduce: the size
 * does), so a rank reducing pieces meets a peer reducing one tensor of the
 * same count step for step, as a rank that has joined (DDP's join()) does
 * with zeros.
 *
 * operand_at and stage_input read elements of that concatenation;
 * place_output writes them, in block `block` of each piece.
 *
 * An all-gather's pieces decide where each rank's elements land, so ranks
 * that split the same count differently would gather into the wrong
 * outputs: its fingerprint carries the pieces (npieces, pieces_digest; one
 * output is the single-output layout and carries none), and a difference is
 * a collective mismatch on every rank, across nodes too.  An all-reduce's
 * pieces stay out of it: they do not change the result. */

/* The address of element `at` of the operand, its input or (with `output`)
 * its output; on pieces both are the pieces.  *run says how many elements
 * follow contiguously there. */
static unsigned char *operand_at(const dptc_coll *c, int output, size_t at, size_t elsize,
                                 size_t *run)
{
    if (c->noutputs == 0) {
        *run = c->count - at;
        return (unsigned char *)(output ? c->output : c->input) + at * elsize;
    }
    size_t start = 0;
    for (int j = 0; j < c->noutputs; j++) {
        size_t len = c->output_counts[j];
        if (at < start + len) {
            *run = start + len - at;
            return (unsigned char *)c->outputs[j] + (at - start) * elsize;
        }
        start += len;
    }
    *run = 0;
    return NULL;
}

/* Copies elements [at, at + n) of the operand's input into buf with `how`. */
static void stage_input(const dptc_coll *c, size_t at, size_t n, unsigned char *buf,
                        size_t elsize, copy_fn how)
{
    while (n > 0) {
        size_t run;
        const unsigned char *from = operand_at(c, 0, at, elsize, &run);
        size_t take = run < n ? run : n;
        how(buf, from, take * elsize);
        buf += take * elsize;
        at += take;
        n -= take;
    }
}

/* Copies n elements from src to elements [at, at + n) of block `block` of
 * the output or outputs: group rank `block`'s share of an all-gather, the
 * one block of an all-reduce. */
static void place_output(const dptc_coll *c, size_t block, size_t at, size_t n,
                         const unsigned char *src, size_t elsize)
{
    if (c->noutputs == 0) {
        copy((unsigned char *)c->output + (block * c->count + at) * elsize, src, n * elsize);
        return;
    }
    size_t start = 0;
    for (int j = 0; j < c->noutputs && n > 0; j++) {
        size_t len = c->output_counts[j];
        if (at < start + len) {
            size_t offset = at - start;
            size_t take = len - offset < n ? len - offset : n;
            unsigned char *piece = (unsigned char *)c->outputs[j] + (block * len + offset) * elsize;
            copy(piece, src, take * elsize);
            src += take * elsize;
            at += take;
            n -= take;
        }
        start += len;
    }
}

/* Small all-reduce on one node: one step; every rank reduces everything,
 * into its output or, piece by piece, into its pieces. */
static dptc_status all_reduce_small(channel *ch, const dptc_coll *c, uint64_t seq,
                                    double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    stage_input(c, 0, c->count, slot_buffer(ch, s->local_rank, ch->rounds), elsize, copy);
    CHECK(begin_round(ch, c, seq, deadline, err));
    const void *srcs[DPTC_MAX_LOCAL];
    for (int p = 0; p < s->local_size; p++)
        srcs[p] = slot_buffer(ch, p, ch->rounds);
    ch->rounds++;
    int divisor = is_avg(c) ? s->local_size * s->nnodes : 1;
    if (c->noutputs == 0)
        return dptc_reduce(c->output, srcs, s->local_size, c->count, c->dtype, base_redop(c),
                           divisor, err);
    for (int j = 0; j < c->noutputs; j++) {
        CHECK(dptc_reduce(c->outputs[j], srcs, s->local_size, c->output_counts[j], c->dtype,
                          base_redop(c), divisor, err));
        for (int p = 0; p < s->local_size; p++)
            srcs[p] = (const unsigned char *)srcs[p] + c->output_counts[j] * elsize;
    }
    return DPTC_OK;
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

/* [Note: all-reduce rounds]
 * A round of the large all-reduce touches its stage in every rank's slot
 * three times (staged, reduced, copied out), so it runs fastest while a
 * round's bytes stay in the core's own cache.  On one node where every rank
 * has a core, a round stages at most ALL_REDUCE_ROUND_BYTES per rank: 27.5
 * MiB of DDP gradients at 2 ranks took 2.5 to 2.7 ms in 256 KiB rounds
 * against 3.0 to 3.1 ms in the 1 MiB slots (AMD EPYC, 1 MiB of L2 a core).
 * Where ranks share cores, each round's two steps may wait for the
 * scheduler, and across nodes each round is a gloo call: there rounds fill
 * the slot.  Every rank of a node computes the same size (from the node's
 * core count), so they agree on the rounds. */

/* [Note: staging]
 * A staged collective hands over bytes a rank has just written to a peer
 * that reads them at once, and what that costs depends on where the host
 * runs the ranks' cores, which can change from one minute to the next.
 * Measured on the development machine (2 vCPUs of an AMD EPYC under KVM,
 * 27.5 MiB at 2 ranks, alternating in one process): in most placements the
 * all-reduce below took 3.7 to 4.7 ms staged with ordinary stores and 4.9 to
 * 6.2 ms with non-temporal ones; in another, an ordinary store to a line the
 * peer had read stalled until the peer's copy was invalidated, and the
 * all-reduce took 14.6 to 19 ms staged with ordinary stores against 3.3 to
 * 4.8 with non-temporal ones.  The staged all-gather, reduce-scatter and
 * broadcast slowed down there alike (2.3 to 5 times; non-temporal stores
 * kept them within 1.1 times of the other placements), and non-temporal
 * stores cost them 25 to 60 % elsewhere.  So each staged collective has two
 * stagings:
 * - cached: ordinary stores into the slots.  The all-reduce stages every
 *   rank's whole chunk, reduces its part from every rank's slot into its own
 *   slot, and copies every reduced part out; everything a round touches
 *   stays in the caches.
 * - streamed: non-temporal stores into the slots (copy_streaming).  The
 *   all-reduce stages only the parts its peers reduce, reduces its own part
 *   from its input straight into its output and streams that result into
 *   its slot for the peers.  No line a peer may hold is written with an
 *   ordinary store, and the hand-over goes through memory instead of a
 *   shared cache.
 * Neither wins in every placement, so for each kind of collective local
 * rank 0 times every large one (at least STAGING_MEASURED_BYTES, from its
 * first step to its last, which leaves the ranks' arrival out) and chooses
 * the staging whose cost per byte is lower (choose_staging): the current
 * one's is the median of its last STAGING_RECENT costs, so that one slow
 * collective (the host taking a core away for a moment) does not make it
 * switch; the other's is what it cost when last tried.  It tries the other
 * one after a number of collectives that doubles while the other keeps
 * losing, and at once when the current one costs more than the other did
 * when last tried, or its median settles STAGING_WORSE above its best (the
 * placement changed).  Rank 0 publishes its choice in its peer record
 * before the collective's last step; every rank reads it before it stages
 * its next collective of that kind, which cannot reach its own last step
 * before every rank has posted its first: rank 0 never publishes again
 * before all have read, and every rank stages the same way.  Even if they did not, the results would be right: how a
 * rank fills its slot is its own affair, and under both stagings the
 * all-reduce leaves the parts its peers reduce in a rank's slot before the
 * middle step and its own reduced part after it, at the same places.  Both
 * reduce the same values in rank order, so the numbers do not depend on the
 * choice.  Across nodes, and in a group of one rank a node, collectives
 * stage cached.  DPTC_SHM_STAGING=cached or streamed fixes the choice (read
 * on local rank 0, the one that publishes it). */
#define STAGING_MEASURED_BYTES (4u << 20)
#define STAGING_TRIAL_FIRST 2      /* measured collectives before the first try */
#define STAGING_TRIAL_SWITCHED 16  /* ... before the first try after a switch */
#define STAGING_TRIAL_MAX 256      /* the most between two tries */
#define STAGING_SWITCH 0.95        /* a try wins at 5 % cheaper than the current one */
#define STAGING_WORSE 1.25         /* the current one settled this much above its best */

/* The staging the next large collective of kind `op` on ch uses; counts it. */
static dptc_shm_staging staging_of(channel *ch, staged_op op)
{
    dptc_shm_staging staging = DPTC_SHM_STAGING_CACHED;
    if (!ch->bridge && ch->s->local_size > 1 &&
        atomic_load_explicit(&ch->peers[0].staging[op], memory_order_relaxed) ==
            DPTC_SHM_STAGING_STREAMED)
        staging = DPTC_SHM_STAGING_STREAMED;
    atomic_fetch_add_explicit(&ch->staged[op][staging], 1, memory_order_relaxed);
    return staging;
}

/* Copies into a slot as `staging` says. */
static copy_fn stage_copy(dptc_shm_staging staging)
{
    return staging == DPTC_SHM_STAGING_STREAMED ? copy_streaming : copy;
}

/* Adds a cost of the current staging to its ring and sets its cost to the
 * ring's median, which one slow collective (the host taking the core away
 * for a moment) does not move. */
static void note_current_cost(staging_chooser *k, double cost)
{
    k->recent[k->nrecent % STAGING_RECENT] = cost;
    k->nrecent++;
    uint32_t n = k->nrecent < STAGING_RECENT ? k->nrecent : STAGING_RECENT;
    double sorted[STAGING_RECENT];
    for (uint32_t i = 0; i < n; i++) {
        uint32_t j = i;
        for (; j > 0 && sorted[j - 1] > k->recent[i]; j--)
            sorted[j] = sorted[j - 1];
        sorted[j] = k->recent[i];
    }
    k->cost[k->current] = sorted[n / 2];
}

/* Takes in what a collective of `bytes` staged with `used` cost, and
 * returns the staging for the next one (see [Note: staging]). */
static dptc_shm_staging choose_staging(shm_transport *s, staging_chooser *k,
                                       dptc_shm_staging used, double seconds, size_t bytes)
{
    if (s->staging != DPTC_SHM_STAGING_AUTO)
        return s->staging;
    if (k->trial_every == 0)
        k->trial_every = STAGING_TRIAL_FIRST;
    if (bytes >= STAGING_MEASURED_BYTES && seconds > 0) {
        double cost = seconds / (double)bytes;
        dptc_shm_staging current = (dptc_shm_staging)k->current;
        if (used == current) {
            note_current_cost(k, cost);
            k->since_trial++;
            if (k->best == 0 || k->cost[used] < k->best)
                k->best = k->cost[used];
            /* Worse than the other one was when last tried, or settled well
             * above its best: the placement may have changed, try the other
             * one now. */
            double other = k->cost[1 - used];
            if ((other > 0 && cost > other) || k->cost[used] > STAGING_WORSE * k->best)
                k->since_trial = k->trial_every;
        } else {
            /* A try: its fresh cost replaces what is known of it, however old. */
            k->cost[used] = cost;
            k->since_trial = 0;
            if (cost < STAGING_SWITCH * k->cost[current]) {
                k->current = used;
                k->nrecent = 0;
                note_current_cost(k, cost);
                k->best = cost;
                k->trial_every = STAGING_TRIAL_SWITCHED;
            } else {
                k->best = k->cost[current];  /* its new level stands */
                if (k->trial_every < STAGING_TRIAL_MAX)
                    k->trial_every *= 2;
            }
        }
    }
    dptc_shm_staging current = (dptc_shm_staging)k->current;
    if (k->since_trial >= k->trial_every)
        return current == DPTC_SHM_STAGING_CACHED ? DPTC_SHM_STAGING_STREAMED
                                                  : DPTC_SHM_STAGING_CACHED;
    return current;
}

/* Local rank 0, before the last step of a collective of kind `op` and
 * `bytes` (its full buffer's, as nccl-tests counts them) staged with `used`,
 * whose first step ended at `started` (0: not yet): chooses and publishes
 * the staging of the next one (see [Note: staging]). */
static void staging_done(channel *ch, staged_op op, dptc_shm_staging used, double started,
                         size_t bytes)
{
    shm_transport *s = ch->s;
    if (s->local_rank != 0 || ch->bridge || s->local_size == 1)
        return;
    double seconds = started > 0 ? dptc_now() - started : 0;
    dptc_shm_staging next = choose_staging(s, &ch->choosers[op], used, seconds, bytes);
    atomic_store_explicit(&ch->peers[0].staging[op], (uint32_t)next, memory_order_relaxed);
}

/* Stages the round's chunk [done, done + chunk) in my slot `staged`: all of
 * it (cached), or the parts the peers reduce (streamed). */
static void stage_chunk(channel *ch, const dptc_coll *c, dptc_shm_staging staging, size_t done,
                        size_t chunk, size_t part_max, unsigned char *staged)
{
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    if (staging == DPTC_SHM_STAGING_CACHED) {
        stage_input(c, done, chunk, staged, elsize, copy);
        return;
    }
    for (int p = 0; p < s->local_size; p++) {
        span part = part_of(chunk, s->local_size, p, part_max);
        if (p != s->local_rank && part.hi > part.lo)
            stage_input(c, done + part.lo, part.hi - part.lo, staged + part.lo * elsize, elsize,
                        copy_streaming);
    }
}

/* Streamed: reduces my part [lo, hi) of the chunk at `done` from my input
 * and the peers' slots into my output, and streams the result into my slot
 * (`mine`) for the peers. */
static dptc_status reduce_mine_streamed(channel *ch, const dptc_coll *c, size_t done, size_t lo,
                                        size_t hi, unsigned char *mine, int divisor,
                                        dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    for (size_t at = lo; at < hi;) {
        size_t run_in, run_out;
        const unsigned char *from = operand_at(c, 0, done + at, elsize, &run_in);
        unsigned char *to = operand_at(c, 1, done + at, elsize, &run_out);
        size_t take = hi - at;
        if (run_in < take)
            take = run_in;
        if (run_out < take)
            take = run_out;
        const void *srcs[DPTC_MAX_LOCAL];
        for (int p = 0; p < s->local_size; p++)
            srcs[p] = p == s->local_rank ? (const void *)from
                                         : (const void *)(slot_buffer(ch, p, ch->rounds) +
                                                          at * elsize);
        CHECK(dptc_reduce(to, srcs, s->local_size, take, c->dtype, base_redop(c), divisor, err));
        copy_streaming(mine + (at - lo) * elsize, to, take * elsize);
        at += take;
    }
    return DPTC_OK;
}

/* Large all-reduce: per round, each rank stages its chunk (see [Note:
 * staging]), reduces its part of every rank's chunk (then hands that part to
 * the bridge across nodes), and copies every reduced part out. */
static dptc_status all_reduce_large(channel *ch, const dptc_coll *c, uint64_t seq,
                                    double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    int n = s->local_size;
    size_t part_max = elements_per(s->all_reduce_round / (size_t)n, elsize);
    size_t chunk_max = part_max * (size_t)n;
    CHECK(check_window(s, part_max, err));
    dptc_shm_staging staging = staging_of(ch, STAGED_ALL_REDUCE);
    int streamed = staging == DPTC_SHM_STAGING_STREAMED;
    int first = 1;
    double started = 0;
    int divisor = is_avg(c) ? n * s->nnodes : 1;
    for (size_t done = 0; done < c->count || first;) {
        size_t chunk = c->count - done < chunk_max ? c->count - done : chunk_max;
        stage_chunk(ch, c, staging, done, chunk, part_max,
                    slot_buffer(ch, s->local_rank, ch->rounds));
        CHECK(begin_round(ch, c, seq, deadline, err));
        if (first)
            started = dptc_now();
        first = 0;
        span my = part_of(chunk, n, s->local_rank, part_max);
        size_t lo = my.lo, hi = my.hi;
        unsigned char *mine = slot_buffer(ch, s->local_rank, ch->rounds) + lo * elsize;
        if (hi > lo && streamed) {
            CHECK(reduce_mine_streamed(ch, c, done, lo, hi, mine, divisor, err));
        } else if (hi > lo) {
            const void *srcs[DPTC_MAX_LOCAL];
            for (int p = 0; p < n; p++)
                srcs[p] = slot_buffer(ch, p, ch->rounds) + lo * elsize;
            int local_divisor = ch->bridge ? 1 : divisor;
            CHECK(dptc_reduce(mine, srcs, n, hi - lo, c->dtype, base_redop(c), local_divisor, err));
            if (ch->bridge) {
                CHECK(bridge(ch, DPTC_BRIDGE_ALL_REDUCE, c, mine, NULL, hi - lo, 0, err));
                if (divisor != 1)
                    CHECK(dptc_divide(mine, hi - lo, c->dtype, divisor, err));
            }
        }
        if (done + chunk >= c->count)
            staging_done(ch, STAGED_ALL_REDUCE, staging, started, c->count * elsize);
        CHECK(step(ch, deadline, err));
        for (int p = 0; p < n; p++) {
            if (p == s->local_rank && streamed)
                continue;  /* reduced straight into the output */
            span their = part_of(chunk, n, p, part_max);
            place_output(c, 0, done + their.lo, their.hi - their.lo,
                         slot_buffer(ch, p, ch->rounds) + their.lo * elsize, elsize);
        }
        ch->rounds++;
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
static dptc_status all_reduce_shared(channel *ch, const dptc_coll *c, uint64_t seq,
                                     double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    int n = s->local_size;
    span my = part_of(c->count, n, s->local_rank, SIZE_MAX);
    size_t lo = my.lo, hi = my.hi;
    CHECK(begin_round(ch, c, seq, deadline, err));
    /* In pieces that stay in the core's cache between the reduce and the
     * copies (see [Note: all-reduce rounds]); no step between pieces. */
    size_t piece = elements_per(ALL_REDUCE_ROUND_BYTES, elsize);
    int divisor = is_avg(c) ? n : 1;
    for (size_t from = lo; from < hi; from += piece) {
        size_t count = hi - from < piece ? hi - from : piece;
        size_t at = ch->shared_offset + from * elsize;
        const void *srcs[DPTC_MAX_LOCAL];
        for (int p = 0; p < n; p++)
            srcs[p] = ch->in_shared->base[p] + at;
        unsigned char *mine = ch->in_shared->base[s->local_rank] + at;
        CHECK(dptc_reduce(mine, srcs, n, count, c->dtype, base_redop(c), divisor, err));
        for (int p = 0; p < n; p++)
            if (p != s->local_rank)
                memcpy(ch->in_shared->base[p] + at, mine, count * elsize);
    }
    return step(ch, deadline, err);
}

static dptc_status all_reduce(channel *ch, const dptc_coll *c, uint64_t seq,
                              double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    if (ch->in_shared)
        return all_reduce_shared(ch, c, seq, deadline, err);
    /* By size alone, pieces or not (see [Note: several pieces]): the ranks
     * must take the same steps, and the fingerprint does not say how a
     * rank's operand is laid out. */
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    if (s->nnodes == 1 && (bytes <= 16384 || (s->local_size == 1 && bytes <= s->slot_bytes)))
        return all_reduce_small(ch, c, seq, deadline, err);
    return all_reduce_large(ch, c, seq, deadline, err);
}

static dptc_status broadcast(channel *ch, const dptc_coll *c, uint64_t seq,
                             double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    size_t chunk_max = elements_per(s->slot_bytes, elsize);
    CHECK(check_window(s, chunk_max, err));
    int root_node = c->root / s->local_size, root_local = c->root % s->local_size;
    int is_root = c->root == s->node * s->local_size + s->local_rank;
    unsigned char *buf = c->output;
    dptc_shm_staging staging = staging_of(ch, STAGED_BROADCAST);
    int first = 1;
    double started = 0;
    for (size_t done = 0; done < c->count || first;) {
        size_t chunk = c->count - done < chunk_max ? c->count - done : chunk_max;
        unsigned char *staged = slot_buffer(ch, root_local, ch->rounds);
        if (is_root)
            stage_copy(staging)(staged, buf + done * elsize, chunk * elsize);
        if (ch->bridge && s->local_rank == root_local && chunk > 0)
            CHECK(bridge(ch, DPTC_BRIDGE_BROADCAST, c, staged, NULL, chunk, root_node, err));
        if (done + chunk >= c->count)
            staging_done(ch, STAGED_BROADCAST, staging, started, c->count * elsize);
        CHECK(begin_round(ch, c, seq, deadline, err));
        if (first)
            started = dptc_now();
        first = 0;
        if (!is_root)
            copy(buf + done * elsize, staged, chunk * elsize);
        ch->rounds++;
        done += chunk;
    }
    return DPTC_OK;
}

/* All-gather into shared outputs: each rank writes its input straight into
 * its block of every peer's output; nobody else writes that block. */
static dptc_status all_gather_shared(channel *ch, const dptc_coll *c, uint64_t seq,
                                     double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    size_t at = ch->shared_offset + (size_t)s->local_rank * bytes;
    CHECK(begin_round(ch, c, seq, deadline, err));
    for (int p = 0; p < s->local_size; p++) {
        unsigned char *dst = ch->in_shared->base[p] + at;
        if (dst != (const unsigned char *)c->input)  /* input may be my own block */
            memmove(dst, c->input, bytes);
    }
    return step(ch, deadline, err);
}

/* All-gather from shared inputs into several outputs (FSDP's shard
 * buffers): every rank's input lies at the same offset of a shared buffer,
 * so after the first step each rank copies every rank's block straight from
 * its owner's memory into its own pieces; the closing step tells the owners
 * their inputs are free again.  A shard written long before (by the
 * optimizer) comes from memory, not from the cache of the core that wrote
 * it, and nothing is staged. */
static dptc_status all_gather_from_shared(channel *ch, const dptc_coll *c, uint64_t seq,
                                          double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    CHECK(begin_round(ch, c, seq, deadline, err));
    for (int p = 0; p < s->local_size; p++)
        place_output(c, (size_t)p, 0, c->count, ch->in_shared->base[p] + ch->shared_offset,
                       elsize);
    return step(ch, deadline, err);
}

/* Reduce-scatter from shared inputs: rank r reduces block r of every peer's
 * input into its output (which may be its own block r: nobody else reads
 * it); the closing step tells peers their inputs are free again. */
static dptc_status reduce_scatter_shared(channel *ch, const dptc_coll *c, uint64_t seq,
                                         double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    size_t at = ch->shared_offset + (size_t)s->local_rank * bytes;
    CHECK(begin_round(ch, c, seq, deadline, err));
    const void *srcs[DPTC_MAX_LOCAL];
    for (int p = 0; p < s->local_size; p++)
        srcs[p] = ch->in_shared->base[p] + at;
    int divisor = is_avg(c) ? s->local_size : 1;
    CHECK(dptc_reduce(c->output, srcs, s->local_size, c->count, c->dtype, base_redop(c), divisor, err));
    return step(ch, deadline, err);
}

/* All-gather.  Per round, a window of each rank's input is staged; across
 * nodes, the bridge gathers the windows of my local index from every node
 * into my slot; then every rank copies every slot's windows to their place
 * (global rank g = node * local_size + local). */
static dptc_status all_gather(channel *ch, const dptc_coll *c, uint64_t seq,
                              double deadline, dptc_error *err)
{
    if (ch->in_shared)
        return c->noutputs > 0 ? all_gather_from_shared(ch, c, seq, deadline, err)
                               : all_gather_shared(ch, c, seq, deadline, err);
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    size_t parts = ch->bridge ? (size_t)s->nnodes + 1 : 1;
    size_t window_max = elements_per(s->slot_bytes / parts, elsize);
    const unsigned char *in = c->input;
    CHECK(check_window(s, window_max, err));
    dptc_shm_staging staging = staging_of(ch, STAGED_ALL_GATHER);
    size_t bytes = c->count * elsize * (size_t)(s->local_size * s->nnodes);
    int first = 1;
    double started = 0;
    for (size_t done = 0; done < c->count || first;) {
        size_t w = c->count - done < window_max ? c->count - done : window_max;
        unsigned char *mine = slot_buffer(ch, s->local_rank, ch->rounds);
        /* Across nodes a slot holds [nnodes gathered windows of w][my window]. */
        unsigned char *staged = mine + (size_t)s->nnodes * window_max * elsize;
        stage_copy(staging)(ch->bridge ? staged : mine, in + done * elsize, w * elsize);
        if (ch->bridge && w > 0)
            CHECK(bridge(ch, DPTC_BRIDGE_ALL_GATHER, c, staged, mine, w, 0, err));
        if (done + w >= c->count)
            staging_done(ch, STAGED_ALL_GATHER, staging, started, bytes);
        CHECK(begin_round(ch, c, seq, deadline, err));
        if (first)
            started = dptc_now();
        first = 0;
        for (int node = 0; node < s->nnodes; node++)
            for (int p = 0; p < s->local_size; p++) {
                size_t g = (size_t)node * (size_t)s->local_size + (size_t)p;
                place_output(c, g, done, w,
                               slot_buffer(ch, p, ch->rounds) + (size_t)node * w * elsize, elsize);
            }
        ch->rounds++;
        done += w;
    }
    return DPTC_OK;
}

/* dst = op over the nsrc sources, any number of them (nodes may outnumber
 * DPTC_MAX_LOCAL): the first batch reduces into dst, later ones fold into it. */
static dptc_status reduce_many(void *dst, const void *const *srcs, int nsrc, size_t count,
                               const dptc_coll *c, int divisor, dptc_error *err)
{
    const void *batch[DPTC_MAX_LOCAL];
    int done = 0;
    while (done < nsrc) {
        int k = 0;
        if (done > 0)
            batch[k++] = dst;
        while (k < DPTC_MAX_LOCAL && done < nsrc)
            batch[k++] = srcs[done++];
        CHECK(dptc_reduce(dst, batch, k, count, c->dtype, base_redop(c),
                          done == nsrc ? divisor : 1, err));
    }
    return DPTC_OK;
}

/* Reduce-scatter.  Per round, a window of every rank's n input blocks is
 * staged.  On one node each rank reduces its own block of every peer's
 * window into its output.  Across nodes each rank reduces, for every node,
 * the block of the rank with its local index there into a scratch area
 * (one window per node); the bridge's all-to-all then sends each node only
 * its own window and brings back every node's partial sum of mine, which
 * this rank reduces into its output: each node receives only the part it
 * keeps, (nnodes - 1) / nnodes of a window per rank and round. */
static dptc_status reduce_scatter(channel *ch, const dptc_coll *c, uint64_t seq,
                                  double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    size_t elsize = dptc_dtype_size(c->dtype);
    int n = s->local_size * s->nnodes;
    size_t windows = (size_t)n + (ch->bridge ? 2 * (size_t)s->nnodes : 0);
    size_t window_max = elements_per(s->slot_bytes / windows, elsize);
    const unsigned char *in = c->input;
    unsigned char *out = c->output;
    int divisor = is_avg(c) ? n : 1;
    if (ch->in_shared)
        return reduce_scatter_shared(ch, c, seq, deadline, err);
    CHECK(check_window(s, window_max, err));
    dptc_shm_staging staging = staging_of(ch, STAGED_REDUCE_SCATTER);
    int first = 1;
    double started = 0;
    for (size_t done = 0; done < c->count || first;) {
        size_t w = c->count - done < window_max ? c->count - done : window_max;
        unsigned char *mine = slot_buffer(ch, s->local_rank, ch->rounds);
        for (int g = 0; g < n; g++)
            stage_copy(staging)(mine + (size_t)g * window_max * elsize,
                                in + ((size_t)g * c->count + done) * elsize, w * elsize);
        if (done + w >= c->count)
            staging_done(ch, STAGED_REDUCE_SCATTER, staging, started,
                         c->count * elsize * (size_t)n);
        CHECK(begin_round(ch, c, seq, deadline, err));
        if (first)
            started = dptc_now();
        first = 0;
        unsigned char *scratch = mine + (size_t)n * window_max * elsize;
        unsigned char *received = scratch + (size_t)s->nnodes * window_max * elsize;
        for (int node = 0; node < s->nnodes && w > 0; node++) {
            size_t g = (size_t)node * (size_t)s->local_size + (size_t)s->local_rank;
            const void *srcs[DPTC_MAX_LOCAL];
            for (int p = 0; p < s->local_size; p++)
                srcs[p] = slot_buffer(ch, p, ch->rounds) + g * window_max * elsize;
            void *dst = ch->bridge ? scratch + (size_t)node * w * elsize : out + done * elsize;
            CHECK(dptc_reduce(dst, srcs, s->local_size, w, c->dtype, base_redop(c),
                              ch->bridge ? 1 : divisor, err));
        }
        if (ch->bridge && w > 0) {
            CHECK(bridge(ch, DPTC_BRIDGE_ALL_TO_ALL, c, scratch, received, w, 0, err));
            const void *srcs[DPTC_MAX_LOCAL];
            const void **from = s->nnodes <= DPTC_MAX_LOCAL ? srcs : NULL;
            if (!from) {
                from = malloc((size_t)s->nnodes * sizeof *from);
                if (!from)
                    return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory");
            }
            for (int node = 0; node < s->nnodes; node++)
                from[node] = received + (size_t)node * w * elsize;
            dptc_status status = reduce_many(out + done * elsize, from, s->nnodes, w, c, divisor,
                                             err);
            if (from != srcs)
                free(from);
            CHECK(status);
        }
        ch->rounds++;
        done += w;
    }
    return DPTC_OK;
}

static dptc_status barrier(channel *ch, const dptc_coll *c, uint64_t seq, double deadline,
                           dptc_error *err)
{
    shm_transport *s = ch->s;
    CHECK(begin_round(ch, c, seq, deadline, err));
    if (ch->bridge) {
        /* A one-byte all-reduce across nodes, on my staging buffer. */
        dptc_coll one = {.op = DPTC_OP_ALL_REDUCE, .dtype = DPTC_UINT8, .redop = DPTC_MAX};
        unsigned char *mine = slot_buffer(ch, s->local_rank, ch->rounds);
        mine[0] = 1;
        if (s->local_rank == 0)
            CHECK(bridge(ch, DPTC_BRIDGE_ALL_REDUCE, &one, mine, NULL, 1, 0, err));
        CHECK(step(ch, deadline, err));
    }
    ch->rounds++;
    return DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* Segments
 *
 * [Note: segments]
 * Segments are memfd files by default: they live in the kernel's internal
 * shared-memory mount, which /dev/shm's size does not limit (Docker's
 * default /dev/shm is 64 MiB), and they have no name anyone else could
 * find.  Local peers open the creator's descriptor through
 * /proc/<pid>/fd/<fd>; once every local rank has mapped a segment, its
 * creator closes that descriptor (dptc_shm_unlink, or share's second step),
 * so nothing is left even after a SIGKILL.  DPTC_SHM=posix uses /dev/shm
 * names instead (created 0600 under the group's random token, unlinked
 * likewise).  Either way every page is reserved with posix_fallocate when
 * the segment is made, so a full file system is an error naming the remedy,
 * never a SIGBUS at first touch. */

static int use_memfd(void)
{
    const char *mode = getenv("DPTC_SHM");
    return !(mode && strcmp(mode, "posix") == 0);
}

static dptc_status reserve(int fd, size_t bytes, int on_dev_shm, dptc_error *err)
{
    if (ftruncate(fd, (off_t)bytes) != 0)
        return dptc_fail(err, DPTC_ERR_SYSTEM, "ftruncate of a shared segment to %zu bytes "
                         "failed: %s", bytes, strerror(errno));
    int rc = posix_fallocate(fd, 0, (off_t)bytes);
    if (rc == 0 || rc == EINVAL || rc == EOPNOTSUPP)
        return DPTC_OK;
    if (!on_dev_shm)
        return dptc_fail(err, DPTC_ERR_NOMEM, "could not reserve %zu bytes of shared memory "
                         "(memfd): %s; the machine or the container's memory limit is "
                         "exhausted", bytes, strerror(rc));
    struct statvfs fs;
    unsigned long long free_bytes = 0, size_bytes = 0;
    if (statvfs("/dev/shm", &fs) == 0) {
        free_bytes = (unsigned long long)fs.f_bavail * fs.f_frsize;
        size_bytes = (unsigned long long)fs.f_blocks * fs.f_frsize;
    }
    return dptc_fail(err, DPTC_ERR_NOMEM,
                     "could not reserve %zu bytes in /dev/shm (%llu of %llu bytes free): %s. "
                     "Enlarge /dev/shm (docker run --shm-size=2g, or mount -o remount,size=2g "
                     "/dev/shm), or unset DPTC_SHM=posix so that dptc uses memfd memory, which "
                     "the size of /dev/shm does not limit", bytes, free_bytes, size_bytes,
                     strerror(rc));
}

static dptc_status map_fd(int fd, size_t bytes, unsigned char **out, dptc_error *err)
{
    void *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED)
        return dptc_fail(err, DPTC_ERR_SYSTEM, "mmap of %zu shared bytes failed: %s", bytes,
                         strerror(errno));
    *out = map;
    return DPTC_OK;
}

/* Creates a segment of `bytes` and maps it.  *fd receives the memfd that
 * peers open (see [Note: segments]), or -1 when `name` was created in
 * /dev/shm instead. */
static dptc_status create_segment(const char *name, size_t bytes, int *fd, unsigned char **out,
                                  dptc_error *err)
{
    int memfd = use_memfd();
    int handle = memfd ? memfd_create("dptc", MFD_CLOEXEC) : -1;
    if (handle < 0 && memfd && errno != ENOSYS)
        return dptc_fail(err, DPTC_ERR_SYSTEM, "memfd_create failed: %s", strerror(errno));
    if (handle < 0) {
        memfd = 0;
        handle = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (handle < 0)
            return dptc_fail(err, DPTC_ERR_SYSTEM, "shm_open(%s) failed: %s", name,
                             strerror(errno));
    }
    dptc_status status;
    CHECK_GOTO(reserve(handle, bytes, !memfd, err), status, fail);
    CHECK_GOTO(map_fd(handle, bytes, out, err), status, fail);
    if (memfd) {
        *fd = handle;
    } else {
        close(handle);
        *fd = -1;
    }
    return DPTC_OK;
fail:
    close(handle);
    if (!memfd)
        shm_unlink(name);
    return status;
}

/* Opens and maps a peer's segment: a /proc/<pid>/fd/<fd> path or a
 * /dev/shm name.  Another size means the local ranks disagree on what they
 * map. */
static dptc_status open_segment(const char *path, size_t bytes, unsigned char **out,
                                dptc_error *err)
{
    int fd = strncmp(path, "/proc/", 6) == 0 ? open(path, O_RDWR | O_CLOEXEC)
                                              : shm_open(path, O_RDWR, 0600);
    if (fd < 0)
        return dptc_fail(err, DPTC_ERR_SYSTEM, "opening the shared segment %s failed: %s", path,
                         strerror(errno));
    dptc_status status = DPTC_OK;
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != bytes)
        status = dptc_fail(err, DPTC_ERR_SYSTEM,
                           "shared segment %s has %lld bytes, expected %zu: local ranks disagree "
                           "on its size", path, (long long)st.st_size, bytes);
    else
        status = map_fd(fd, bytes, out, err);
    close(fd);
    return status;
}

/* ------------------------------------------------------------------ */
/* Shared buffers (see [Note: shared buffers] in shm.h) */

static void shared_name(const shm_transport *s, int local, uint64_t id, char *out, size_t n)
{
    snprintf(out, n, "%s-r%d-b%llu", s->name, local, (unsigned long long)id);
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

/* The shared buffer a collective can work in place on: the in-place
 * all-reduce's tensor, the single-output all-gather's output, the
 * several-output all-gather's input, the reduce-scatter's input; on one
 * node only. */
static const dptc_shared *find_shared_operand(channel *ch, const dptc_coll *c, size_t *offset)
{
    shm_transport *s = ch->s;
    if (ch->bridge || c->count == 0)
        return NULL;
    size_t bytes = c->count * dptc_dtype_size(c->dtype);
    if (c->noutputs > 0)
        return c->op == DPTC_OP_ALL_GATHER ? find_shared(s, c->input, bytes, offset) : NULL;
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

/* Every local rank creates its segment and publishes its descriptor in its
 * record, waits for all, maps its peers', waits again, and closes its
 * descriptor (or removes its name), so nothing is left behind.  On failure
 * every rank removes every name: a peer that died before removing its own
 * leaves nothing behind either. */
static dptc_status share(channel *ch, const dptc_coll *c, dptc_shm_share_request *request,
                         uint64_t seq, double deadline, dptc_error *err)
{
    shm_transport *s = ch->s;
    dptc_shared *sh = request->out;
    memset(sh, 0, sizeof *sh);
    sh->id = ch->shared_made++ * DPTC_MAX_STREAMS + (uint64_t)ch->index;
    sh->bytes = round_up(request->nbytes ? request->nbytes : 1, ALIGN_BYTES);
    sh->local_rank = s->local_rank;
    sh->local_size = s->local_size;
    char name[300];
    int fd = -1;
    peer_record *me = &ch->peers[s->local_rank];
    shared_name(s, s->local_rank, sh->id, name, sizeof name);
    dptc_status status = create_segment(name, sh->bytes, &fd, &sh->base[s->local_rank], err);
    if (status != DPTC_OK) {
        shm_abort(&s->base, status, err->message);
        return status;
    }
    atomic_store(&me->share_fd, fd);
    CHECK_GOTO(begin_round(ch, c, seq, deadline, err), status, fail);
    for (int p = 0; p < s->local_size; p++) {
        if (p == s->local_rank)
            continue;
        int their_fd = atomic_load(&ch->peers[p].share_fd);
        if (their_fd >= 0)
            snprintf(name, sizeof name, "/proc/%d/fd/%d", (int)atomic_load(&ch->peers[p].pid),
                     their_fd);
        else
            shared_name(s, p, sh->id, name, sizeof name);
        CHECK_GOTO(open_segment(name, sh->bytes, &sh->base[p], err), status, fail);
    }
    CHECK_GOTO(step(ch, deadline, err), status, fail);
    CHECK_GOTO(remember_shared(s, sh, err), status, fail);
    goto exit;
fail:
    for (int p = 0; p < s->local_size; p++) {
        shared_name(s, p, sh->id, name, sizeof name);
        shm_unlink(name);
    }
    dptc_shm_shared_free(sh);
    if (!atomic_load(&s->header->aborted))
        shm_abort(&s->base, status, err->message);
exit:
    atomic_store(&me->share_fd, -1);
    if (fd >= 0) {
        close(fd);
    } else {
        shared_name(s, s->local_rank, sh->id, name, sizeof name);
        shm_unlink(name);
    }
    return status;
}

/* ------------------------------------------------------------------ */
/* The transport table */

typedef dptc_status (*algorithm)(channel *ch, const dptc_coll *c, uint64_t seq, double deadline,
                                 dptc_error *err);

/* What every operation does first: fail at once if a peer aborted; find
 * the shared buffer it may work in; across nodes, compare fingerprints
 * locally and then across nodes before the first byte moves (a bridged step
 * issued by mismatched nodes could otherwise wait in gloo). */
static dptc_status prologue(channel *ch, const dptc_coll *c, const dptc_order *order,
                            dptc_error *err)
{
    shm_transport *s = ch->s;
    if (atomic_load_explicit(&s->header->aborted, memory_order_acquire))
        return aborted_error(s, err);
    ch->unchecked = 1;
    ch->in_shared = find_shared_operand(ch, c, &ch->shared_offset);
    if (ch->bridge) {
        CHECK(first_step(ch, c, order->seq, order->deadline, err));
        CHECK(check_across_nodes(ch, c, order->seq, err));
        ch->unchecked = 0;
    }
    return DPTC_OK;
}

/* [Note: a group of one]
 * A group whose only member is this rank has no peer to stage for or wait
 * for, and every reduction of one operand is that operand (AVG divides by
 * 1).  So each operation only moves what the caller asked to have moved:
 * one copy where the output is not the input, none in place.  Staged, a
 * 27.5 MiB all-reduce took 5 ms here, and out of place 10 ms.  Such groups
 * are common: DDP or FSDP at one rank, FSDP1's NO_SHARD (shard groups of
 * one rank each) and HSDP on one node (replicate groups of one). */
static void move(void *dst, const void *src, size_t nbytes)
{
    if (dst != src)
        copy(dst, src, nbytes);
}

static dptc_status alone(const dptc_coll *c)
{
    size_t elsize = dptc_dtype_size(c->dtype);
    switch (c->op) {
    case DPTC_OP_ALL_REDUCE:    /* on pieces: in place (see [Note: several pieces]) */
        if (c->noutputs == 0)
            move(c->output, c->input, c->count * elsize);
        break;
    case DPTC_OP_ALL_GATHER:
        if (c->noutputs == 0) {
            move(c->output, c->input, c->count * elsize);
            break;
        }
        const unsigned char *from = c->input;
        for (int j = 0; j < c->noutputs; j++) {
            move(c->outputs[j], from, c->output_counts[j] * elsize);
            from += c->output_counts[j] * elsize;
        }
        break;
    case DPTC_OP_REDUCE_SCATTER:
        move(c->output, c->input, c->count * elsize);
        break;
    default:                    /* broadcast (in place), barrier */
        break;
    }
    return DPTC_OK;
}

/* [Note: slots between collectives]
 * A collective reads a slot only after its owner wrote it in the same
 * round (see [Note: rounds and steps]), so the slots hold nothing that one
 * collective leaves for the next: what they contain between two
 * collectives is garbage nobody reads.  tests/test_slots.py holds the
 * transport to that.  With a sentinel set (dptc_shm_fill_slots_between),
 * every collective on a stream opens with two extra steps: after the
 * first, every local rank has finished the stream's previous collective
 * (peers included, who may read this rank's slots until they post it), so
 * local rank 0 overwrites every local rank's slots of the stream with the
 * sentinel; after the second, every rank stages its own data as usual.  A
 * result that depends on the sentinel is a slot read before its owner
 * wrote it.  Other streams' slots are left alone: their collectives may be
 * running. */
static dptc_status fill_slots_between(channel *ch, const dptc_order *order, dptc_error *err)
{
    shm_transport *s = ch->s;
    int sentinel = atomic_load_explicit(&s->sentinel, memory_order_relaxed);
    if (sentinel < 0)
        return DPTC_OK;
    CHECK(step(ch, order->deadline, err));
    if (s->local_rank == 0)
        memset(ch->slots, sentinel, (size_t)s->local_size * s->region);
    CHECK(step(ch, order->deadline, err));
    atomic_fetch_add_explicit(&ch->sentinel_fills, 1, memory_order_relaxed);
    return DPTC_OK;
}

static dptc_status run(dptc_transport *t, const dptc_order *order, const dptc_coll *c,
                       dptc_completion *done, algorithm how, dptc_error *err)
{
    /* Complete on return: see [Note: completions] in transport.h. */
    done->wait = NULL;
    channel *ch = &((shm_transport *)t)->channels[order->stream];
    if (ch->s->local_size > 1 || ch->s->nnodes > 1)
        CHECK(fill_slots_between(ch, order, err));
    CHECK(prologue(ch, c, order, err));
    if (ch->s->local_size == 1 && ch->s->nnodes == 1)
        return alone(c);
    return how(ch, c, order->seq, order->deadline, err);
}

dptc_status dptc_shm_share(dptc_transport *t, const dptc_order *order, void *request,
                           dptc_error *err)
{
    dptc_shm_share_request *r = request;
    dptc_coll c = {.op = DPTC_OP_CALL, .dtype = DPTC_UINT8, .count = r->nbytes};
    channel *ch = &((shm_transport *)t)->channels[order->stream];
    CHECK(prologue(ch, &c, order, err));
    return share(ch, &c, r, order->seq, order->deadline, err);
}

static dptc_status shm_all_reduce(dptc_transport *t, const dptc_order *order, const dptc_coll *c,
                                  dptc_completion *done, dptc_error *err)
{
    return run(t, order, c, done, all_reduce, err);
}

static dptc_status shm_reduce_scatter(dptc_transport *t, const dptc_order *order,
                                      const dptc_coll *c, dptc_completion *done, dptc_error *err)
{
    return run(t, order, c, done, reduce_scatter, err);
}

static dptc_status shm_all_gather(dptc_transport *t, const dptc_order *order, const dptc_coll *c,
                                  dptc_completion *done, dptc_error *err)
{
    return run(t, order, c, done, all_gather, err);
}

static dptc_status shm_broadcast(dptc_transport *t, const dptc_order *order, const dptc_coll *c,
                                 dptc_completion *done, dptc_error *err)
{
    return run(t, order, c, done, broadcast, err);
}

static dptc_status shm_barrier(dptc_transport *t, const dptc_order *order, const dptc_coll *c,
                               dptc_completion *done, dptc_error *err)
{
    return run(t, order, c, done, barrier, err);
}

/* See [Note: abort record]. */
static void shm_abort(dptc_transport *t, dptc_status status, const char *reason)
{
    shm_transport *s = (shm_transport *)t;
    shm_header *h = s->header;
    uint32_t expected = 0;
    if (atomic_compare_exchange_strong(&h->claimed, &expected, 1)) {
        snprintf(h->reason, REASON_MAX, "%s", reason ? reason : "aborted");
        atomic_store(&h->aborter, (uint32_t)s->local_rank);
        atomic_store_explicit(&h->aborted, (uint32_t)status, memory_order_release);
    }
    /* Wake everyone sleeping on any counter of this node. */
    for (int k = 0; k < s->nstreams; k++)
        for (int p = 0; p < s->local_size; p++)
            futex(&s->channels[k].peers[p].counter, FUTEX_WAKE, INT_MAX, NULL);
}

/* [Note: a rank that leaves]
 * A rank that closes the group posts no step after it, so a peer still waiting
 * for one of its steps waits in vain; the pid check alone notices that only
 * once the process is gone, which takes seconds with torch loaded, and as long
 * as the script's own exit handlers (a logger's flush) run.  Closing marks the
 * rank's records `left` and wakes their sleepers.  A waiter that sees `left`
 * reads the counter again before it fails: the counter's last step was posted
 * before `left`, so a step the rank did post is never taken for a lost one. */
static void mark_left(shm_transport *s)
{
    for (int k = 0; k < s->nstreams; k++) {
        peer_record *me = s->channels[k].peers ? &s->channels[k].peers[s->local_rank] : NULL;
        if (!me)
            continue;
        atomic_store(&me->left, 1);
        futex(&me->counter, FUTEX_WAKE, INT_MAX, NULL);
    }
}

static void shm_destroy(dptc_transport *t)
{
    shm_transport *s = (shm_transport *)t;
    mark_left(s);
    /* Shared buffers belong to their owners; only forget them. */
    free(s->shared);
    free(s->global_ranks);
    pthread_mutex_destroy(&s->shared_lock);
    if (s->map)
        munmap(s->map, s->map_bytes);
    if (s->fd >= 0)
        close(s->fd);
    for (int k = 0; k < DPTC_MAX_STREAMS; k++)
        if (s->channels[k].bridge)
            dptc_bridge_free(s->channels[k].bridge);
    free(s);
}

static dptc_status shm_open_transport(const dptc_group_config *cfg, dptc_transport **out,
                                      dptc_error *err);

const dptc_transport_ops dptc_shm_transport = {
    .name = "shm",
    .open = shm_open_transport,
    .all_reduce = shm_all_reduce,
    .reduce_scatter = shm_reduce_scatter,
    .all_gather = shm_all_gather,
    .broadcast = shm_broadcast,
    .barrier = shm_barrier,
    .abort = shm_abort,
    .destroy = shm_destroy,
};

void dptc_shm_set_bridge(dptc_transport *t, int stream, dptc_bridge *bridge)
{
    shm_transport *s = (shm_transport *)t;
    channel *ch = &s->channels[stream];
    if (ch->bridge)
        dptc_bridge_free(ch->bridge);
    ch->bridge = bridge;
}

void dptc_shm_unlink(dptc_transport *t)
{
    shm_transport *s = (shm_transport *)t;
    if (s->fd >= 0) {
        close(s->fd);
        s->fd = -1;
    } else if (strncmp(s->name, "/dptc", 5) == 0) {
        shm_unlink(s->name);
    }
}

dptc_status dptc_shm_failure(dptc_transport *t, dptc_error *err)
{
    shm_transport *s = (shm_transport *)t;
    if (!atomic_load_explicit(&s->header->aborted, memory_order_acquire))
        return DPTC_OK;
    return aborted_error(s, err);
}

int dptc_shm_segment_fd(dptc_transport *t) { return ((shm_transport *)t)->fd; }

void dptc_shm_stagings(dptc_transport *t, int stream, dptc_op op, uint64_t counts[2])
{
    shm_transport *s = (shm_transport *)t;
    counts[0] = counts[1] = 0;
    staged_op kind = op == DPTC_OP_ALL_REDUCE       ? STAGED_ALL_REDUCE
                     : op == DPTC_OP_ALL_GATHER     ? STAGED_ALL_GATHER
                     : op == DPTC_OP_REDUCE_SCATTER ? STAGED_REDUCE_SCATTER
                     : op == DPTC_OP_BROADCAST      ? STAGED_BROADCAST
                                                    : STAGED_OPS;
    if (stream < 0 || stream >= s->nstreams || kind == STAGED_OPS)
        return;
    for (int k = 0; k < 2; k++)
        counts[k] = atomic_load_explicit(&s->channels[stream].staged[kind][k],
                                         memory_order_relaxed);
}

void dptc_shm_fill_slots_between(dptc_transport *t, int sentinel)
{
    shm_transport *s = (shm_transport *)t;
    atomic_store(&s->sentinel, sentinel < 0 ? -1 : sentinel & 0xff);
}

uint64_t dptc_shm_sentinel_fills(dptc_transport *t)
{
    shm_transport *s = (shm_transport *)t;
    uint64_t fills = 0;
    for (int k = 0; k < s->nstreams; k++)
        fills += atomic_load(&s->channels[k].sentinel_fills);
    return fills;
}

void *dptc_shm_slot(dptc_transport *t, int stream, int local, size_t *bytes)
{
    shm_transport *s = (shm_transport *)t;
    if (local < 0 || local >= s->local_size || stream < 0 || stream >= s->nstreams)
        return NULL;
    *bytes = s->region;
    return s->channels[stream].slots + (size_t)local * s->region;
}

static dptc_status shm_open_transport(const dptc_group_config *cfg, dptc_transport **out,
                                      dptc_error *err)
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
    s->base.ops = &dptc_shm_transport;
    s->fd = -1;
    atomic_init(&s->sentinel, -1);
    pthread_mutex_init(&s->shared_lock, NULL);
    s->local_rank = cfg->local_rank;
    s->local_size = cfg->local_size;
    s->node = cfg->node;
    s->nnodes = cfg->nnodes;
    s->nstreams = cfg->nstreams;
    s->global_ranks = malloc((size_t)cfg->size * sizeof *s->global_ranks);
    if (!s->global_ranks) {
        status = dptc_fail(err, DPTC_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int r = 0; r < cfg->size; r++)
        s->global_ranks[r] = cfg->global_ranks ? cfg->global_ranks[r] : r;
    s->slot_bytes = round_up(cfg->slot_bytes < 65536 ? 65536 : cfg->slot_bytes, ALIGN_BYTES);
    s->region = 2 * s->slot_bytes;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    /* Spinning only helps when every rank can own a core. */
    s->spin_s = cpus >= cfg->local_size ? 50e-6 : 2e-6;
    const dptc_shm_config *shm_cfg = cfg->transport_arg;
    s->staging = shm_cfg ? shm_cfg->staging : DPTC_SHM_STAGING_AUTO;
    if (s->staging != DPTC_SHM_STAGING_CACHED && s->staging != DPTC_SHM_STAGING_STREAMED &&
        s->staging != DPTC_SHM_STAGING_AUTO) {
        status = dptc_fail(err, DPTC_ERR_INVALID, "staging %d is not a dptc_shm_staging",
                           (int)s->staging);
        goto fail;
    }
    s->all_reduce_round = cfg->nnodes == 1 && cpus >= cfg->local_size &&
                                  s->slot_bytes > ALL_REDUCE_ROUND_BYTES
                              ? ALL_REDUCE_ROUND_BYTES
                              : s->slot_bytes;
    snprintf(s->name, sizeof s->name, "%s", cfg->shm_name);
    size_t slots_at = slots_offset(cfg->local_size, cfg->nstreams);
    s->map_bytes = slots_at + (size_t)(cfg->nstreams * cfg->local_size) * s->region;
    if (cfg->create)
        CHECK_GOTO(create_segment(cfg->shm_name, s->map_bytes, &s->fd, &s->map, err), status,
                   fail);
    else
        CHECK_GOTO(open_segment(cfg->shm_name, s->map_bytes, &s->map, err), status, fail);
    s->header = (shm_header *)s->map;
    if (cfg->create) {
        s->header->local_size = (uint32_t)cfg->local_size;
        s->header->node = (uint32_t)cfg->node;
        s->header->nstreams = (uint32_t)cfg->nstreams;
        s->header->slot_bytes = s->slot_bytes;
        s->header->version = SHM_VERSION;
        atomic_thread_fence(memory_order_release);
        s->header->magic = SHM_MAGIC;
    } else if (s->header->magic != SHM_MAGIC || s->header->version != SHM_VERSION) {
        /* Apart from the group's shape below: a segment of another layout version (a
         * node's ranks running different dptc builds) may match it in every field. */
        status = dptc_fail(err, DPTC_ERR_SYSTEM,
                           "shared segment %s has magic %x version %u, and this dptc build "
                           "reads magic %x version %u: every rank of a node must run the same "
                           "dptc build", cfg->shm_name, s->header->magic, s->header->version,
                           SHM_MAGIC, SHM_VERSION);
        goto fail;
    } else if (s->header->local_size != (uint32_t)cfg->local_size ||
               s->header->nstreams != (uint32_t)cfg->nstreams ||
               s->header->slot_bytes != s->slot_bytes) {
        status = dptc_fail(err, DPTC_ERR_SYSTEM,
                           "shared segment %s was not created for this group (%u local "
                           "ranks, %u streams, %llu slot bytes; this rank expects %d, %d, "
                           "%zu)", cfg->shm_name, s->header->local_size, s->header->nstreams,
                           (unsigned long long)s->header->slot_bytes, cfg->local_size,
                           cfg->nstreams, s->slot_bytes);
        goto fail;
    }
    for (int k = 0; k < s->nstreams; k++) {
        channel *ch = &s->channels[k];
        ch->s = s;
        ch->index = k;
        ch->peers = (peer_record *)(s->map + peers_offset()) + (size_t)k * (size_t)s->local_size;
        ch->slots = s->map + slots_at + (size_t)(k * s->local_size) * s->region;
        atomic_store(&ch->peers[s->local_rank].pid, (int32_t)getpid());
        atomic_store(&ch->peers[s->local_rank].share_fd, -1);
        for (int op = 0; op < STAGED_OPS && s->local_rank == 0; op++)
            /* The first collectives' staging: see [Note: staging]. */
            atomic_store(&ch->peers[0].staging[op], s->staging == DPTC_SHM_STAGING_AUTO
                                                        ? DPTC_SHM_STAGING_CACHED
                                                        : s->staging);
    }
    *out = &s->base;
    return DPTC_OK;
fail:
    shm_destroy(&s->base);
    return status;
}
