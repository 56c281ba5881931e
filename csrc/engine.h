/* engine.h — process groups, their ordered work queue and work handles.
 *
 * [Note: tensors across the C boundary]
 * C never sees torch's C++ types.  Python hands C a data pointer, an element
 * count and a dtype code for each buffer, and keeps the tensors alive (the
 * Python Work object holds them) until the work has completed.  The engine
 * never calls back into Python on the hot path; the one exception is the
 * cross-node bridge (bridge.c), which takes the GIL to call gloo.
 *
 * [Note: collective order]
 * Every rank must issue a group's collectives in the same order.  The engine
 * numbers them (seq) and, inside the transport's first synchronisation of
 * each collective, compares a fingerprint (op, dtype, redop, count, root,
 * seq) with every peer.  A difference aborts the group on every rank with
 * DPTC_ERR_MISMATCH and a message naming what each side issued.
 */
#ifndef DPTC_ENGINE_H
#define DPTC_ENGINE_H

#include "dptc.h"

typedef struct dptc_group dptc_group;
typedef struct dptc_work dptc_work;

/* One collective, as issued by a rank.
 *   ALL_REDUCE:     input[count] -> output[count] (input == output allowed)
 *   BROADCAST:      input == output, count elements, from group rank root
 *   ALL_GATHER:     input[count] -> output[size * count], by rank
 *   REDUCE_SCATTER: input[size * count] -> output[count]
 *   BARRIER:        no buffers, count 0
 * count is per rank (the shard size for gather/scatter). */
typedef struct {
    dptc_op op;
    dptc_dtype dtype;
    dptc_redop redop;
    void *input;
    void *output;
    size_t count;
    int root;
} dptc_coll;

typedef struct {
    int rank, size;               /* in the whole group */
    int local_rank, local_size;   /* on this node (shared-memory peers) */
    int node, nnodes;             /* global rank = node * local_size + local_rank */
    const char *shm_name;         /* "/dptc-<token>-<node>" */
    int create;                   /* local rank 0 creates the segment */
    size_t slot_bytes;            /* staging bytes per rank per buffer */
    double timeout_s;             /* deadline of every wait */
} dptc_group_config;

dptc_status dptc_group_create(const dptc_group_config *config,
                              dptc_group **out, dptc_error *err);
/* Attaches the cross-node step (a dptc_bridge *, see transport.h); the group
 * owns it.  Call before the first collective, with nnodes > 1. */
void dptc_group_set_bridge(dptc_group *g, void *bridge);
/* Removes the segment's name from /dev/shm (safe to call twice). */
void dptc_group_unlink(dptc_group *g);
/* Marks the group failed here and in shared memory, waking every waiter on
 * every local rank; later collectives fail with DPTC_ERR_ABORTED. */
void dptc_group_abort(dptc_group *g, const char *reason);
/* Stops the progress thread (after draining or failing queued work) and
 * unmaps.  Call without the GIL. */
void dptc_group_destroy(dptc_group *g);

int dptc_group_rank(const dptc_group *g);
int dptc_group_size(const dptc_group *g);
double dptc_group_timeout(const dptc_group *g);
/* Base address and size of the staging area of local rank `local`
 * (the bridge wraps these in tensors); NULL when local is out of range. */
void *dptc_group_slot(dptc_group *g, int local, size_t *bytes);

/* [Note: shared buffers]
 * A shared buffer is memory every local rank maps: each rank creates a
 * segment of the same size (collectively, in collective order, so the
 * buffers of all ranks carry the same id) and maps its peers' segments
 * too.  An all-reduce whose tensor lies in a shared buffer, in place and at
 * the same offset on every rank, needs no staging: each rank reduces its
 * part straight from its peers' memory and writes the result into every
 * peer's buffer (shm.c, all_reduce_shared).  DDP allocates its gradient
 * buckets this way; FSDP will gather into shared parameters.  The mappings
 * belong to the dptc_shared (its owner unmaps them with dptc_shared_free),
 * so a buffer outlives the group that made it. */
#define DPTC_MAX_LOCAL 64
typedef struct {
    uint64_t id;                          /* same on every local rank */
    size_t bytes;
    int local_rank, local_size;
    unsigned char *base[DPTC_MAX_LOCAL];  /* every local rank's segment, mapped here */
} dptc_shared;

/* Collective over the group's local ranks; blocking, call without the GIL.
 * Fills *out; the group remembers it until dptc_group_unshare. */
dptc_status dptc_group_share(dptc_group *g, size_t nbytes, dptc_shared *out, dptc_error *err);
/* Forgets sh (the group may no longer route collectives through it). */
void dptc_group_unshare(dptc_group *g, dptc_shared *sh);
/* Unmaps sh's segments.  After dptc_group_unshare, or when the group is gone. */
void dptc_shared_free(dptc_shared *sh);

/* Queues c for the progress thread.  *out receives a new work reference
 * (release with dptc_work_release).  Safe without the GIL. */
dptc_status dptc_group_submit(dptc_group *g, const dptc_coll *c,
                              dptc_work **out, dptc_error *err);
/* Runs c to completion: on the calling thread when the queue is idle,
 * otherwise after the queued work.  Call without the GIL. */
dptc_status dptc_group_run(dptc_group *g, const dptc_coll *c, dptc_error *err);

/* Blocks until w completes or timeout_s seconds pass.  Returns the work's status; on failure copies its message into
 * err.  Call without the GIL. */
dptc_status dptc_work_wait(dptc_work *w, double timeout_s, dptc_error *err);
int dptc_work_is_completed(const dptc_work *w);
void dptc_work_retain(dptc_work *w);
void dptc_work_release(dptc_work *w);

#endif /* DPTC_ENGINE_H */
