/* nccl.h — the NCCL transport: CUDA tensors between the GPUs of a group.
 *
 * [Note: the NCCL transport]
 * One NCCL communicator per dptc group, built from a unique id the group's
 * rank 0 made and the others read from the store (dptc/group.py).  Each
 * engine stream has its own CUDA stream (non-blocking), so a collective
 * waits for the work of the stream that issued it, not for the other engine
 * stream's collectives.  On the device NCCL still runs one communicator's
 * kernels in the order they were issued, whatever their streams, and pairs
 * them across ranks in that order: the ranks must issue the streams'
 * collectives in the same interleaving, as dptc's wrappers do (one thread at
 * a time, in program order), while the order check compares each stream
 * alone.  The transport enqueues (see
 * [Note: device transports] in transport.h): on the issuing thread, a
 * collective records an event on the issuer's stream, makes its engine
 * stream's CUDA stream wait on it, enqueues the NCCL call and records its
 * completion event there; the host never waits in that path.  The progress
 * thread then polls the completion event against the deadline, NCCL's
 * asynchronous error (ncclCommGetAsyncError) and abort; a failure aborts the
 * communicator, so every rank raises instead of hanging.  A waiter makes its
 * own stream wait on the completion event (dptc_nccl_stream_wait) as
 * torch's Work.wait() does.
 *
 * Completion events come from a ring per stream and are never destroyed
 * before the transport: an event re-recorded by a later collective only
 * makes a late waiter wait for that later collective, which is safe.
 */
#ifndef DPTC_NCCL_H
#define DPTC_NCCL_H

#include "cudalib.h"
#include "engine.h"

/* What dptc_group_config.transport_arg holds for the NCCL transport. */
typedef struct {
    const dptc_cuda_api *api;      /* loaded (dptc_cuda_load) */
    int device;                    /* the CUDA device of this rank's tensors */
    dptc_nccl_unique_id id;        /* the same on every member */
} dptc_nccl_config;

extern const dptc_transport_ops dptc_nccl_transport;

/* Makes `stream` (a cudaStream_t; NULL: the legacy default stream) wait for
 * the completion a NCCL collective left (dptc_work_device_completion). */
dptc_status dptc_nccl_stream_wait(void *completion, void *stream, dptc_error *err);

#endif /* DPTC_NCCL_H */
