/* transport.h — the table of functions every transport fills.
 *
 * A transport moves the bytes of one collective between the ranks of a
 * group.  The engine (engine.c) orders the work of each stream and hands it
 * to the transport one operation at a time per stream, from that stream's
 * executing thread: a transport needs no locking between calls of one
 * stream, and keeps the state of each stream apart (see [Note: streams] in
 * engine.h).  abort may be called from any thread.
 *
 * [Note: completions]
 * Each operation leaves in *done what the engine waits on before it reports
 * the work complete.  The shared-memory transport moves the bytes on the
 * calling thread, so its operations are complete when they return: it
 * leaves done->wait NULL and the engine publishes completion on the work's
 * futex word at once.  A transport that only enqueues (NCCL: a kernel on a
 * CUDA stream) sets done->wait and done->handle (a CUDA event), and the
 * engine calls wait(handle, deadline, err) before it publishes completion.
 *
 * [Note: device transports]
 * A transport whose operations only enqueue device work sets `enqueues`.
 * The engine then calls its operations on the issuing thread, in the
 * stream's issue order, inside dptc_group_submit: the collective is ordered
 * after the work the issuer's device stream (dptc_coll.device_stream) holds
 * at that moment, never after work queued there later.  The progress thread
 * only runs done->wait, which watches the completion against the deadline,
 * the transport's asynchronous errors and abort.  A waiter that need not
 * block the host asks for done->handle (dptc_work_device_completion) and
 * makes its own stream wait on it.
 */
#ifndef DPTC_TRANSPORT_H
#define DPTC_TRANSPORT_H

#include "dptc.h"
#include "engine.h"

typedef struct {
    dptc_status (*wait)(void *handle, double deadline, dptc_error *err);
    void *handle;
} dptc_completion;

typedef dptc_status (*dptc_collective_fn)(dptc_transport *t, const dptc_order *order,
                                          const dptc_coll *c, dptc_completion *done,
                                          dptc_error *err);

struct dptc_transport_ops {
    const char *name;
    int enqueues;                      /* see [Note: device transports] */
    dptc_status (*open)(const dptc_group_config *config, dptc_transport **out, dptc_error *err);
    dptc_collective_fn all_reduce;
    dptc_collective_fn reduce_scatter;
    dptc_collective_fn all_gather;     /* both forms, see dptc_coll in engine.h */
    dptc_collective_fn broadcast;
    dptc_collective_fn barrier;
    /* Records the failure for every peer and wakes all of their waiters;
     * later operations fail with it. */
    void (*abort)(dptc_transport *t, dptc_status status, const char *reason);
    void (*destroy)(dptc_transport *t);
};

struct dptc_transport {
    const dptc_transport_ops *ops;
};

#endif /* DPTC_TRANSPORT_H */
