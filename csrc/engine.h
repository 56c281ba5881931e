/* engine.h — process groups, their ordered streams of work, work handles.
 *
 * [Note: tensors across the C boundary]
 * C never sees torch's C++ types.  module.c receives tensor objects, asks
 * each for its data pointer once (data_ptr()) and keeps a reference to the
 * tensor until the last work that touches it has completed.  When a wait
 * gives up (timeout, Ctrl-C), the group is aborted first, which makes queued
 * work fail at once and running work stop at its next wait; if the work
 * still has not completed after that, its tensors are leaked rather than
 * released (see [Note: memory of unfinished work] in module.c).  The engine
 * never calls back into Python on the hot path; the exceptions are the
 * cross-node bridge (bridge.c), which takes the GIL to call gloo, and the
 * interrupt check (see [Note: interrupts] in dptc.h).
 *
 * [Note: collective order]
 * Every rank must issue a stream's collectives in the same order.  The
 * engine numbers them per stream (seq) and, inside the transport's first
 * synchronisation of each collective, the transport compares a fingerprint
 * (op, dtype, redop, count, root, seq) with every peer.  A difference aborts
 * the group on every rank with DPTC_ERR_MISMATCH and a message naming what
 * each side issued.
 *
 * [Note: streams]
 * A group has nstreams independent ordered streams (DPTC_MAX_STREAMS at
 * most).  Each has its own queue, its own progress thread and its own
 * sequence numbers, and the transport gives each its own channel, so work on
 * one stream never waits behind work on another: an FSDP prefetch
 * all-gather on stream 0 completes while a gradient reduce-scatter runs on
 * stream 1.  Failure is per group: a failure on any stream aborts them all.
 */
#ifndef DPTC_ENGINE_H
#define DPTC_ENGINE_H

#include "dptc.h"

#define DPTC_MAX_STREAMS 4
#define DPTC_MAX_LOCAL 64

typedef struct dptc_group dptc_group;
typedef struct dptc_work dptc_work;
typedef struct dptc_transport dptc_transport;
typedef struct dptc_coll dptc_coll;

/* Where an operation runs and by when: its stream, its number there (see
 * [Note: collective order]) and its deadline (dptc_now() seconds). */
typedef struct {
    int stream;
    uint64_t seq;
    double deadline;
} dptc_order;

/* One collective, as issued by a rank.  count is per rank (the shard size
 * for gather/scatter).
 *   ALL_REDUCE:     input[count] -> output[count] (input == output allowed)
 *   BROADCAST:      input == output, count elements, from group rank root
 *   ALL_GATHER:     input[count] -> output[size * count], by rank; or, with
 *                   noutputs > 0, into several outputs: the input is the
 *                   concatenation of pieces of output_counts[j] elements and
 *                   output j receives size * output_counts[j] elements, rank
 *                   r's piece at r * output_counts[j] (FSDP gathers straight
 *                   into per-parameter storage this way)
 *   REDUCE_SCATTER: input[size * count] -> output[count]
 *   BARRIER:        no buffers, count 0
 *   CALL:           call(transport, order, call_arg, err), run in order */
struct dptc_coll {
    dptc_op op;
    dptc_dtype dtype;
    dptc_redop redop;
    void *input;
    void *output;
    size_t count;
    int root;
    int noutputs;
    void **outputs;            /* owned by the issuer until the work completes */
    const size_t *output_counts;
    dptc_status (*call)(dptc_transport *t, const dptc_order *order, void *arg, dptc_error *err);
    void *call_arg;
    void *device_stream;       /* the issuer's CUDA stream (a device transport orders the
                                  collective after the work queued there so far) */
};

/* A several-output all-gather's pieces decide where each rank's elements
 * land, so the transports' order checks compare them too (see [Note:
 * several pieces] in shm.c).  dptc_has_pieces: whether c is such a gather
 * (an all-gather into more than one output).  dptc_pieces_digest: FNV-1a
 * over every piece's count, kept to 63 bits (the cross-node check carries
 * it in an int64); 0 for any other collective. */
int dptc_has_pieces(const dptc_coll *c);
uint64_t dptc_pieces_digest(const dptc_coll *c);

/* The shape of a group as one rank sees it.  Group ranks are numbered node
 * by node: rank = node * local_size + local_rank, every node holding
 * local_size members (dptc/group.py maps any set of global ranks onto this). */
typedef struct {
    int rank, size;               /* in the whole group */
    int local_rank, local_size;   /* members on this node (shared-memory peers) */
    int node, nnodes;             /* nodes the group spans */
    int nstreams;                 /* see [Note: streams] */
    const char *shm_name;         /* "/dptc-<token>-<node>" */
    int create;                   /* local rank 0 creates the segment */
    size_t slot_bytes;            /* staging bytes per rank, stream and buffer */
    double timeout_s;             /* deadline of every wait */
    const int *global_ranks;      /* size entries, for messages; NULL: the group ranks */
    const void *transport_arg;    /* what the transport's open needs beyond this (NCCL:
                                     dptc_nccl_config in nccl.h); NULL for shm */
} dptc_group_config;

typedef struct dptc_transport_ops dptc_transport_ops;

/* Opens transport over the group config.  The group owns the transport. */
dptc_status dptc_group_create(const dptc_transport_ops *transport, const dptc_group_config *config,
                              dptc_group **out, dptc_error *err);
/* The group's transport, for the transport's own functions (shm.h). */
dptc_transport *dptc_group_transport(dptc_group *g);
/* Marks the group failed (DPTC_ERR_ABORTED) here and in the transport,
 * waking every waiter on every peer; later collectives fail with the same
 * message.  Safe from any thread, also after dptc_group_destroy (then a
 * no-op). */
void dptc_group_abort(dptc_group *g, const char *reason);
/* A reference to g for a caller that uses it without the GIL while another
 * thread may destroy it (dptc_group_abort can wait a moment for a device
 * transport, see [Note: aborting under an issuer] in nccl.c). */
void dptc_group_retain(dptc_group *g);
void dptc_group_release(dptc_group *g);
/* Fails queued work, stops the progress threads and closes the transport;
 * then drops the caller's reference.  Works still hold theirs, so a work
 * outlives its group.  Call without the GIL. */
void dptc_group_destroy(dptc_group *g);

/* The group's recorded failure: its status (DPTC_OK while healthy) and, on
 * failure, its message in err. */
dptc_status dptc_group_failure(dptc_group *g, dptc_error *err);

int dptc_group_rank(const dptc_group *g);
int dptc_group_size(const dptc_group *g);
int dptc_group_streams(const dptc_group *g);
double dptc_group_timeout(const dptc_group *g);
/* How long a wait for one of the group's works may take before it gives up:
 * the work's own deadline, plus as long again for the works queued ahead of
 * it on its stream (each with a deadline of its own), plus a second. */
double dptc_group_wait_deadline(const dptc_group *g);

/* Queues c on stream.  *out receives a new work reference (release with
 * dptc_work_release).  With a transport that enqueues (see [Note: device
 * transports] in transport.h) the collective is issued here, on the calling
 * thread, and only its completion is left to the progress thread.  Safe
 * without the GIL. */
dptc_status dptc_group_submit(dptc_group *g, int stream, const dptc_coll *c, dptc_work **out,
                              dptc_error *err);
/* Runs c to completion: on the calling thread when the stream is idle,
 * otherwise after its queued work.  When that wait gives up and the work has
 * still not completed, *unfinished receives a reference to it (its buffers
 * must outlive it); else NULL.  Call without the GIL. */
dptc_status dptc_group_run(dptc_group *g, int stream, const dptc_coll *c, dptc_work **unfinished,
                           dptc_error *err);

/* Blocks until w completes, timeout_s seconds pass, or the thread is
 * interrupted.  When it gives up, it aborts the group and waits (bounded) for
 * the work to stop; check dptc_work_is_completed afterwards before releasing
 * the work's buffers.  Returns the work's status; on failure copies its
 * message into err (may be NULL).  Call without the GIL. */
dptc_status dptc_work_wait(dptc_work *w, double timeout_s, dptc_error *err);
int dptc_work_is_completed(const dptc_work *w);
/* The completion a device transport left for w (a CUDA event, see
 * [Note: completions] in transport.h), or NULL: none, or w is completed. */
void *dptc_work_device_completion(const dptc_work *w);
void dptc_work_retain(dptc_work *w);
void dptc_work_release(dptc_work *w);

/* [Note: watched works]
 * A work whose future somebody asked for (Work.get_future, see dptc/_futures.py)
 * is watched: when it completes, the engine also adds one to a process-wide
 * count of watched completions and wakes whoever sleeps on it (the futures'
 * watcher thread).  Works nobody watches pay one flag read at completion.
 * The watcher reads the count, then looks at its works, then sleeps while
 * the count is still what it read, so no completion is missed: a work that
 * completed before dptc_work_watch was seen completed in the look, one that
 * completed after it changed the count.  The count is the process's (a
 * forked child gets a copy that no engine thread of its own moves). */
void dptc_work_watch(dptc_work *w);
/* The count of watched completions (and of dptc_watched_wake calls). */
uint32_t dptc_watched_count(void);
/* Adds one to the count and wakes its sleepers: a new work to watch, or
 * the watcher asked to stop. */
void dptc_watched_wake(void);
/* Sleeps while the count equals `seen`, at most timeout_s seconds (< 0:
 * without limit).  Call without the GIL. */
void dptc_watched_sleep(uint32_t seen, double timeout_s);

#endif /* DPTC_ENGINE_H */
