/* reducer.c — DDP's gradient reducer: buckets, hook objects, ready
 * counting, launch order, finalize, no_sync.
 *
 * dptc/ddp.py decides the bucket assignment and allocates the bucket tensors;
 * this file does everything that happens per step: a GradHook (one per
 * parameter, registered with register_post_accumulate_grad_hook) copies the
 * accumulated gradient into its bucket and marks it ready; full buckets are
 * submitted to the engine in bucket order while autograd keeps running; a
 * callback queued on the autograd engine by the first hook of each backward
 * waits for the buckets with the GIL released and writes the averages back
 * into .grad.  While a torch profiler records, each bucket's all-reduce and
 * the callback run inside named ranges (see [Note: profiler ranges] in
 * dptc/_ranges.py).
 *
 * [Note: gradient bucket lifetime]
 * A bucket is a flat torch tensor of one dtype, allocated by ddp.py
 * (torch.zeros) and handed to the Reducer by set_buckets, which keeps a
 * strong reference to it (and to every per-parameter view of it, and to the
 * 16-bit copy used by the compression hooks) until the next set_buckets or
 * the Reducer's deallocation.  The engine only ever sees raw pointers into
 * these tensors, so the rule is: a bucket tensor is released only when no
 * work that uses it is in flight.  Every path that drops buckets
 * (set_buckets, clear, dealloc) first runs step_end, which waits for every
 * submitted work — the waits are bounded, because the error paths abort the
 * group first and an aborted group fails its works at once.  A work that
 * has still not completed after its wait gave up (dptc_work_wait aborts the
 * group, then allows it a grace period) keeps its bucket: step_end leaks the
 * bucket's tensors instead of releasing them.  set_buckets is
 * refused while a backward is being reduced.  With
 * gradient_as_bucket_view=True a parameter's .grad *is* its view of the
 * bucket, so the tensor also lives as long as the user holds that .grad;
 * after a rebuild the grads are re-pointed at the new buckets (ddp.py) and
 * the old ones die with the last reference.  Bytes the engine touches
 * without the GIL that are not tensors (the used-parameter map) come from
 * PyMem_RawMalloc.
 *
 * [Note: bucket launch order]
 * Every rank holds the same bucket assignment, torch's: before the first
 * backward one bucket per dtype (the parameter order need not be the order
 * gradients arrive in; with find_unused_parameters, or bucket_cap_mb_list,
 * buckets of the usual sizes filled in definition order and launched the
 * last defined first, see first_buckets), afterwards
 * buckets of the usual sizes in the order observed on rank 0 in the first
 * backward, which ddp.py broadcasts (see _rebuild_buckets).  A Python comm
 * hook sees bucket k hold what it holds under torch.  Buckets are submitted
 * strictly in bucket order: when bucket k becomes full it is submitted only
 * if buckets 0..k-1 have been; otherwise it waits, and the hook that
 * completes bucket j submits j and then every full bucket after it
 * (launch_ready_buckets).  So every rank issues the same all-reduces in the
 * same order whatever order its gradients arrive in, which is what the
 * engine's fingerprint check (see [Note: collective order] in engine.h)
 * expects; a rank whose order differs gets a CollectiveMismatchError instead
 * of silently reducing the wrong bytes.  Buckets that are not full when
 * backward ends (unused parameters) are launched by the finalize callback,
 * still in order, and
 * with find_unused_parameters=True the used-parameter map is all-reduced
 * after the last bucket, so it too has the same position on every rank.
 *
 * [Note: unused parameters]
 * Without find_unused_parameters, a parameter whose hook did not fire in a
 * synced backward leaves its bucket forever unlaunched, and the peers that
 * did launch it wait for us.  The finalize callback detects it locally,
 * aborts the group with a message naming the parameters (so the peers'
 * waits fail with that message instead of timing out) and raises
 * RuntimeError here.  With find_unused_parameters, a locally unused
 * parameter contributes its current .grad (zeros when it is None, as in
 * torch), and a per-parameter used map (uint8, MAX) tells every rank which
 * parameters were used somewhere: those get the average, the others keep
 * .grad exactly as it was.  A parameter counts as used when its hook fired
 * with a gradient in any backward since the last synced one (no_sync steps
 * included), as in torch.
 *
 * [Note: buckets on a device]
 * When the group moves device tensors (its NCCL engine, for a CUDA module),
 * the buckets are device tensors and the reducer never touches their bytes:
 * gradients go in and averages come out through torch's copy_ on the
 * current stream, each bucket's all-reduce is ordered after the current
 * stream (current_stream(), called at launch), and the end-of-backward
 * callback makes the current stream wait for the buckets instead of the
 * host.  Gradients are copied into the buckets (no [Note: gradients in
 * place]).
 *
 * [Note: unused parameters on a device]
 * With find_unused_parameters on device buckets, the used map is built on
 * the host as above, then staged into a device tensor on the current stream
 * by ddp.py (_stage_used_map: pinned host bytes, an asynchronous copy) and
 * all-reduced there after the last bucket.  The host needs the reduced map
 * only when some parameter was unused here (as in torch's reducer): only
 * then does the end-of-backward callback wait for it on the host, within
 * the group's deadline, and copy it back; otherwise every parameter was
 * used somewhere, and the current stream just waits for the map like a
 * bucket.  A view-grad that nobody used is restored from a device clone.
 *
 * [Note: where finalize runs]
 * The finalize callback must run at the end of the outermost backward.
 * Queued from a gradient hook, it lands on the graph task that hook runs
 * in, which under reentrant activation checkpointing
 * (checkpoint(use_reentrant=True)) may be a nested backward that ends long
 * before the other parameters' gradients exist.  So forward registers a
 * pre-hook on the grad_fn of each output tensor (ddp.py, _expect_backward):
 * it runs in the outer backward before anything inside the module, and
 * queues the finalize there (_expect_finalize).  The first gradient hook
 * still queues it where no output pre-hook ran (a compiled wrapper, whose
 * forward dynamo traces, or a loss that does not come from the outputs).  A
 * backward that reaches the outputs but no parameter (torch.autograd.grad
 * of the outputs with respect to the inputs, as a gradient penalty does)
 * runs the callback with no hook seen: it leaves the step expecting the
 * next backward.
 *
 * [Note: one backward per forward]
 * A synced forward's gradients are averaged at the end of the first
 * backward that reaches its parameters.  A second backward through the same
 * forward's outputs (backward twice over one loss with retain_graph=True,
 * or one backward per output) adds gradients that would stay local, and the
 * replicas drift apart: torch's DDP raises for some of these ("marked as
 * ready twice", or an internal error under find_unused_parameters) and
 * leaves the others silently unaveraged.  The output pre-hook (see [Note:
 * where finalize runs]) firing after its forward's reduction marks the
 * backward running now as late, until a callback queued on it clears the
 * mark at its end; a gradient hook in a late backward raises on every rank.
 * Not late: a backward that reaches the outputs but no parameter
 * (torch.autograd.grad), which leaves the step expecting, and a backward
 * through the unwrapped module (ddp.module), which has no such pre-hook.
 *
 * [Note: static graph]
 * static_graph=True promises that every synced backward fires the same
 * hooks: the same parameters unused, and each used one the same number of
 * times (more than once under reentrant checkpointing of a module called
 * twice, where each nested backward accumulates into .grad separately).
 * As in torch, the first synced backward only counts: no bucket launches
 * during it, and its finalize records each parameter's count, marks every
 * parameter ready with its .grad, all-reduces the used map (as with
 * find_unused_parameters) and launches everything.  From then on a
 * parameter is ready when its hook has fired its count, the parameters
 * that were unused on this rank are marked ready at the first hook, and
 * the used map of the first backward stands: a parameter no rank used then
 * keeps its .grad untouched.  A hook beyond the count, or a count not
 * reached by the finalize, means the graph changed: every rank raises.  The
 * order for the bucket rebuild is the second synced backward's (the first
 * one's hooks mark nothing ready), with this rank's unused parameters
 * after it in index order, as torch's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dptc.h"
#include "engine.h"
#include "module.h"
#include "nccl.h"
#include "kernels.h"

/* Names listed in an unused-parameter error before "and N more". */
#define MAX_NAMES_IN_ERROR 16

/* How a bucket is communicated; chosen by register_comm_hook in ddp.py. */
typedef enum {
    COMM_PLAIN = 0, /* all-reduce AVG of the bucket in place */
    COMM_FP16 = 1,  /* cast to float16, all-reduce AVG, cast back */
    COMM_BF16 = 2,  /* cast to bfloat16, all-reduce AVG, cast back */
    COMM_PYTHON = 3, /* a Python hook, see [Note: Python comm hooks] */
} comm_mode;

/* The reducer's step, one state per backward. */
typedef enum {
    STEP_IDLE = 0,      /* no synced forward since the last backward (start,
                           no_sync, eval): hooks only record usage */
    STEP_EXPECTING = 1, /* a synced forward ran in grad mode: the next
                           backward's hooks reduce */
    STEP_REDUCING = 2,  /* the first hook of this backward fired and queued
                           the finalize callback; buckets are being filled
                           and launched */
} step_state;

typedef struct {
    /* Identity, fixed at construction */
    PyObject *param;     /* the nn.Parameter (owned) */
    PyObject *name;      /* its name in the wrapped module, for errors (owned) */
    dptc_dtype dtype;
    size_t nbytes;

    /* Placement, set by set_buckets */
    Py_ssize_t bucket;
    size_t offset;       /* in bytes, from the bucket's start */
    PyObject *view;      /* the bucket's bytes shaped like param (owned) */

    /* Per-backward state, cleared by step_end */
    int ready;           /* its gradient is in the bucket */
    int used;            /* a hook fired with a gradient since the last sync */
    PyObject *grad;      /* .grad as seen when it became ready (owned), or NULL */
    char *grad_data;     /* grad's bytes when contiguous and not the view */
    int grad_is_view;    /* grad is the bucket view: nothing to copy */
    int direct;          /* grad is reduced where it is, see [Note: gradients in place] */
    int fired;           /* static_graph: hooks fired in this backward */
    int expected;        /* static_graph: hooks per synced backward, counted in
                            the first one (see [Note: static graph]) */
    char *saved;         /* with gradient_as_bucket_view: the view's bytes
                            before the reduce, restored if no rank used it
                            (PyMem_RawMalloc) */
    PyObject *saved_tensor; /* the same for device buckets: a clone of the
                               view (owned) */
} param_slot;

typedef struct {
    /* Memory; see [Note: gradient bucket lifetime] */
    PyObject *tensor;       /* flat buffer of `count` elements (owned) */
    char *data;
    dptc_dtype dtype;
    size_t count;
    PyObject *comm_tensor;  /* 16-bit copy for compressed reduction (owned), or NULL */
    char *comm_data;
    dptc_dtype comm_dtype;

    /* Membership, in placement order */
    Py_ssize_t *members;    /* PyMem_Malloc */
    Py_ssize_t nmembers;

    /* Per-backward state */
    Py_ssize_t pending;     /* members not yet ready */
    dptc_work *work;        /* the submitted all-reduce; NULL before launch or
                               when the bucket is empty */
    PyObject *hooked;       /* COMM_PYTHON: what the launcher returned for
                               this bucket, until finished (owned), or NULL */
    PyObject *range;        /* its profiler range from launch until the reducer
                               sees it complete (see [Note: profiler ranges] in
                               dptc/_ranges.py), or NULL */
} bucket;

typedef struct ReducerObject ReducerObject;

typedef struct {
    PyObject_HEAD
    /* Borrowed: the Reducer owns its hooks and clears this pointer when it
     * goes away, so a hook outliving it (it sits in the parameter's hook
     * dict) does nothing. */
    ReducerObject *reducer;
    Py_ssize_t index;
} GradHookObject;

struct ReducerObject {
    PyObject_HEAD
    /* Configuration */
    PyObject *group;           /* dptc._C.Group the buckets are reduced in */
    PyObject *queue_callback;  /* Variable._execution_engine.queue_callback */
    int device;                /* see [Note: buckets on a device] */
    PyObject *current_stream;  /* device only: () -> torch.cuda.Stream */
    int find_unused;
    int static_graph;          /* see [Note: static graph] */
    int counted;               /* static_graph: every slot's `expected` is known */
    int as_view;               /* gradient_as_bucket_view */
    int overlap;               /* launch full buckets during backward; else
                                  all at its end, see [Note: overlap] */
    comm_mode comm;
    PyObject *launcher;        /* COMM_PYTHON: (bucket index) -> an object whose
                                  finish() writes the bucket's result (owned) */
    PyObject *after_step;      /* () called at the end of every synced backward,
                                  after the write-back (owned), or NULL: see
                                  [Note: sparse gradients] in
                                  dptc/_sparse.py */

    /* Parameters and buckets */
    param_slot *slots;
    Py_ssize_t nslots;
    bucket *buckets;
    Py_ssize_t nbuckets;
    PyObject *hooks;           /* list of GradHook */
    PyObject *handles;         /* list of RemovableHandle, to unregister */

    /* Per-backward state */
    step_state state;
    double scale;              /* reduced gradients are multiplied by it at
                                  the end, see [Note: a step's scale] */
    Py_ssize_t next_launch;    /* first bucket not yet submitted */
    Py_ssize_t hooks_seen;     /* gradient hooks fired in this synced backward */
    Py_ssize_t sparse_seen;    /* sparse gradients noted in it (_note_sparse_gradient) */
    Py_ssize_t open_ranges;    /* buckets whose range is open: while 0, hooks
                                  look for no completions */
    uint8_t *used_map;         /* nslots bytes, reduced by the engine thread */
    dptc_work *used_work;
    PyObject *stage_used_map;  /* device only: (bytes) -> the device tensor
                                  holding them, see [Note: unused parameters
                                  on a device] */
    PyObject *used_device;     /* that tensor, kept while its all-reduce may
                                  run (owned) */

    /* Order of the first synced backward, for the one bucket rebuild */
    Py_ssize_t *order;
    Py_ssize_t norder;
    int order_recorded;        /* a synced backward completed; order is final */

    /* A second backward through one forward: [Note: one backward per forward] */
    int reduced;               /* the last synced forward's backward was reduced */
    int late;                  /* a backward through that forward's outputs runs now */

    /* Counters, for tests and benchmarks */
    long long steps;
    long long launched_in_backward;
    long long launched_at_end;
    long long launched_in_place;  /* over gradients where they are: [Note: gradients in place] */
    double wait_seconds;          /* in the end-of-backward wait */
    double finalize_seconds;      /* in the end-of-backward callback, the wait and the
                                     buckets it runs on the calling thread included */
};

/* ------------------------------------------------------------------ */
/* Small helpers around tensors.  Statuses: DPTC_ERR_PYTHON means a Python
 * exception is set. */

/* dptc_tensor_data, as the char pointer the reducer does arithmetic on. */
static dptc_status tensor_bytes(PyObject *tensor, char **out)
{
    void *data;
    dptc_status status = dptc_tensor_data(tensor, &data);
    *out = data;
    return status;
}

static dptc_status tensor_flag(PyObject *tensor, const char *method, int *out)
{
    PyObject *flag = PyObject_CallMethod(tensor, method, NULL);
    if (!flag)
        return DPTC_ERR_PYTHON;
    *out = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    return *out < 0 ? DPTC_ERR_PYTHON : DPTC_OK;
}

/* Every copy runs without the GIL, so other Python threads (and the bridge's
 * cross-node step) run meanwhile. */
static void copy_bytes(void *dst, const void *src, size_t nbytes)
{
    if (!nbytes)
        return;
    Py_BEGIN_ALLOW_THREADS
    memcpy(dst, src, nbytes);
    Py_END_ALLOW_THREADS
}

static void zero_bytes(void *dst, size_t nbytes)
{
    if (!nbytes)
        return;
    Py_BEGIN_ALLOW_THREADS
    memset(dst, 0, nbytes);
    Py_END_ALLOW_THREADS
}

/* Sets param.grad = value; value may be NULL for None. */
static dptc_status set_grad(PyObject *param, PyObject *value)
{
    return PyObject_SetAttrString(param, "grad", value ? value : Py_None) < 0 ? DPTC_ERR_PYTHON
                                                                              : DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* Launching; see [Note: bucket launch order] */

static dptc_module_state *reducer_state(ReducerObject *r)
{
    return dptc_state_from_type(Py_TYPE(r));
}

/* [Note: gradients in place]
 * By default (plain all-reduce, no find_unused_parameters, no
 * gradient_as_bucket_view) a contiguous gradient is not copied into its
 * bucket: the bucket's all-reduce takes the members' memory as pieces (see
 * [Note: several pieces] in shm.c): each member's .grad, or its place in the
 * bucket for a member whose gradient had to be copied there.  The transport
 * stages the pieces through its slots and writes the averages back into
 * them, so .grad is updated in place, as torch's DDP leaves it, without the
 * two bucket copies: about half the memory traffic of copy in, reduce the
 * bucket, copy out.  The reducer holds each .grad (slot->grad) until the
 * step ends, and leaks it with its bucket if the work never completes. */
static int reduces_in_place(const ReducerObject *r)
{
    return r->comm == COMM_PLAIN && !r->find_unused && !r->as_view && !r->device &&
           !(r->static_graph && !r->counted);
}

/* Whether slot i's reduced value goes to its .grad: not for a parameter
 * that no rank used (with find_unused_parameters, in this step; with
 * static_graph, in the first synced backward).  Read once the used map is
 * reduced. */
static int slot_globally_used(const ReducerObject *r, Py_ssize_t i)
{
    return !(r->find_unused || r->static_graph) || r->used_map[i];
}

/* `method` of tensor with one tensor argument (copy_ on a device).  GIL held. */
static dptc_status tensor_call(PyObject *tensor, const char *method, PyObject *arg)
{
    PyObject *done = arg ? PyObject_CallMethod(tensor, method, "O", arg)
                         : PyObject_CallMethod(tensor, method, NULL);
    if (!done)
        return DPTC_ERR_PYTHON;
    Py_DECREF(done);
    return DPTC_OK;
}

/* tensor.mul_(scale), on the current stream for a device tensor.  GIL held. */
static dptc_status tensor_scale(PyObject *tensor, double scale)
{
    PyObject *done = PyObject_CallMethod(tensor, "mul_", "d", scale);
    if (!done)
        return DPTC_ERR_PYTHON;
    Py_DECREF(done);
    return DPTC_OK;
}

/* The current CUDA stream's handle (device buckets).  GIL held. */
static dptc_status current_stream(ReducerObject *r, void **out)
{
    *out = NULL;
    PyObject *stream = PyObject_CallNoArgs(r->current_stream);
    if (!stream)
        return DPTC_ERR_PYTHON;
    int rc = dptc_cuda_stream_handle(stream, out);
    Py_DECREF(stream);
    return rc < 0 ? DPTC_ERR_PYTHON : DPTC_OK;
}

/* Submits coll on stream 0 of a device group, ordered after the current
 * stream (a NCCL transport issues it on this thread, so without the GIL).
 * GIL held. */
static dptc_status device_submit(ReducerObject *r, dptc_group *g, dptc_coll *coll,
                                 dptc_work **out, dptc_error *err)
{
    CHECK(current_stream(r, &coll->device_stream));
    dptc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dptc_group_submit(g, 0, coll, out, err);
    Py_END_ALLOW_THREADS
    return status;
}

/* Runs coll for bucket b on this thread, the GIL released, as a blocking
 * collective does (see [Note: overlap]); work that did not complete stays
 * in b->work for step_end.  GIL held. */
static dptc_status bucket_run(dptc_group *g, bucket *b, const dptc_coll *coll, dptc_error *err)
{
    dptc_status status;
    dptc_watch watch;
    dptc_watch_signals(&watch);
    Py_BEGIN_ALLOW_THREADS
    status = dptc_group_run(g, 0, coll, &b->work, err);
    Py_END_ALLOW_THREADS
    return dptc_unwatch_signals(&watch, status, err);
}

/* Submits coll for bucket b, or with `here` runs it on this thread.  GIL
 * held. */
static dptc_status bucket_start(dptc_group *g, bucket *b, const dptc_coll *coll, int here,
                                dptc_error *err)
{
    return here ? bucket_run(g, b, coll, err) : dptc_group_submit(g, 0, coll, &b->work, err);
}

/* The all-reduce of bucket b over its members' pieces.  GIL held. */
static dptc_status bucket_submit_pieces(ReducerObject *r, dptc_group *g, bucket *b,
                                        dptc_coll *coll, int here, dptc_error *err)
{
    size_t n = (size_t)b->nmembers;
    void *pieces = PyMem_Malloc(n * (sizeof(void *) + sizeof(size_t)) + 1);
    if (!pieces)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory launching a bucket");
    void **outputs = pieces;
    size_t *counts = (size_t *)(outputs + n);
    size_t elsize = dptc_dtype_size(b->dtype);
    for (Py_ssize_t k = 0; k < b->nmembers; k++) {
        param_slot *s = &r->slots[b->members[k]];
        outputs[k] = s->direct ? s->grad_data : b->data + s->offset;
        counts[k] = s->nbytes / elsize;
    }
    coll->input = coll->output = NULL;
    coll->noutputs = (int)n;
    coll->outputs = outputs;
    coll->output_counts = counts;
    /* The work copies the arrays. */
    dptc_status status = bucket_start(g, b, coll, here, err);
    PyMem_Free(pieces);
    if (status == DPTC_OK)
        r->launched_in_place++;
    return status;
}

/* Opens bucket b's range while a profiler records.  GIL held. */
static dptc_status bucket_open_range(ReducerObject *r, bucket *b)
{
    dptc_module_state *st = reducer_state(r);
    if (!dptc_profiling(st))
        return DPTC_OK;
    CHECK(dptc_range_open(st, &b->range, "dptc::all_reduce bucket %zd",
                          (Py_ssize_t)(b - r->buckets)));
    r->open_ranges++;
    return DPTC_OK;
}

/* Closes bucket b's range, if open.  GIL held. */
static dptc_status bucket_close_range(ReducerObject *r, bucket *b)
{
    if (!b->range)
        return DPTC_OK;
    r->open_ranges--;
    return dptc_range_close(reducer_state(r), &b->range);
}

/* Closes the ranges of launched buckets whose all-reduce has completed, so
 * that a range ends at the first hook after its work did, not at the end of
 * backward.  GIL held. */
static dptc_status close_completed_ranges(ReducerObject *r)
{
    for (Py_ssize_t i = 0; i < r->next_launch && r->open_ranges > 0; i++) {
        bucket *b = &r->buckets[i];
        if (b->range && b->work && dptc_work_is_completed(b->work))
            CHECK(bucket_close_range(r, b));
    }
    return DPTC_OK;
}

/* [Note: Python comm hooks]
 * A hook that dptc does not run natively (see register_comm_hook in ddp.py)
 * runs in Python.  Gradients are copied into their bucket, as for the
 * compression hooks, and launching bucket k calls the launcher with k
 * instead of submitting work: ddp.py hands the hook a GradBucket over the
 * bucket tensor and keeps the future the hook returns.  Buckets launch in
 * the order and with the members torch's reducer gives them (see [Note:
 * bucket launch order]), so a hook that keeps state per bucket index sees
 * what it sees under torch.  At the end of backward, with the GIL held,
 * each launched bucket's finish() waits for its future (within the group's
 * deadline, and failing as soon as the group fails) and copies the result
 * into the bucket tensor; the write-back then moves it into .grad as
 * usual.  The engine never sees these buckets: whatever the hook
 * communicates holds its own references to the tensors it uses. */
static dptc_status bucket_launch_python(ReducerObject *r, bucket *b)
{
    PyObject *hooked = PyObject_CallFunction(r->launcher, "n", (Py_ssize_t)(b - r->buckets));
    if (!hooked)
        return DPTC_ERR_PYTHON;
    Py_XSETREF(b->hooked, hooked);
    return DPTC_OK;
}

/* Finishes a bucket launched through a Python hook: waits for the hook's
 * result and writes it into the bucket tensor.  GIL held. */
static dptc_status bucket_finish_python(ReducerObject *r, bucket *b)
{
    if (!b->hooked)
        return DPTC_OK;
    PyObject *done = PyObject_CallMethod(b->hooked, "finish", NULL);
    Py_CLEAR(b->hooked);
    if (!done)
        return DPTC_ERR_PYTHON;
    Py_DECREF(done);
    return bucket_close_range(r, b);
}

/* Submits bucket b's all-reduce, or with `here` runs it on this thread
 * (not through a Python hook or on a device).  GIL held. */
static dptc_status bucket_launch(ReducerObject *r, bucket *b, int here, dptc_error *err)
{
    if (b->count == 0)
        return DPTC_OK;
    dptc_group *g = dptc_group_from_object(reducer_state(r), r->group, "process_group");
    if (!g)
        return DPTC_ERR_PYTHON;
    /* The range covers the launch (and a compressing cast) too. */
    CHECK(bucket_open_range(r, b));
    if (r->comm == COMM_PYTHON)
        return bucket_launch_python(r, b);
    dptc_coll coll = {.op = DPTC_OP_ALL_REDUCE, .dtype = b->dtype, .redop = DPTC_AVG,
                      .input = b->data, .output = b->data, .count = b->count, .root = 0};
    /* Whether a member is direct may differ between ranks (a gradient that is
     * None here, a non-contiguous one): every rank takes the pieces, so that
     * all issue the same collective. */
    if (reduces_in_place(r))
        return bucket_submit_pieces(r, g, b, &coll, here, err);
    if (r->device) {
        /* See [Note: buckets on a device]. */
        if (b->comm_tensor) {
            CHECK(tensor_call(b->comm_tensor, "copy_", b->tensor));
            coll.dtype = b->comm_dtype;
            coll.input = coll.output = b->comm_data;
        }
        return device_submit(r, g, &coll, &b->work, err);
    }
    if (b->comm_tensor) {
        dptc_status status;
        Py_BEGIN_ALLOW_THREADS
        status = dptc_convert(b->comm_data, b->comm_dtype, b->data, b->dtype, b->count, err);
        Py_END_ALLOW_THREADS
        CHECK(status);
        coll.dtype = b->comm_dtype;
        coll.input = coll.output = b->comm_data;
    }
    return bucket_start(g, b, &coll, here, err);
}

/* [Note: overlap]
 * A bucket is normally launched as soon as it is full, so that its
 * all-reduce runs on the engine's progress thread while autograd goes on.
 * That pays only where the progress thread has a core of its own.  With as
 * many ranks as cores (2 ranks on 2 cores), each progress thread takes its
 * core from its own backward, and a large all-reduce, cut into rounds that
 * every rank's progress thread must pass together, goes at the pace of the
 * scheduler.  Measured there (benchmarks/ddp_step.py, alternating runs),
 * launching every bucket at the end of backward instead, when the main
 * threads only wait, made the step 1 to 3 % faster on average (single runs
 * scatter by a few percent either way).  ddp.py chooses: overlap = False
 * where a CPU group's node has fewer than two cores per local rank, unless
 * DPTC_DDP_OVERLAP says otherwise.  The buckets, their order and the numbers
 * are the same either way.  Without overlap the end-of-backward launches run
 * each bucket on the calling thread (bucket_run), as a blocking collective
 * does, not on the progress thread: the thread that wrote the gradients
 * reduces them, and the optimizer that reads them next finds them in its
 * own core's cache rather than in the core the progress thread ran on. */

/* Submits every full bucket from next_launch on, stopping at the first one
 * that is not full; during backward (at_end = 0) only with overlap.  GIL
 * held. */
static dptc_status launch_ready_buckets(ReducerObject *r, int at_end, dptc_error *err)
{
    if (!at_end && !r->overlap)
        return DPTC_OK;
    while (r->next_launch < r->nbuckets && r->buckets[r->next_launch].pending == 0) {
        CHECK(bucket_launch(r, &r->buckets[r->next_launch], at_end && !r->overlap, err));
        r->next_launch++;
        if (at_end)
            r->launched_at_end++;
        else
            r->launched_in_backward++;
    }
    return DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* The step */

/* Work that did not complete even after its wait gave up and aborted the
 * group may still write its bucket (a cross-node step blocked in gloo): the
 * bucket's tensors and the used map are leaked rather than ever released
 * (see [Note: memory of unfinished work] in module.c).  GIL held. */
static void step_leak_unfinished(ReducerObject *r)
{
    for (Py_ssize_t i = 0; i < r->nbuckets; i++) {
        bucket *b = &r->buckets[i];
        if (!b->work)
            continue;
        dptc_leak(b->tensor);
        dptc_leak(b->comm_tensor);
        for (Py_ssize_t k = 0; k < b->nmembers; k++)
            if (r->slots[b->members[k]].direct)
                dptc_leak(r->slots[b->members[k]].grad);
        b->work = NULL;  /* its reference is leaked with it */
    }
    if (r->used_work) {
        if (r->used_device) {
            dptc_leak(r->used_device);
        } else {
            /* The old map stays with the work; the reducer gets a fresh one. */
            uint8_t *fresh = PyMem_RawCalloc((size_t)r->nslots + 1, 1);
            if (fresh)
                r->used_map = fresh;
        }
        r->used_work = NULL;
    }
}

/* Waits for every submitted work (without the GIL), releases them, and
 * clears the per-backward state; used by finalize and by every error path
 * (which abort the group first, so the waits end at once).  GIL held. */
static void step_end(ReducerObject *r)
{
    int any = r->used_work != NULL;
    for (Py_ssize_t i = 0; i < r->nbuckets && !any; i++)
        any = r->buckets[i].work != NULL;
    if (any) {
        dptc_group *g = dptc_group_from_object(reducer_state(r), r->group, "process_group");
        double timeout = g ? dptc_group_wait_deadline(g) : 1.0;
        PyErr_Clear();
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < r->nbuckets; i++) {
            dptc_work *w = r->buckets[i].work;
            if (w) {
                dptc_work_wait(w, timeout, NULL);
                if (dptc_work_is_completed(w)) {
                    dptc_work_release(w);
                    r->buckets[i].work = NULL;
                }
            }
        }
        if (r->used_work) {
            dptc_work_wait(r->used_work, timeout, NULL);
            if (dptc_work_is_completed(r->used_work)) {
                dptc_work_release(r->used_work);
                r->used_work = NULL;
            }
        }
        Py_END_ALLOW_THREADS
        step_leak_unfinished(r);
    }
    for (Py_ssize_t i = 0; i < r->nbuckets; i++) {
        r->buckets[i].pending = r->buckets[i].nmembers;
        Py_CLEAR(r->buckets[i].hooked);  /* a failed step's */
        /* Left open by a failed step.  Reported against the group, not r:
         * in r's dealloc that would resurrect it (see reducer_remove_hooks). */
        if (bucket_close_range(r, &r->buckets[i]) != DPTC_OK)
            PyErr_WriteUnraisable(r->group);
    }
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        param_slot *s = &r->slots[i];
        s->ready = 0;
        s->fired = 0;
        s->grad_data = NULL;
        s->grad_is_view = 0;
        s->direct = 0;
        Py_CLEAR(s->grad);
        if (s->saved) {
            PyMem_RawFree(s->saved);
            s->saved = NULL;
        }
        Py_CLEAR(s->saved_tensor);
    }
    r->next_launch = 0;
    r->hooks_seen = 0;
    r->sparse_seen = 0;
    r->scale = 1.0;
    r->state = STEP_IDLE;
}

/* Aborts the group with `reason` so that peers waiting for our buckets fail
 * too, then ends the step.  GIL held; keeps a pending exception. */
static void step_abort(ReducerObject *r, const char *reason)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    dptc_group *g = dptc_group_from_object(reducer_state(r), r->group, "process_group");
    if (g)
        dptc_group_abort_released(g, reason);
    PyErr_Clear();
    step_end(r);
    PyErr_Restore(type, value, traceback);
}

/* Raises for a failure inside the step (from the engine or from Python),
 * after aborting the group and ending the step.  Returns NULL. */
static PyObject *step_fail(ReducerObject *r, dptc_status status, const dptc_error *err)
{
    dptc_module_state *st = reducer_state(r);
    if (status == DPTC_ERR_PYTHON) {
        step_abort(r, "DistributedDataParallel: a rank failed while reducing gradients "
                      "(a Python error in its backward pass)");
        return dptc_raise(st, status, err);
    }
    step_abort(r, err->message);
    return dptc_raise(st, status, err);
}

/* Checks that grad fits the slot: a CPU tensor of the slot's byte size.  A
 * module converted after wrapping (.half(), .double(), .to(device)) would
 * otherwise have the raw copies read or write out of bounds. */
static dptc_status slot_check_gradient(param_slot *s, PyObject *grad, int device)
{
    size_t nbytes = 0;
    int is_cpu = 0;
    PyObject *value = PyObject_GetAttrString(grad, "nbytes");
    if (!value)
        return DPTC_ERR_PYTHON;
    nbytes = PyLong_AsSize_t(value);
    Py_DECREF(value);
    if (PyErr_Occurred())
        return DPTC_ERR_PYTHON;
    value = PyObject_GetAttrString(grad, "is_cpu");
    if (!value)
        return DPTC_ERR_PYTHON;
    is_cpu = PyObject_IsTrue(value);
    Py_DECREF(value);
    if (is_cpu < 0)
        return DPTC_ERR_PYTHON;
    if (nbytes == s->nbytes && (is_cpu || device))
        return DPTC_OK;
    PyErr_Format(PyExc_RuntimeError,
                 "DistributedDataParallel: the gradient of parameter '%U' is a %s tensor of %zu "
                 "bytes, but DDP reserved %zu bytes of %s for it: the parameter changed dtype, "
                 "shape or device after the module was wrapped (e.g. .half(), .double() or "
                 ".to() on the DDP module).  Convert or move the module before wrapping it.",
                 s->name, is_cpu ? "CPU" : "non-CPU", nbytes, s->nbytes,
                 dptc_dtype_name(s->dtype));
    return DPTC_ERR_PYTHON;
}

/* Copies grad (param.grad, may be None) into the slot's place in its bucket
 * and remembers where to write the result.  GIL held. */
static dptc_status slot_capture(ReducerObject *r, param_slot *s, PyObject *grad)
{
    bucket *b = &r->buckets[s->bucket];
    char *place = b->data + s->offset;
    Py_CLEAR(s->grad);
    s->grad_data = NULL;
    s->grad_is_view = 0;
    s->direct = 0;
    if (grad == Py_None) {
        if (r->device)
            return tensor_call(s->view, "zero_", NULL);
        zero_bytes(place, s->nbytes);
        return DPTC_OK;
    }
    CHECK(slot_check_gradient(s, grad, r->device));
    s->grad = Py_NewRef(grad);
    if (s->nbytes == 0)
        return DPTC_OK;
    char *data;
    CHECK(tensor_bytes(grad, &data));
    if (data == place) {
        s->grad_is_view = 1;
        return DPTC_OK;
    }
    int contiguous = 0;
    if (!r->device)   /* device buckets: torch copies, see [Note: buckets on a device] */
        CHECK(tensor_flag(grad, "is_contiguous", &contiguous));
    if (contiguous) {
        s->grad_data = data;
        if (reduces_in_place(r) && slot_globally_used(r, s - r->slots))
            s->direct = 1;  /* see [Note: gradients in place] */
        else
            copy_bytes(place, data, s->nbytes);
        return DPTC_OK;
    }
    /* Non-contiguous gradient (e.g. a channels_last parameter): let torch
     * copy it; the copy back goes through torch too. */
    PyObject *done = PyObject_CallMethod(s->view, "copy_", "O", grad);
    if (!done)
        return DPTC_ERR_PYTHON;
    Py_DECREF(done);
    return DPTC_OK;
}

/* Marks slot `index` ready with its current gradient and launches what can
 * be launched.  GIL held. */
static dptc_status slot_mark_ready(ReducerObject *r, Py_ssize_t index, PyObject *grad,
                                   int at_end, dptc_error *err)
{
    param_slot *s = &r->slots[index];
    if (r->open_ranges > 0)
        CHECK(close_completed_ranges(r));
    CHECK(slot_capture(r, s, grad));
    s->ready = 1;
    bucket *b = &r->buckets[s->bucket];
    b->pending--;
    if (b->pending == 0)
        CHECK(launch_ready_buckets(r, at_end, err));
    return DPTC_OK;
}

/* Queues the finalize callback on the graph task running now (see [Note:
 * where finalize runs]); the step is then being reduced.  GIL held. */
static dptc_status queue_finalize(ReducerObject *r)
{
    PyObject *finalize = PyObject_GetAttrString((PyObject *)r, "_finalize");
    if (!finalize)
        return DPTC_ERR_PYTHON;
    PyObject *queued = PyObject_CallOneArg(r->queue_callback, finalize);
    Py_DECREF(finalize);
    if (!queued)
        return DPTC_ERR_PYTHON;
    Py_DECREF(queued);
    r->state = STEP_REDUCING;
    return DPTC_OK;
}

/* With gradient_as_bucket_view, a parameter that may turn out unused by
 * every rank must get its .grad back unchanged: saves the view's bytes
 * before its bucket is launched (which may start reducing them at once).
 * GIL held. */
static dptc_status slot_save_view(ReducerObject *r, param_slot *s, PyObject *grad, dptc_error *err)
{
    if (!r->as_view || grad == Py_None || !s->nbytes || s->saved || s->saved_tensor)
        return DPTC_OK;
    char *data;
    CHECK(tensor_bytes(grad, &data));
    char *place = r->buckets[s->bucket].data + s->offset;
    if (data != place)
        return DPTC_OK;
    if (r->device) {
        s->saved_tensor = PyObject_CallMethod(s->view, "clone", NULL);
        return s->saved_tensor ? DPTC_OK : DPTC_ERR_PYTHON;
    }
    s->saved = PyMem_RawMalloc(s->nbytes);
    if (!s->saved)
        return dptc_fail(err, DPTC_ERR_NOMEM, "out of memory saving a gradient");
    copy_bytes(s->saved, place, s->nbytes);
    return DPTC_OK;
}

/* Marks slot i ready with its current .grad, which does not make it used,
 * saving a view-grad first when `save`.  at_end: see launch_ready_buckets.
 * GIL held. */
static dptc_status slot_mark_ready_as_is(ReducerObject *r, Py_ssize_t i, int save, int at_end,
                                         dptc_error *err)
{
    PyObject *grad = PyObject_GetAttrString(r->slots[i].param, "grad");
    if (!grad)
        return DPTC_ERR_PYTHON;
    dptc_status status = save ? slot_save_view(r, &r->slots[i], grad, err) : DPTC_OK;
    if (status == DPTC_OK)
        status = slot_mark_ready(r, i, grad, at_end, err);
    Py_DECREF(grad);
    return status;
}

/* static_graph, after the first synced backward: at the first hook, marks
 * ready the parameters this rank did not use then (see [Note: static
 * graph]).  GIL held. */
static dptc_status mark_static_unused(ReducerObject *r, dptc_error *err)
{
    for (Py_ssize_t i = 0; i < r->nslots; i++)
        if (r->slots[i].expected == 0 && !r->slots[i].ready)
            CHECK(slot_mark_ready_as_is(r, i, !r->used_map[i], 0, err));
    return DPTC_OK;
}

/* A gradient arrived that the graph of the first synced backward did not
 * have (static_graph).  Raises after aborting the group; returns NULL. */
static PyObject *static_graph_changed(ReducerObject *r, param_slot *s)
{
    PyErr_Format(PyExc_RuntimeError,
                 "DistributedDataParallel: parameter '%U' received %d gradient(s) in this "
                 "backward pass, more than the %d it received in the first one.  "
                 "static_graph=True needs the same graph every iteration: the same parameters "
                 "used, each the same number of times.  Pass static_graph=False (with "
                 "find_unused_parameters=True if the set of used parameters changes).  The "
                 "process group has been aborted so that every rank raises.",
                 s->name, s->fired + 1, s->expected);
    step_abort(r, "DistributedDataParallel: a rank's graph changed under static_graph=True");
    return NULL;
}

/* A gradient in a backward through the outputs of a forward already
 * reduced: see [Note: one backward per forward].  Aborts the group, raises
 * RuntimeError and returns NULL. */
static PyObject *late_gradient(ReducerObject *r, param_slot *s)
{
    r->late = 0;
    PyErr_Format(PyExc_RuntimeError,
                 "DistributedDataParallel: parameter '%U' received a gradient in a second "
                 "backward pass through the outputs of one forward, after that forward's "
                 "gradients were averaged; this gradient would stay on this rank and the "
                 "replicas would drift apart.  Run backward() once per forward: sum the "
                 "losses (e.g. (loss_a + loss_b).backward() instead of a backward per loss, "
                 "or one backward instead of two with retain_graph=True), or run forward "
                 "again before the next backward.  The process group has been aborted so "
                 "that every rank raises.", s->name);
    step_abort(r, "DistributedDataParallel: a rank ran a second backward pass through the "
                  "outputs of one forward");
    return NULL;
}

/* The hook: param's gradient has been accumulated.  GIL held.
 * Returns a new reference (None) or NULL. */
static PyObject *reducer_on_gradient(ReducerObject *r, Py_ssize_t index)
{
    param_slot *s = &r->slots[index];
    if (r->state == STEP_IDLE) {
        if (r->late)
            return late_gradient(r, s);
        /* no_sync: .grad accumulates locally; only usage is recorded. */
        if ((r->find_unused || r->static_graph) && !s->used) {
            PyObject *grad = PyObject_GetAttrString(s->param, "grad");
            if (!grad)
                return NULL;
            s->used = grad != Py_None;
            Py_DECREF(grad);
        }
        Py_RETURN_NONE;
    }
    if (r->nbuckets == 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "DistributedDataParallel: gradient hook fired before buckets were set");
        return NULL;
    }
    dptc_error err = {{0}};
    if (r->static_graph && r->counted && s->fired >= s->expected)
        return static_graph_changed(r, s);
    if (!r->static_graph && s->ready) {
        PyErr_Format(PyExc_RuntimeError,
                     "DistributedDataParallel: parameter '%U' received its gradient twice in "
                     "one backward pass.  This happens when a parameter is used outside "
                     "forward, when several backward passes run for one forward (e.g. reentrant "
                     "activation checkpointing of a module called twice: pass "
                     "static_graph=True, or use use_reentrant=False), or when backward is "
                     "called twice on one graph; run each synced backward once per forward.",
                     s->name);
        step_abort(r, "DistributedDataParallel: a rank received a parameter's gradient twice "
                      "in one backward pass");
        return NULL;
    }
    if (r->state == STEP_EXPECTING && queue_finalize(r) != DPTC_OK)
        return NULL;
    r->hooks_seen++;
    PyObject *grad = PyObject_GetAttrString(s->param, "grad");
    if (!grad)
        return step_fail(r, DPTC_ERR_PYTHON, &err);
    if (grad != Py_None)
        s->used = 1;
    dptc_status status = DPTC_OK;
    int ready = 1;
    if (r->static_graph) {
        /* See [Note: static graph]: the first synced backward only counts. */
        s->fired++;
        ready = r->counted && s->fired == s->expected;
        if (r->counted && r->hooks_seen == 1)  /* this backward's first hook */
            status = mark_static_unused(r, &err);
    }
    if (ready && status == DPTC_OK) {
        if (!r->order_recorded && r->norder < r->nslots)
            r->order[r->norder++] = index;
        status = slot_mark_ready(r, index, grad, 0, &err);
    }
    Py_DECREF(grad);
    if (status != DPTC_OK)
        return step_fail(r, status, &err);
    Py_RETURN_NONE;
}

/* Whether slot s's parameter requires a gradient now (it did when the
 * reducer was built); for error messages.  GIL held. */
static dptc_status slot_requires_grad(const param_slot *s, int *out)
{
    PyObject *flag = PyObject_GetAttrString(s->param, "requires_grad");
    if (!flag)
        return DPTC_ERR_PYTHON;
    int truth = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (truth < 0)
        return DPTC_ERR_PYTHON;
    *out = truth;
    return DPTC_OK;
}

/* Without find_unused_parameters: every parameter must have been ready.
 * Returns DPTC_OK, or DPTC_ERR_PYTHON with RuntimeError set after aborting
 * the group.  See [Note: unused parameters]. */
static dptc_status check_all_ready(ReducerObject *r)
{
    Py_ssize_t missing = 0;
    for (Py_ssize_t i = 0; i < r->nslots; i++)
        missing += !r->slots[i].ready;
    if (missing == 0)
        return DPTC_OK;
    char reason[DPTC_ERROR_MAX] = "DistributedDataParallel: a rank had parameters without a "
                                  "gradient; pass find_unused_parameters=True";
    PyObject *names = NULL, *separator = NULL, *joined = NULL, *message = NULL;
    PyObject *frozen = NULL, *frozen_joined = NULL;
    names = PyList_New(0);
    frozen = PyList_New(0);
    if (!names || !frozen)
        goto exit;
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        if (r->slots[i].ready)
            continue;
        if (PyList_GET_SIZE(names) < MAX_NAMES_IN_ERROR &&
            PyList_Append(names, r->slots[i].name) < 0)
            goto exit;
        int wants_grad = 1;
        if (slot_requires_grad(&r->slots[i], &wants_grad) != DPTC_OK)
            goto exit;
        if (!wants_grad && PyList_GET_SIZE(frozen) < MAX_NAMES_IN_ERROR &&
            PyList_Append(frozen, r->slots[i].name) < 0)
            goto exit;
    }
    separator = PyUnicode_FromString(", ");
    joined = separator ? PyUnicode_Join(separator, names) : NULL;
    frozen_joined = joined ? PyUnicode_Join(separator, frozen) : NULL;
    if (!frozen_joined)
        goto exit;
    int rank = -1;
    dptc_group *g = dptc_group_from_object(reducer_state(r), r->group, "process_group");
    if (g)
        rank = dptc_group_rank(g);
    PyErr_Clear();
    Py_ssize_t more = missing - PyList_GET_SIZE(names);
    char more_text[64] = "";
    if (more)
        snprintf(more_text, sizeof more_text, " and %zd more", more);
    if (r->static_graph)
        message = PyUnicode_FromFormat(
            "DistributedDataParallel: %zd parameter(s) received fewer gradients in this "
            "backward pass on rank %d than in the first one: %U%s.  static_graph=True needs "
            "the same graph every iteration; pass static_graph=False (with "
            "find_unused_parameters=True if the set of used parameters changes).  The process "
            "group has been aborted so that every rank raises.",
            missing, rank, joined, more_text);
    else if (PyList_GET_SIZE(frozen) > 0)
        message = PyUnicode_FromFormat(
        "DistributedDataParallel: %zd parameter(s) did not receive a gradient in this backward "
        "pass on rank %d: %U%s.  Of these, %U had requires_grad=True when "
        "DistributedDataParallel was constructed and have requires_grad=False now; it reduces "
        "the parameters that required a gradient at construction, as torch's does.  Freeze "
        "parameters before wrapping the module (or wrap it again after freezing), or pass "
        "find_unused_parameters=True.  The process group has been aborted so that every rank "
        "raises.",
        missing, rank, joined, more_text, frozen_joined);
    else
        message = PyUnicode_FromFormat(
        "DistributedDataParallel: %zd parameter(s) did not receive a gradient in this backward "
        "pass on rank %d: %U%s.  Every parameter that requires a gradient must take part "
        "in computing the loss; if some legitimately do not (control flow, unused branches, "
        "forward outputs left out of the loss), pass find_unused_parameters=True to "
        "DistributedDataParallel, or set requires_grad=False on parameters that are never "
        "trained before wrapping the module.  If the loss is split over several backward() "
        "calls for one forward, sum the losses and call backward() once.  The process group "
        "has been aborted so that every rank raises.",
        missing, rank, joined, more_text);
    const char *text = message ? PyUnicode_AsUTF8(message) : NULL;
    if (!text)
        goto exit;
    snprintf(reason, sizeof reason, "%s", text);
    PyErr_SetObject(PyExc_RuntimeError, message);
exit:
    /* Whatever failed above, the peers must not wait for our buckets. */
    step_abort(r, reason);
    Py_XDECREF(message);
    Py_XDECREF(frozen_joined);
    Py_XDECREF(joined);
    Py_XDECREF(separator);
    Py_XDECREF(frozen);
    Py_XDECREF(names);
    return DPTC_ERR_PYTHON;
}

/* Device buckets: makes `stream` wait for *work, a bucket's (or the used
 * map's) all-reduce, while the host does not, or reports its failure, and
 * lets go of the work: the tensor outlives it, and the stream orders every
 * later use of the tensor after it.  Runs WITHOUT the GIL. */
static dptc_status work_complete_device(dptc_work **work, void *stream, dptc_error *err)
{
    if (!*work)
        return DPTC_OK;
    void *completion = dptc_work_device_completion(*work);
    dptc_status status = completion ? dptc_nccl_stream_wait(completion, stream, err)
                                    : dptc_work_wait(*work, 0, err);
    dptc_work_release(*work);
    *work = NULL;
    return status;
}

/* With find_unused_parameters, and in static_graph's first synced backward
 * (every parameter): marks every parameter that is not ready (with its
 * current .grad, which does not make it used, a view-grad saved first if
 * it is unused here), which launches the buckets they complete, and fills
 * the used map.  GIL held. */
static dptc_status mark_unused(ReducerObject *r, dptc_error *err)
{
    for (Py_ssize_t i = 0; i < r->nslots; i++)
        if (!r->slots[i].ready)
            CHECK(slot_mark_ready_as_is(r, i, !r->slots[i].used, 1, err));
    for (Py_ssize_t i = 0; i < r->nslots; i++)
        r->used_map[i] = (uint8_t)(r->slots[i].used != 0);
    return DPTC_OK;
}

/* Submits the used map's all-reduce, after every bucket (see [Note: bucket
 * launch order]).  GIL held. */
static dptc_status launch_used_map(ReducerObject *r, dptc_error *err)
{
    if (r->nslots == 0)
        return DPTC_OK;
    dptc_group *g = dptc_group_from_object(reducer_state(r), r->group, "process_group");
    if (!g)
        return DPTC_ERR_PYTHON;
    dptc_coll coll = {.op = DPTC_OP_ALL_REDUCE, .dtype = DPTC_UINT8, .redop = DPTC_MAX,
                      .input = r->used_map, .output = r->used_map,
                      .count = (size_t)r->nslots, .root = 0};
    if (!r->device)
        return dptc_group_submit(g, 0, &coll, &r->used_work, err);
    /* See [Note: unused parameters on a device]. */
    PyObject *flags = PyBytes_FromStringAndSize((const char *)r->used_map, r->nslots);
    if (!flags)
        return DPTC_ERR_PYTHON;
    PyObject *staged = PyObject_CallOneArg(r->stage_used_map, flags);
    Py_DECREF(flags);
    if (!staged)
        return DPTC_ERR_PYTHON;
    Py_XSETREF(r->used_device, staged);
    void *data;
    size_t count;
    CHECK(dptc_tensor_data(staged, &data));
    CHECK(dptc_tensor_numel(staged, &count));
    if (count != (size_t)r->nslots) {
        PyErr_Format(PyExc_RuntimeError, "Reducer: stage_used_map returned %zu elements for %zd "
                     "parameters", count, r->nslots);
        return DPTC_ERR_PYTHON;
    }
    coll.input = coll.output = data;
    return device_submit(r, g, &coll, &r->used_work, err);
}

/* Device buckets: finishes the used map's all-reduce (see [Note: unused
 * parameters on a device]).  When every parameter was used here, the map
 * is all ones and `stream` only waits for it; otherwise the host waits for
 * it within `timeout` and copies it back into used_map.  GIL held. */
static dptc_status used_map_complete_device(ReducerObject *r, void *stream, double timeout,
                                            dptc_error *err)
{
    int all_used = 1;
    for (Py_ssize_t i = 0; i < r->nslots && all_used; i++)
        all_used = r->used_map[i] != 0;
    dptc_status status;
    if (all_used) {
        Py_BEGIN_ALLOW_THREADS
        status = work_complete_device(&r->used_work, stream, err);
        Py_END_ALLOW_THREADS
        return status;
    }
    Py_BEGIN_ALLOW_THREADS
    status = dptc_work_wait(r->used_work, timeout, err);
    Py_END_ALLOW_THREADS
    if (!dptc_work_is_completed(r->used_work))
        return status;  /* step_end leaks the map with the work */
    dptc_work_release(r->used_work);
    r->used_work = NULL;
    CHECK(status);
    PyObject *host = PyObject_CallMethod(r->used_device, "cpu", NULL);
    if (!host)
        return DPTC_ERR_PYTHON;
    void *data;
    status = dptc_tensor_data(host, &data);
    if (status == DPTC_OK)
        memcpy(r->used_map, data, (size_t)r->nslots);
    Py_DECREF(host);
    return status;
}

/* Waits for bucket b, decompresses, and copies the results into the
 * contiguous, distinct .grad tensors.  Runs WITHOUT the GIL. */
static dptc_status bucket_complete(ReducerObject *r, bucket *b, double timeout, dptc_error *err)
{
    if (b->work) {
        dptc_status status = dptc_work_wait(b->work, timeout, err);
        if (dptc_work_is_completed(b->work)) {
            dptc_work_release(b->work);
            b->work = NULL;
        } /* else step_end leaks the bucket (see [Note: gradient bucket lifetime]) */
        CHECK(status);
    }
    /* Launched, and done: submitted and waited for above, or run at launch. */
    if (b->comm_tensor)
        CHECK(dptc_convert(b->data, b->dtype, b->comm_data, b->comm_dtype, b->count, err));
    for (Py_ssize_t k = 0; k < b->nmembers; k++) {
        Py_ssize_t i = b->members[k];
        param_slot *s = &r->slots[i];
        if (!s->grad_data || s->direct || r->as_view || !slot_globally_used(r, i))
            continue;
        memcpy(s->grad_data, b->data + s->offset, s->nbytes);
    }
    return DPTC_OK;
}

/* Waits for everything, in launch order, copying each bucket back as soon
 * as it is done and closing its range, if open, then.  Called with the GIL
 * held; releases it (and takes it back only to close a range). */
static dptc_status wait_and_copy_back(ReducerObject *r, dptc_error *err)
{
    dptc_group *g = dptc_group_from_object(reducer_state(r), r->group, "process_group");
    if (!g)
        return DPTC_ERR_PYTHON;
    void *stream = NULL;
    if (r->device)
        CHECK(current_stream(r, &stream));
    double timeout = dptc_group_wait_deadline(g);
    dptc_status status = DPTC_OK;
    double start = dptc_now();
    /* See [Note: Python comm hooks]. */
    for (Py_ssize_t i = 0; i < r->nbuckets && r->comm == COMM_PYTHON; i++) {
        status = bucket_finish_python(r, &r->buckets[i]);
        if (status != DPTC_OK)
            return status;
    }
    dptc_watch watch;
    dptc_watch_signals(&watch);
    if (r->used_work && r->device)
        status = used_map_complete_device(r, stream, timeout, err);
    Py_BEGIN_ALLOW_THREADS
    if (r->used_work && !r->device) {
        /* The map decides which copies happen; it was launched last. */
        status = dptc_work_wait(r->used_work, timeout, err);
        if (dptc_work_is_completed(r->used_work)) {
            dptc_work_release(r->used_work);
            r->used_work = NULL;
        }
    }
    for (Py_ssize_t i = 0; i < r->nbuckets && status == DPTC_OK; i++) {
        status = r->device ? work_complete_device(&r->buckets[i].work, stream, err)
                           : bucket_complete(r, &r->buckets[i], timeout, err);
        if (status == DPTC_OK && r->buckets[i].range) {
            Py_BLOCK_THREADS
            status = bucket_close_range(r, &r->buckets[i]);
            Py_UNBLOCK_THREADS
        }
    }
    Py_END_ALLOW_THREADS
    status = dptc_unwatch_signals(&watch, status, err);
    r->wait_seconds += dptc_now() - start;
    return status;
}

/* The parts of the write-back that need Python: new .grad tensors, views,
 * non-contiguous gradients, restored view-grads.  GIL held. */
static dptc_status write_back_python(ReducerObject *r)
{
    for (Py_ssize_t k = 0; k < r->nbuckets && r->device; k++)
        if (r->buckets[k].comm_tensor)
            CHECK(tensor_call(r->buckets[k].tensor, "copy_", r->buckets[k].comm_tensor));
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        param_slot *s = &r->slots[i];
        if (!slot_globally_used(r, i)) {
            if (s->saved)
                copy_bytes(r->buckets[s->bucket].data + s->offset, s->saved, s->nbytes);
            if (s->saved_tensor)
                CHECK(tensor_call(s->view, "copy_", s->saved_tensor));
            continue;
        }
        if (s->grad_is_view)
            continue;
        if (r->as_view) {
            CHECK(set_grad(s->param, s->view));
        } else if (!s->grad) {
            /* Unused here, used elsewhere: .grad appears, as in torch. */
            PyObject *copy = PyObject_CallMethod(s->view, "clone", NULL);
            if (!copy)
                return DPTC_ERR_PYTHON;
            dptc_status status = set_grad(s->param, copy);
            Py_DECREF(copy);
            CHECK(status);
        } else if (!s->grad_data && s->nbytes) {
            PyObject *done = PyObject_CallMethod(s->grad, "copy_", "O", s->view);
            if (!done)
                return DPTC_ERR_PYTHON;
            Py_DECREF(done);
        }
    }
    return DPTC_OK;
}

/* ------------------------------------------------------------------ */
/* GradHook */

static PyObject *hook_call(PyObject *op, PyObject *args, PyObject *kwargs)
{
    GradHookObject *self = (GradHookObject *)op;
    (void)args;
    (void)kwargs;
    if (!self->reducer)
        Py_RETURN_NONE;
    /* The hook may run the reducer's error path, which may drop the last
     * other reference to it. */
    ReducerObject *r = (ReducerObject *)Py_NewRef((PyObject *)self->reducer);
    PyObject *result = reducer_on_gradient(r, self->index);
    Py_DECREF(r);
    return result;
}

static void hook_dealloc(PyObject *op)
{
    PyTypeObject *type = Py_TYPE(op);
    type->tp_free(op);
    Py_DECREF(type);
}

static PyObject *hook_repr(PyObject *op)
{
    GradHookObject *self = (GradHookObject *)op;
    return PyUnicode_FromFormat("<dptc._C.GradHook for parameter %zd%s>", self->index,
                                self->reducer ? "" : " (detached)");
}

static PyType_Slot hook_slots[] = {
    {Py_tp_call, hook_call},
    {Py_tp_dealloc, hook_dealloc},
    {Py_tp_repr, hook_repr},
    {Py_tp_doc, "DDP's post-accumulate-grad hook of one parameter (created by Reducer)."},
    {0, NULL},
};

static PyType_Spec hook_spec = {
    .name = "dptc._C.GradHook",
    .basicsize = sizeof(GradHookObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = hook_slots,
};

/* ------------------------------------------------------------------ */
/* Reducer: construction and buckets */

static void buckets_free(bucket *buckets, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(buckets[i].tensor);
        Py_XDECREF(buckets[i].comm_tensor);
        Py_XDECREF(buckets[i].range);
        Py_XDECREF(buckets[i].hooked);
        PyMem_Free(buckets[i].members);
    }
    PyMem_Free(buckets);
}

static int dtype_arg(PyObject *value, int allow_none, dptc_dtype *out, const char *what)
{
    if (allow_none && value == Py_None) {
        *out = DPTC_DTYPE_COUNT;
        return 0;
    }
    long code = PyLong_AsLong(value);
    if (code == -1 && PyErr_Occurred())
        return -1;
    if (code < 0 || code >= DPTC_DTYPE_COUNT) {
        PyErr_Format(PyExc_ValueError, "%s: unknown dtype code %ld", what, code);
        return -1;
    }
    *out = (dptc_dtype)code;
    return 0;
}

static PyObject *reducer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"group", "params", "names", "dtypes", "queue_callback",
                               "find_unused_parameters", "gradient_as_bucket_view",
                               "current_stream", "stage_used_map", "static_graph",
                               "after_step", NULL};
    PyObject *group, *params, *names, *dtypes, *queue_callback, *stream_fn = Py_None;
    PyObject *stage_fn = Py_None, *after_step = Py_None;
    int find_unused, as_view, static_graph = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!O!Opp|$OOpO:Reducer", keywords, &group,
                                     &PyList_Type, &params, &PyList_Type, &names, &PyList_Type,
                                     &dtypes, &queue_callback, &find_unused, &as_view,
                                     &stream_fn, &stage_fn, &static_graph, &after_step))
        return NULL;
    if (after_step != Py_None && !PyCallable_Check(after_step)) {
        PyErr_SetString(PyExc_TypeError, "Reducer: after_step must be None or a callable");
        return NULL;
    }
    dptc_module_state *st = dptc_state_from_type(type);
    if (!dptc_group_from_object(st, group, "group"))
        return NULL;
    int device = dptc_group_object_is_device(group);
    if (device && !PyCallable_Check(stream_fn)) {
        PyErr_SetString(PyExc_TypeError, "Reducer: device buckets need current_stream, a callable");
        return NULL;
    }
    if (device && (find_unused || static_graph) && !PyCallable_Check(stage_fn)) {
        PyErr_SetString(PyExc_TypeError, "Reducer: find_unused_parameters or static_graph on "
                                         "device buckets needs stage_used_map, a callable");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(params);
    if (PyList_GET_SIZE(names) != n || PyList_GET_SIZE(dtypes) != n) {
        PyErr_SetString(PyExc_ValueError, "Reducer: params, names and dtypes differ in length");
        return NULL;
    }
    if (!PyCallable_Check(queue_callback)) {
        PyErr_SetString(PyExc_TypeError, "Reducer: queue_callback must be callable");
        return NULL;
    }
    ReducerObject *r = (ReducerObject *)type->tp_alloc(type, 0);
    if (!r)
        return NULL;
    r->group = Py_NewRef(group);
    r->queue_callback = Py_NewRef(queue_callback);
    r->device = device;
    r->current_stream = device ? Py_NewRef(stream_fn) : NULL;
    r->stage_used_map = device && PyCallable_Check(stage_fn) ? Py_NewRef(stage_fn) : NULL;
    r->after_step = after_step == Py_None ? NULL : Py_NewRef(after_step);
    /* static_graph finds the unused parameters itself, once. */
    r->find_unused = find_unused && !static_graph;
    r->static_graph = static_graph;
    r->as_view = as_view;
    r->overlap = 1;
    r->comm = COMM_PLAIN;
    r->state = STEP_IDLE;
    r->scale = 1.0;
    r->slots = PyMem_Calloc((size_t)n + 1, sizeof *r->slots);
    r->order = PyMem_Calloc((size_t)n + 1, sizeof *r->order);
    r->used_map = PyMem_RawCalloc((size_t)n + 1, 1);
    r->hooks = PyList_New(0);
    r->handles = PyList_New(0);
    if (!r->slots || !r->order || !r->used_map) {
        PyErr_NoMemory();
        goto fail;
    }
    if (!r->hooks || !r->handles)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        param_slot *s = &r->slots[i];
        PyObject *name = PyList_GET_ITEM(names, i);
        if (!PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "Reducer: names must be str");
            goto fail;
        }
        if (dtype_arg(PyList_GET_ITEM(dtypes, i), 0, &s->dtype, "Reducer") < 0)
            goto fail;
        /* The parameter's own bytes: a complex parameter is reduced as its real
         * pairs, so its dtype is the real one and its element twice the size. */
        PyObject *nbytes = PyObject_GetAttrString(PyList_GET_ITEM(params, i), "nbytes");
        if (!nbytes)
            goto fail;
        s->nbytes = PyLong_AsSize_t(nbytes);
        Py_DECREF(nbytes);
        if (PyErr_Occurred())
            goto fail;
        s->param = Py_NewRef(PyList_GET_ITEM(params, i));
        s->name = Py_NewRef(name);
        s->bucket = -1;
        r->nslots = i + 1;
    }
    return (PyObject *)r;
fail:
    Py_DECREF(r);
    return NULL;
}

/* Reads one (tensor, dtype, members, views, comm_tensor, comm_dtype) entry
 * into b and places its members.  Returns -1 with an exception set. */
static int bucket_from_entry(ReducerObject *r, PyObject *entry, Py_ssize_t index, bucket *b,
                             PyObject **views)
{
    PyObject *tensor, *dtype, *members, *member_views, *comm_tensor, *comm_dtype;
    if (!PyArg_ParseTuple(entry, "OOO!O!OO:set_buckets entry", &tensor, &dtype, &PyList_Type,
                          &members, &PyList_Type, &member_views, &comm_tensor, &comm_dtype))
        return -1;
    if (dtype_arg(dtype, 0, &b->dtype, "set_buckets") < 0 ||
        dtype_arg(comm_dtype, 1, &b->comm_dtype, "set_buckets") < 0)
        return -1;
    Py_ssize_t nmembers = PyList_GET_SIZE(members);
    if (PyList_GET_SIZE(member_views) != nmembers) {
        PyErr_SetString(PyExc_ValueError, "set_buckets: members and views differ in length");
        return -1;
    }
    b->tensor = Py_NewRef(tensor);
    if (tensor_bytes(tensor, &b->data) != DPTC_OK || dptc_tensor_numel(tensor, &b->count) != DPTC_OK)
        return -1;
    if (comm_tensor != Py_None) {
        if (b->comm_dtype != DPTC_FLOAT16 && b->comm_dtype != DPTC_BFLOAT16) {
            PyErr_SetString(PyExc_ValueError, "set_buckets: comm buffers must be 16-bit");
            return -1;
        }
        if (b->dtype != DPTC_FLOAT32 && b->dtype != DPTC_FLOAT64) {
            PyErr_SetString(PyExc_ValueError,
                            "set_buckets: only float32/float64 buckets are compressed");
            return -1;
        }
        size_t comm_count;
        b->comm_tensor = Py_NewRef(comm_tensor);
        if (tensor_bytes(comm_tensor, &b->comm_data) != DPTC_OK ||
            dptc_tensor_numel(comm_tensor, &comm_count) != DPTC_OK)
            return -1;
        if (comm_count != b->count) {
            PyErr_SetString(PyExc_ValueError, "set_buckets: comm buffer size differs");
            return -1;
        }
    }
    b->members = PyMem_Calloc((size_t)nmembers + 1, sizeof *b->members);
    if (!b->members) {
        PyErr_NoMemory();
        return -1;
    }
    size_t offset = 0, elem = dptc_dtype_size(b->dtype);
    for (Py_ssize_t k = 0; k < nmembers; k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(members, k));
        if (i == -1 && PyErr_Occurred())
            return -1;
        if (i < 0 || i >= r->nslots || views[i]) {
            PyErr_Format(PyExc_ValueError,
                         "set_buckets: parameter index %zd is out of range or repeated", i);
            return -1;
        }
        param_slot *s = &r->slots[i];
        if (s->dtype != b->dtype) {
            PyErr_Format(PyExc_ValueError, "set_buckets: parameter '%U' is %s, bucket %zd is %s",
                         s->name, dptc_dtype_name(s->dtype), index, dptc_dtype_name(b->dtype));
            return -1;
        }
        PyObject *view = PyList_GET_ITEM(member_views, k);
        char *view_data;
        if (tensor_bytes(view, &view_data) != DPTC_OK)
            return -1;
        if (s->nbytes && view_data != b->data + offset) {
            PyErr_Format(PyExc_ValueError,
                         "set_buckets: the view of '%U' is not at offset %zu of bucket %zd",
                         s->name, offset, index);
            return -1;
        }
        views[i] = view;
        b->members[b->nmembers++] = i;
        offset += s->nbytes;
    }
    if (offset != b->count * elem) {
        PyErr_Format(PyExc_ValueError, "set_buckets: bucket %zd holds %zu bytes, members need %zu",
                     index, b->count * elem, offset);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(set_buckets_doc,
"set_buckets(buckets, comm_mode, launcher=None)\n--\n\n"
"Installs a bucket assignment, in launch order.  Each entry is\n"
"(tensor, dtype_code, member_indices, member_views, comm_tensor, comm_dtype_code);\n"
"members are packed contiguously in the listed order.  comm_mode: 0 plain,\n"
"1 fp16 compression, 2 bf16 compression, 3 a Python hook: launcher(k) is called\n"
"to launch bucket k and returns an object whose finish() writes its result into\n"
"the bucket tensor (see [Note: Python comm hooks]).  Not allowed during a backward.");

static PyObject *reducer_set_buckets(PyObject *op, PyObject *args)
{
    ReducerObject *r = (ReducerObject *)op;
    PyObject *entries, *launcher = Py_None, *result = NULL;
    int mode;
    if (!PyArg_ParseTuple(args, "O!i|O:set_buckets", &PyList_Type, &entries, &mode, &launcher))
        return NULL;
    if (r->state == STEP_REDUCING) {
        PyErr_SetString(PyExc_RuntimeError,
                        "DistributedDataParallel: buckets cannot change during a backward pass");
        return NULL;
    }
    if (mode < COMM_PLAIN || mode > COMM_PYTHON) {
        PyErr_Format(PyExc_ValueError, "set_buckets: unknown comm mode %d", mode);
        return NULL;
    }
    if ((mode == COMM_PYTHON) != PyCallable_Check(launcher)) {
        PyErr_SetString(PyExc_TypeError, "set_buckets: comm mode 3 takes a callable launcher, "
                                         "the others none");
        return NULL;
    }
    Py_ssize_t nbuckets = PyList_GET_SIZE(entries);
    bucket *buckets = PyMem_Calloc((size_t)nbuckets + 1, sizeof *buckets);
    PyObject **views = PyMem_Calloc((size_t)r->nslots + 1, sizeof *views); /* borrowed */
    Py_ssize_t *owner = PyMem_Calloc((size_t)r->nslots + 1, sizeof *owner);
    size_t *offsets = PyMem_Calloc((size_t)r->nslots + 1, sizeof *offsets);
    if (!buckets || !views || !owner || !offsets) {
        PyErr_NoMemory();
        goto exit;
    }
    for (Py_ssize_t j = 0; j < nbuckets; j++) {
        if (bucket_from_entry(r, PyList_GET_ITEM(entries, j), j, &buckets[j], views) < 0)
            goto exit;
        size_t offset = 0;
        for (Py_ssize_t k = 0; k < buckets[j].nmembers; k++) {
            Py_ssize_t i = buckets[j].members[k];
            owner[i] = j;
            offsets[i] = offset;
            offset += r->slots[i].nbytes;
        }
    }
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        if (!views[i]) {
            PyErr_Format(PyExc_ValueError, "set_buckets: parameter '%U' is in no bucket",
                         r->slots[i].name);
            goto exit;
        }
    }
    /* Nothing is in flight and the per-backward state is clean here (state
     * is not REDUCING): swap, and let exit free the old buckets.  See
     * [Note: gradient bucket lifetime]. */
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        param_slot *s = &r->slots[i];
        s->bucket = owner[i];
        s->offset = offsets[i];
        Py_XSETREF(s->view, Py_NewRef(views[i]));
    }
    for (Py_ssize_t j = 0; j < nbuckets; j++)
        buckets[j].pending = buckets[j].nmembers;
    bucket *installed = buckets;
    buckets = r->buckets;
    r->buckets = installed;
    Py_ssize_t ninstalled = nbuckets;
    nbuckets = r->nbuckets;
    r->nbuckets = ninstalled;
    r->comm = (comm_mode)mode;
    Py_XSETREF(r->launcher, mode == COMM_PYTHON ? Py_NewRef(launcher) : NULL);
    result = Py_NewRef(Py_None);
exit:
    if (buckets)
        buckets_free(buckets, nbuckets);
    PyMem_Free(views);
    PyMem_Free(owner);
    PyMem_Free(offsets);
    return result;
}

PyDoc_STRVAR(register_hooks_doc,
"register_hooks()\n--\n\n"
"Registers one GradHook per parameter with register_post_accumulate_grad_hook.");

static PyObject *reducer_register_hooks(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    ReducerObject *r = (ReducerObject *)op;
    dptc_module_state *st = reducer_state(r);
    if (PyList_GET_SIZE(r->hooks) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "Reducer: hooks are already registered");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        GradHookObject *hook = (GradHookObject *)st->hook_type->tp_alloc(st->hook_type, 0);
        if (!hook)
            return NULL;
        hook->reducer = r;
        hook->index = i;
        int appended = PyList_Append(r->hooks, (PyObject *)hook);
        PyObject *handle = appended < 0 ? NULL
                                        : PyObject_CallMethod(r->slots[i].param,
                                                              "register_post_accumulate_grad_hook",
                                                              "O", (PyObject *)hook);
        Py_DECREF(hook);
        if (!handle)
            return NULL;
        appended = PyList_Append(r->handles, handle);
        Py_DECREF(handle);
        if (appended < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* Detaches the hooks and unregisters them (the latter calls Python; an
 * error is written as unraisable, against the handle: the reducer may be
 * in its dealloc, where reporting against it would resurrect it and free it
 * twice).  A handle the garbage collector already cleared (the reducer's
 * dealloc ran from a cycle's collection, which empties the handles'
 * __dict__ too) raises AttributeError: its hooks dict is garbage as well,
 * so that one is dropped silently.  GIL held. */
static void reducer_remove_hooks(ReducerObject *r)
{
    if (r->hooks) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r->hooks); i++)
            ((GradHookObject *)PyList_GET_ITEM(r->hooks, i))->reducer = NULL;
    }
    if (r->handles) {
        PyObject *handles = r->handles;
        r->handles = NULL;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(handles); i++) {
            PyObject *handle = PyList_GET_ITEM(handles, i);
            PyObject *done = PyObject_CallMethod(handle, "remove", NULL);
            if (!done && PyErr_ExceptionMatches(PyExc_AttributeError))
                PyErr_Clear();
            else if (!done)
                PyErr_WriteUnraisable(handle);
            Py_XDECREF(done);
        }
        Py_DECREF(handles);
    }
}

static PyObject *reducer_remove_hooks_method(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    ReducerObject *r = (ReducerObject *)op;
    reducer_remove_hooks(r);
    Py_CLEAR(r->hooks);
    r->hooks = PyList_New(0);
    r->handles = PyList_New(0);
    if (!r->hooks || !r->handles)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(prepare_doc,
"prepare_for_backward(sync, scale=1.0)\n--\n\n"
"Called by forward: the next backward reduces (sync=True) or only accumulates.\n"
"scale multiplies its averages (see [Note: a step's scale]).\n"
"Raises if the previous synced backward was interrupted before it finished.");

static PyObject *reducer_prepare_for_backward(PyObject *op, PyObject *args)
{
    ReducerObject *r = (ReducerObject *)op;
    int sync;
    double scale = 1.0;
    if (!PyArg_ParseTuple(args, "p|d:prepare_for_backward", &sync, &scale))
        return NULL;
    if (r->state == STEP_REDUCING) {
        /* A backward started reducing and never reached its finalize
         * callback (an exception interrupted it): peers may be waiting for
         * buckets this rank will never launch. */
        PyErr_SetString(PyExc_RuntimeError,
                        "DistributedDataParallel: the previous backward pass was interrupted "
                        "before its gradients were reduced, so the ranks no longer agree on "
                        "the reduction; the process group has been aborted.  Fix the error "
                        "raised in that backward pass.");
        step_abort(r, "DistributedDataParallel: a rank's backward pass was interrupted before "
                      "its gradients were reduced");
        return NULL;
    }
    r->state = sync ? STEP_EXPECTING : STEP_IDLE;
    r->scale = sync ? scale : 1.0;
    r->reduced = 0;
    r->late = 0;
    Py_RETURN_NONE;
}

/* [Note: a step's scale]
 * Under DDP's join() with divide_by_initial_world_size=False, a step's
 * gradients are divided by the number of ranks that have not yet joined
 * rather than by the group's size (ddp.py learns that number in forward).
 * The buckets are still all-reduced with AVG (the joined ranks contribute
 * zeros), and each reduced .grad is then multiplied by size / non-joined,
 * here, once the write-back is done: 1 ulp from torch's sum of
 * grad / non-joined at most, and exact where both are powers of two.
 * Gradients that no rank used keep their value.  GIL held. */
static dptc_status scale_gradients(ReducerObject *r)
{
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        param_slot *s = &r->slots[i];
        if (!s->nbytes || !slot_globally_used(r, i))
            continue;
        PyObject *grad = PyObject_GetAttrString(s->param, "grad");
        if (!grad)
            return DPTC_ERR_PYTHON;
        dptc_status status = grad == Py_None ? DPTC_OK : tensor_scale(grad, r->scale);
        Py_DECREF(grad);
        CHECK(status);
    }
    return DPTC_OK;
}

/* The body of _finalize, inside its range.  GIL held. */
static PyObject *finalize_step(ReducerObject *r)
{
    dptc_error err = {{0}};
    dptc_status status;
    if (r->hooks_seen == 0 && r->sparse_seen == 0) {
        /* Queued by an output's pre-hook in a backward that reached no
         * parameter: see [Note: where finalize runs]. */
        r->state = STEP_EXPECTING;
        Py_RETURN_NONE;
    }
    int counting = r->static_graph && !r->counted;  /* [Note: static graph] */
    if (counting)
        for (Py_ssize_t i = 0; i < r->nslots; i++)
            r->slots[i].expected = r->slots[i].fired;
    if (r->find_unused || counting) {
        status = mark_unused(r, &err);
        if (status != DPTC_OK)
            return step_fail(r, status, &err);
    } else if (check_all_ready(r) != DPTC_OK) {
        return NULL; /* the group is aborted and the step ended */
    }
    status = launch_ready_buckets(r, 1, &err);  /* what waited, see [Note: overlap] */
    if (status == DPTC_OK && (r->find_unused || counting))
        status = launch_used_map(r, &err);
    if (status != DPTC_OK)
        return step_fail(r, status, &err);
    status = wait_and_copy_back(r, &err);
    if (status != DPTC_OK)
        return step_fail(r, status, &err);
    if (write_back_python(r) != DPTC_OK)
        return step_fail(r, DPTC_ERR_PYTHON, &err);
    if (r->scale != 1.0 && scale_gradients(r) != DPTC_OK)
        return step_fail(r, DPTC_ERR_PYTHON, &err);
    if (r->after_step) {
        PyObject *done = PyObject_CallNoArgs(r->after_step);
        if (!done)
            return step_fail(r, DPTC_ERR_PYTHON, &err);
        Py_DECREF(done);
    }
    if (r->find_unused || counting)
        for (Py_ssize_t i = 0; i < r->nslots; i++)
            r->slots[i].used = 0;
    if (counting) {
        r->counted = 1;
    } else {
        /* static_graph: this rank's unused parameters close the order. */
        for (Py_ssize_t i = 0; i < r->nslots && r->static_graph && !r->order_recorded; i++)
            if (r->slots[i].expected == 0 && r->norder < r->nslots)
                r->order[r->norder++] = i;
        r->order_recorded = 1;
    }
    r->steps++;
    step_end(r);
    r->reduced = 1;  /* [Note: one backward per forward] */
    Py_RETURN_NONE;
}

PyDoc_STRVAR(finalize_doc,
"_finalize()\n--\n\n"
"End-of-backward callback (queued by an output's pre-hook or the first hook):\n"
"launches what is left, waits without the GIL and writes the averaged\n"
"gradients into .grad.");

PyDoc_STRVAR(expect_finalize_doc,
"_expect_finalize(*grads)\n--\n\n"
"Pre-hook of a synced forward's output grad_fn: queues the finalize on the\n"
"backward running now (see [Note: where finalize runs]).  Returns None.");

static PyObject *reducer_expect_finalize(PyObject *op, PyObject *Py_UNUSED(args))
{
    ReducerObject *r = (ReducerObject *)op;
    if (r->state == STEP_EXPECTING && queue_finalize(r) != DPTC_OK)
        return NULL;
    if (r->state == STEP_IDLE && r->reduced && !r->late) {
        /* See [Note: one backward per forward]. */
        PyObject *end = PyObject_GetAttrString(op, "_end_late_backward");
        PyObject *queued = end ? PyObject_CallOneArg(r->queue_callback, end) : NULL;
        Py_XDECREF(end);
        if (!queued)
            return NULL;
        Py_DECREF(queued);
        r->late = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *reducer_end_late_backward(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    ((ReducerObject *)op)->late = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(note_sparse_doc,
"_note_sparse_gradient()\n--\n\n"
"Hook of a parameter the reducer does not hold (a sparse gradient, see\n"
"[Note: sparse gradients] in dptc/_sparse.py): in a synced backward, queues the\n"
"finalize as the first gradient hook would and counts the backward as one that\n"
"reached a parameter, so that after_step runs at its end.  Returns None.");

static PyObject *reducer_note_sparse(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    ReducerObject *r = (ReducerObject *)op;
    if (r->state == STEP_IDLE)
        Py_RETURN_NONE;  /* no_sync: the gradient accumulates locally */
    if (r->state == STEP_EXPECTING && queue_finalize(r) != DPTC_OK)
        return NULL;
    r->sparse_seen++;
    Py_RETURN_NONE;
}

static PyObject *reducer_finalize(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    ReducerObject *r = (ReducerObject *)op;
    if (r->state != STEP_REDUCING)
        Py_RETURN_NONE;
    dptc_module_state *st = reducer_state(r);
    PyObject *range = NULL;
    if (dptc_profiling(st) && dptc_range_open(st, &range, "dptc::ddp finalize") != DPTC_OK) {
        dptc_error err = {{0}};
        return step_fail(r, DPTC_ERR_PYTHON, &err);
    }
    double start = dptc_now();
    PyObject *result = finalize_step(r);
    r->finalize_seconds += dptc_now() - start;
    if (dptc_range_close(st, &range) != DPTC_OK)
        Py_CLEAR(result);
    return result;
}

static PyObject *reducer_get_observed_order(PyObject *op, void *Py_UNUSED(closure))
{
    ReducerObject *r = (ReducerObject *)op;
    if (!r->order_recorded)
        Py_RETURN_NONE;
    PyObject *order = PyList_New(r->norder);
    if (!order)
        return NULL;
    for (Py_ssize_t k = 0; k < r->norder; k++) {
        PyObject *index = PyLong_FromSsize_t(r->order[k]);
        if (!index) {
            Py_DECREF(order);
            return NULL;
        }
        PyList_SET_ITEM(order, k, index);
    }
    return order;
}

static PyObject *reducer_get_stats(PyObject *op, void *Py_UNUSED(closure))
{
    ReducerObject *r = (ReducerObject *)op;
    return Py_BuildValue("{s:L,s:n,s:L,s:L,s:L,s:d,s:d,s:i}", "steps", r->steps, "buckets",
                         r->nbuckets, "launched_in_backward", r->launched_in_backward,
                         "launched_at_end", r->launched_at_end, "launched_in_place",
                         r->launched_in_place, "wait_seconds", r->wait_seconds,
                         "finalize_seconds", r->finalize_seconds, "comm_mode", (int)r->comm);
}

static PyObject *reducer_get_state(PyObject *op, void *Py_UNUSED(closure))
{
    static const char *names[] = {"idle", "expecting", "reducing"};
    return PyUnicode_FromString(names[((ReducerObject *)op)->state]);
}

/* ------------------------------------------------------------------ */
/* Reducer: life cycle */

static int reducer_traverse(PyObject *op, visitproc visit, void *arg)
{
    ReducerObject *r = (ReducerObject *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(r->group);
    Py_VISIT(r->queue_callback);
    Py_VISIT(r->current_stream);
    Py_VISIT(r->stage_used_map);
    Py_VISIT(r->after_step);
    Py_VISIT(r->used_device);
    Py_VISIT(r->hooks);
    Py_VISIT(r->handles);
    Py_VISIT(r->launcher);
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        Py_VISIT(r->slots[i].param);
        Py_VISIT(r->slots[i].name);
        Py_VISIT(r->slots[i].view);
        Py_VISIT(r->slots[i].grad);
        Py_VISIT(r->slots[i].saved_tensor);
    }
    for (Py_ssize_t j = 0; j < r->nbuckets; j++) {
        Py_VISIT(r->buckets[j].tensor);
        Py_VISIT(r->buckets[j].comm_tensor);
        Py_VISIT(r->buckets[j].range);
        Py_VISIT(r->buckets[j].hooked);
    }
    return 0;
}

static int reducer_clear(PyObject *op)
{
    ReducerObject *r = (ReducerObject *)op;
    if (r->group) {
        if (r->state == STEP_REDUCING)
            step_abort(r, "DistributedDataParallel: a rank's reducer was destroyed during a "
                          "backward pass");
        step_end(r); /* see [Note: gradient bucket lifetime] */
    }
    if (r->hooks)
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r->hooks); i++)
            ((GradHookObject *)PyList_GET_ITEM(r->hooks, i))->reducer = NULL;
    Py_CLEAR(r->hooks);
    Py_CLEAR(r->handles);
    buckets_free(r->buckets, r->nbuckets);
    r->buckets = NULL;
    r->nbuckets = 0;
    for (Py_ssize_t i = 0; i < r->nslots; i++) {
        Py_CLEAR(r->slots[i].param);
        Py_CLEAR(r->slots[i].name);
        Py_CLEAR(r->slots[i].view);
    }
    Py_CLEAR(r->queue_callback);
    Py_CLEAR(r->current_stream);
    Py_CLEAR(r->stage_used_map);
    Py_CLEAR(r->after_step);
    Py_CLEAR(r->used_device);
    Py_CLEAR(r->launcher);
    Py_CLEAR(r->group);
    return 0;
}

static void reducer_dealloc(PyObject *op)
{
    ReducerObject *r = (ReducerObject *)op;
    PyTypeObject *type = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    if (r->group && r->state == STEP_REDUCING)
        step_abort(r, "DistributedDataParallel: a rank's reducer was destroyed during a "
                      "backward pass");
    if (r->group)
        step_end(r);
    reducer_remove_hooks(r); /* a dead DDP must stop reducing */
    reducer_clear(op);
    PyMem_Free(r->slots);
    PyMem_Free(r->order);
    PyMem_RawFree(r->used_map);
    type->tp_free(op);
    Py_DECREF(type);
}

static PyMethodDef reducer_methods[] = {
    {"set_buckets", reducer_set_buckets, METH_VARARGS, set_buckets_doc},
    {"register_hooks", reducer_register_hooks, METH_NOARGS, register_hooks_doc},
    {"remove_hooks", reducer_remove_hooks_method, METH_NOARGS,
     "remove_hooks()\n--\n\nUnregisters the hooks (the reducer stops reducing)."},
    {"prepare_for_backward", reducer_prepare_for_backward, METH_VARARGS, prepare_doc},
    {"_finalize", reducer_finalize, METH_NOARGS, finalize_doc},
    {"_expect_finalize", reducer_expect_finalize, METH_VARARGS, expect_finalize_doc},
    {"_note_sparse_gradient", reducer_note_sparse, METH_NOARGS, note_sparse_doc},
    {"_end_late_backward", reducer_end_late_backward, METH_NOARGS,
     "_end_late_backward()\n--\n\nCallback at the end of a backward through the outputs of "
     "a forward already\nreduced (see [Note: one backward per forward]).  Returns None."},
    {NULL, NULL, 0, NULL},
};

static PyObject *reducer_get_in_place(PyObject *op, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(reduces_in_place((ReducerObject *)op));
}

static PyObject *reducer_get_overlap(PyObject *op, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(((ReducerObject *)op)->overlap);
}

/* The truth of a boolean attribute's new value, or -1 with an exception set
 * (also for deleting it). */
static int setting_truth(PyObject *value, const char *name)
{
    if (!value) {
        PyErr_Format(PyExc_AttributeError, "Reducer.%s cannot be deleted", name);
        return -1;
    }
    return PyObject_IsTrue(value);
}

static int reducer_set_overlap(PyObject *op, PyObject *value, void *Py_UNUSED(closure))
{
    ReducerObject *r = (ReducerObject *)op;
    int on = setting_truth(value, "overlap");
    if (on < 0)
        return -1;
    if (r->state == STEP_REDUCING) {
        PyErr_SetString(PyExc_RuntimeError, "Reducer.overlap cannot change during a backward");
        return -1;
    }
    r->overlap = on;
    return 0;
}

static PyObject *reducer_get_static_graph(PyObject *op, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(((ReducerObject *)op)->static_graph);
}

/* DDP._set_static_graph(): torch's older spelling, before the first step. */
static int reducer_set_static_graph(PyObject *op, PyObject *value, void *Py_UNUSED(closure))
{
    ReducerObject *r = (ReducerObject *)op;
    int on = setting_truth(value, "static_graph");
    if (on < 0)
        return -1;
    if (r->steps > 0 || r->state != STEP_IDLE) {
        PyErr_SetString(PyExc_RuntimeError, "static_graph can only be set before the first "
                                            "synced forward and backward");
        return -1;
    }
    if (on && r->device && !r->stage_used_map) {
        PyErr_SetString(PyExc_RuntimeError, "Reducer.static_graph: device buckets need "
                                            "stage_used_map");
        return -1;
    }
    r->static_graph = on;
    if (on)
        r->find_unused = 0;
    return 0;
}

static PyGetSetDef reducer_getset[] = {
    {"static_graph", reducer_get_static_graph, reducer_set_static_graph,
     "See [Note: static graph] in csrc/reducer.c.", NULL},
    {"in_place", reducer_get_in_place, NULL,
     "Whether contiguous gradients are reduced where they are: [Note: gradients in place].",
     NULL},
    {"overlap", reducer_get_overlap, reducer_set_overlap,
     "Launch full buckets during backward (True, the default) or all at its end; see "
     "[Note: overlap] in csrc/reducer.c.", NULL},
    {"observed_order", reducer_get_observed_order, NULL,
     "Parameter indices in the order their gradients became ready in the first synced "
     "backward (unused ones missing), or None before it completed.", NULL},
    {"stats", reducer_get_stats, NULL, "Counters: steps, buckets, launches, wait time.", NULL},
    {"state", reducer_get_state, NULL, "'idle', 'expecting' or 'reducing'.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(reducer_doc,
"Reducer(group, params, names, dtypes, queue_callback, find_unused_parameters,\n"
"        gradient_as_bucket_view, *, current_stream=None, stage_used_map=None,\n"
"        static_graph=False, after_step=None)\n--\n\n"
"DDP's gradient reducer (see dptc/ddp.py).  params: the parameters to reduce,\n"
"deduplicated, all requiring grad; names: their names for errors; dtypes: dptc\n"
"dtype codes; queue_callback: torch.autograd.Variable._execution_engine.queue_callback.\n"
"A device group (device buckets) also takes current_stream, () -> torch.cuda.Stream,\n"
"and with find_unused_parameters or static_graph stage_used_map, (bytes) -> the\n"
"device tensor holding them.  after_step, () -> None, runs at the end of every\n"
"synced backward, after the write-back.  Call set_buckets, then register_hooks.");

static PyType_Slot reducer_slots[] = {
    {Py_tp_new, reducer_new},
    {Py_tp_dealloc, reducer_dealloc},
    {Py_tp_traverse, reducer_traverse},
    {Py_tp_clear, reducer_clear},
    {Py_tp_methods, reducer_methods},
    {Py_tp_getset, reducer_getset},
    {Py_tp_doc, (void *)reducer_doc},
    {0, NULL},
};

static PyType_Spec reducer_spec = {
    .name = "dptc._C.Reducer",
    .basicsize = sizeof(ReducerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = reducer_slots,
};

/* ------------------------------------------------------------------ */
/* Module hooks (called by module.c) */

int dptc_reducer_module_exec(PyObject *module, dptc_module_state *st)
{
    st->hook_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &hook_spec, NULL);
    if (!st->hook_type)
        return -1;
    st->reducer_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &reducer_spec, NULL);
    if (!st->reducer_type)
        return -1;
    if (PyModule_AddType(module, st->hook_type) < 0 ||
        PyModule_AddType(module, st->reducer_type) < 0)
        return -1;
    return 0;
}

int dptc_reducer_traverse(dptc_module_state *st, visitproc visit, void *arg)
{
    Py_VISIT(st->hook_type);
    Py_VISIT(st->reducer_type);
    return 0;
}

void dptc_reducer_clear(dptc_module_state *st)
{
    Py_CLEAR(st->hook_type);
    Py_CLEAR(st->reducer_type);
}
