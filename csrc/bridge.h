/* bridge.h — the cross-node CPU step, handed to torch.distributed (gloo).
 * The shared-memory transport calls it from a stream's executing thread;
 * it takes the GIL inside. */
#ifndef DPTC_BRIDGE_H
#define DPTC_BRIDGE_H

#include "dptc.h"

typedef struct dptc_bridge dptc_bridge;

typedef enum {
    DPTC_BRIDGE_ALL_REDUCE = 0,      /* in place on [offset, offset + count) */
    DPTC_BRIDGE_BROADCAST = 1,       /* in place, from the node `root` */
    DPTC_BRIDGE_ALL_GATHER = 2,      /* input at offset, output at offset2 (nnodes * count) */
    DPTC_BRIDGE_CHECK = 3,           /* compare fingerprints, see dptc_bridge_check */
    DPTC_BRIDGE_ALL_TO_ALL = 4,      /* block k of nnodes at offset goes to node k; node k's
                                        block for me lands at offset2 + k * count elements */
} dptc_bridge_op;

/* Offsets are in bytes from the start of this rank's slot region of the
 * stream, counts in elements.  root is a node index. */
dptc_status dptc_bridge_call(dptc_bridge *b, dptc_bridge_op op, dptc_dtype dtype,
                             dptc_redop redop, size_t offset, size_t offset2, size_t count,
                             int root, dptc_error *err);
/* Compares this collective's fingerprint with the ranks of my local index on
 * every other node; DPTC_ERR_MISMATCH naming both sides when they differ.
 * pieces is the digest of a several-output all-gather's pieces (0 for any
 * other collective; see [Note: several pieces] in shm.c).  `text` describes
 * mine for the message. */
dptc_status dptc_bridge_check(dptc_bridge *b, dptc_op op, dptc_dtype dtype, dptc_redop redop,
                              size_t count, uint64_t seq, int root, uint64_t pieces,
                              const char *text, dptc_error *err);
void dptc_bridge_free(dptc_bridge *b);

#endif /* DPTC_BRIDGE_H */
