/* shm.h — the shared-memory transport between the ranks of one node, and
 * what it offers beyond the transport table: shared buffers, the staging
 * slots the bridge reads, and the cross-node bridge itself. */
#ifndef DPTC_SHM_H
#define DPTC_SHM_H

#include "bridge.h"
#include "transport.h"

extern const dptc_transport_ops dptc_shm_transport;

/* How a collective on one node stages its data in the slots; see [Note:
 * staging] in shm.c. */
typedef enum {
    DPTC_SHM_STAGING_CACHED = 0,    /* ordinary stores */
    DPTC_SHM_STAGING_STREAMED = 1,  /* non-temporal stores, of only what peers read */
    DPTC_SHM_STAGING_AUTO = 2,      /* local rank 0 times both and chooses */
} dptc_shm_staging;

/* What the shared-memory transport's open takes beyond the group config
 * (dptc_group_config.transport_arg; NULL: the defaults). */
typedef struct {
    dptc_shm_staging staging;
} dptc_shm_config;

/* Attaches the cross-node step of one stream (the transport owns it).  Call
 * before the stream's first collective, with nnodes > 1. */
void dptc_shm_set_bridge(dptc_transport *t, int stream, dptc_bridge *bridge);
/* Forgets the segment's name (closes the creator's descriptor, or removes
 * the /dev/shm name); safe to call twice.  Once every local rank has mapped
 * the segment, nothing of it is left for anyone else to find. */
void dptc_shm_unlink(dptc_transport *t);
/* The descriptor through which local peers open the segment (the creator's
 * memfd; they open /proc/<pid>/fd/<fd>), or -1 for a /dev/shm name. */
int dptc_shm_segment_fd(dptc_transport *t);
/* The abort a local peer recorded (see [Note: abort record] in shm.c), as
 * this rank would raise it; DPTC_OK while nobody aborted. */
dptc_status dptc_shm_failure(dptc_transport *t, dptc_error *err);
/* How many collectives `op` on `stream` went through the staging slots each
 * way so far, indexed by dptc_shm_staging (cached, streamed); zeros for
 * other ops and out of range. */
void dptc_shm_stagings(dptc_transport *t, int stream, dptc_op op, uint64_t counts[2]);
/* Tests only: from the next collective on, local rank 0 fills every
 * local rank's slots of a stream with the byte `sentinel` between any two
 * collectives on it (-1: no more); every local rank of the node must set
 * the same before the group's first collective, as the fills add steps.
 * See [Note: slots between collectives] in shm.c. */
void dptc_shm_fill_slots_between(dptc_transport *t, int sentinel);
/* Tests only: the fills so far, summed over the streams. */
uint64_t dptc_shm_sentinel_fills(dptc_transport *t);
/* Base address and size of the staging slots of local rank `local` on
 * `stream` (the bridge wraps these in tensors); NULL when out of range. */
void *dptc_shm_slot(dptc_transport *t, int stream, int local, size_t *bytes);

/* [Note: shared buffers]
 * A shared buffer is memory every local rank maps: each rank creates a
 * segment of the same size (collectively, in collective order, so the
 * buffers of all ranks carry the same id) and maps its peers' segments
 * too.  An all-reduce whose tensor lies in a shared buffer, in place and at
 * the same offset on every rank, needs no staging: each rank reduces its
 * part straight from its peers' memory and writes the result into every
 * peer's buffer (shm.c, all_reduce_shared).  DDP allocates its gradient
 * buckets this way, and FSDP its shard buffers, which the all-gather into
 * several outputs reads straight from every owner (all_gather_from_shared).
 * The mappings belong to the dptc_shared (its owner unmaps them with
 * dptc_shm_shared_free), so a buffer outlives the group that made it. */
typedef struct {
    uint64_t id;                          /* same on every local rank */
    size_t bytes;
    int local_rank, local_size;
    unsigned char *base[DPTC_MAX_LOCAL];  /* every local rank's segment, mapped here */
} dptc_shared;

typedef struct {
    size_t nbytes;
    dptc_shared *out;
} dptc_shm_share_request;

/* A dptc_coll.call (op DPTC_OP_CALL) with a dptc_shm_share_request as its
 * argument: collective over the local ranks; fills request->out, which the
 * transport remembers until dptc_shm_unshare. */
dptc_status dptc_shm_share(dptc_transport *t, const dptc_order *order, void *request,
                           dptc_error *err);
/* Forgets sh (collectives no longer route through it). */
void dptc_shm_unshare(dptc_transport *t, dptc_shared *sh);
/* Unmaps sh's segments.  After dptc_shm_unshare, or when the group is gone. */
void dptc_shm_shared_free(dptc_shared *sh);

#endif /* DPTC_SHM_H */
