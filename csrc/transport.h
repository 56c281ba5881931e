/* transport.h — the table of functions every transport fills.
 *
 * A transport moves the bytes of one collective between the ranks it
 * connects.  The engine (engine.c) orders collectives and hands them to the
 * transport one at a time, on one thread: transports need no locking of
 * their own for the collective calls.  abort may be called from any thread.
 */
#ifndef DPTC_TRANSPORT_H
#define DPTC_TRANSPORT_H

#include "dptc.h"
#include "engine.h"

typedef struct dptc_transport dptc_transport;

typedef struct {
    const char *name;
    /* Runs one collective to completion.  seq is the collective's number in
     * its group (see [Note: collective order] in engine.h). */
    dptc_status (*run)(dptc_transport *t, const dptc_coll *c, uint64_t seq,
                       double deadline, dptc_error *err);
    /* Wakes every waiter of every peer and makes later calls fail. */
    void (*abort)(dptc_transport *t, dptc_status status, const char *reason);
    void (*destroy)(dptc_transport *t);
} dptc_transport_ops;

struct dptc_transport {
    const dptc_transport_ops *ops;
};

/* The cross-node step (bridge.c): calls torch.distributed (gloo) on the
 * staging slot of this rank.  Implemented with the GIL taken inside. */
typedef struct dptc_bridge dptc_bridge;

typedef enum {
    DPTC_BRIDGE_ALL_REDUCE = 0,   /* in place on [offset, offset + count) */
    DPTC_BRIDGE_BROADCAST = 1,    /* in place, from the node `root` */
    DPTC_BRIDGE_ALL_GATHER = 2,   /* input at offset, output at offset2 (nnodes * count) */
    DPTC_BRIDGE_CHECK = 3,        /* compare fingerprints, see dptc_bridge_check */
} dptc_bridge_op;

/* Offsets are in bytes from the start of this rank's slot region, counts in
 * elements.  root is a node index. */
dptc_status dptc_bridge_call(dptc_bridge *b, dptc_bridge_op op,
                             dptc_dtype dtype, dptc_redop redop,
                             size_t offset, size_t offset2, size_t count,
                             int root, dptc_error *err);
/* Compares this collective's fingerprint with the ranks of my local index on
 * every other node; DPTC_ERR_MISMATCH naming both sides when they differ.
 * `text` describes mine for the message. */
dptc_status dptc_bridge_check(dptc_bridge *b, dptc_op op, dptc_dtype dtype, dptc_redop redop,
                              size_t count, uint64_t seq, int root, const char *text,
                              dptc_error *err);
void dptc_bridge_free(dptc_bridge *b);

/* The shared-memory transport between the ranks of one node (shm.c), with
 * the cross-node step delegated to bridge (NULL on one node). */
dptc_status dptc_shm_open(const dptc_group_config *config, dptc_transport **out,
                          dptc_error *err);
void dptc_shm_set_bridge(dptc_transport *t, dptc_bridge *bridge);
void dptc_shm_unlink(dptc_transport *t);
/* Shared buffers (see [Note: shared buffers] in engine.h). */
void dptc_shm_unshare(dptc_transport *t, dptc_shared *sh);
void dptc_shm_shared_free(dptc_shared *sh);

/* NULL when local is not a local rank. */
void *dptc_shm_slot(dptc_transport *t, int local, size_t *bytes);

#endif /* DPTC_TRANSPORT_H */
