/* module.c — dptc._C: multi-phase init, module state, the Group and Work
 * types, and the one function that turns a status into an exception. */
#include <limits.h>
#include <sys/mman.h>
#include <unistd.h>

#include "module.h"
#include "nccl.h"
#include "shm.h"

/* ------------------------------------------------------------------ */
/* Module state */

static struct PyModuleDef dptc_module;

dptc_module_state *dptc_state(PyObject *module)
{
    return (dptc_module_state *)PyModule_GetState(module);
}

dptc_module_state *dptc_state_from_type(PyTypeObject *type)
{
    PyObject *module = PyType_GetModuleByDef(type, &dptc_module);
    return module ? dptc_state(module) : NULL;
}

PyObject *dptc_raise(dptc_module_state *st, dptc_status status, const dptc_error *err)
{
    const char *message = err ? err->message : "unknown error";
    PyObject *type;
    switch (status) {
    case DPTC_ERR_INVALID:
        type = PyExc_ValueError;
        break;
    case DPTC_ERR_NOMEM:
        type = PyExc_MemoryError;
        break;
    case DPTC_ERR_TIMEOUT:
        type = st->timeout_error;
        break;
    case DPTC_ERR_PEER_LOST:
    case DPTC_ERR_ABORTED:
        type = st->peer_lost_error;
        break;
    case DPTC_ERR_MISMATCH:
        type = st->mismatch_error;
        break;
    case DPTC_ERR_LIBRARY:
        type = st->cuda_library_error;
        break;
    case DPTC_ERR_PYTHON:
        if (PyErr_Occurred())
            return NULL;
        type = st->dist_error;
        break;
    case DPTC_ERR_INTERRUPTED:
        /* The check (see [Note: interrupts]) left KeyboardInterrupt set. */
        if (PyErr_Occurred())
            return NULL;
        type = PyExc_KeyboardInterrupt;
        break;
    default:
        type = st->dist_error;
        break;
    }
    PyErr_SetString(type, message);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Interrupts and unfinished work */

/* See [Note: interrupts] in dptc.h: runs Python's signal handlers (on the
 * main thread; elsewhere PyErr_CheckSignals does nothing).  A handler that
 * raises leaves its exception set on this thread for the caller to return. */
static int check_signals(void *Py_UNUSED(arg))
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int stop = PyErr_CheckSignals() < 0;
    PyGILState_Release(gil);
    return stop;
}

void dptc_watch_signals(dptc_watch *saved)
{
    dptc_set_interrupt_check(check_signals, NULL, &saved->check, &saved->arg);
}

dptc_status dptc_unwatch_signals(const dptc_watch *saved, dptc_status status, dptc_error *err)
{
    dptc_set_interrupt_check(saved->check, saved->arg, NULL, NULL);
    if (status == DPTC_OK && PyErr_Occurred())
        return dptc_fail(err, DPTC_ERR_INTERRUPTED,
                         "interrupted (KeyboardInterrupt) as the collective completed");
    return status;
}

/* [Note: memory of unfinished work]
 * A wait that gives up aborts the group and then waits a little for its
 * work to stop (dptc_work_wait).  Work inside the transport stops at its
 * next wait, but a cross-node step blocked in gloo returns only when gloo
 * gives up.  Until the work has completed, the tensors it reads and writes
 * must stay: they are leaked (an extra reference nobody drops) rather than
 * released, and the group is unusable anyway. */
void dptc_leak(PyObject *obj) { Py_XINCREF(obj); }

dptc_status dptc_tensor_data(PyObject *tensor, void **out)
{
    *out = NULL;
    if (PyLong_Check(tensor)) {
        PyErr_SetString(PyExc_TypeError, "expected a tensor, got an int: dptc takes tensors, "
                                         "never raw addresses");
        return DPTC_ERR_PYTHON;
    }
    PyObject *ptr = PyObject_CallMethod(tensor, "data_ptr", NULL);
    if (!ptr)
        return DPTC_ERR_PYTHON;
    *out = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    return PyErr_Occurred() ? DPTC_ERR_PYTHON : DPTC_OK;
}

dptc_status dptc_tensor_numel(PyObject *tensor, size_t *out)
{
    PyObject *numel = PyObject_CallMethod(tensor, "numel", NULL);
    if (!numel)
        return DPTC_ERR_PYTHON;
    *out = PyLong_AsSize_t(numel);
    Py_DECREF(numel);
    return PyErr_Occurred() ? DPTC_ERR_PYTHON : DPTC_OK;
}

/* An operand of a collective: None gives NULL.  0, or -1 with an exception. */
static int operand_data(PyObject *tensor, void **out)
{
    *out = NULL;
    return tensor == Py_None || dptc_tensor_data(tensor, out) == DPTC_OK ? 0 : -1;
}

/* ------------------------------------------------------------------ */
/* Group (struct first: Work and SharedBuffer refer to it) */

typedef struct {
    PyObject_HEAD
    dptc_group *group;    /* owned; NULL once closed */
    PyObject *errors;     /* exceptions the cross-node bridge raised (list) */
    int rank, size;
    int shm;              /* the shared-memory transport (else NCCL's) */
    pid_t pid;            /* the process that made it; see [Note: forked children] */
} GroupObject;

/* Raises the exception for a status of group `self`: the bridge's own
 * exception, type and message kept, when the failure came from there.  An
 * interrupt aborts the group first, so the peers raise too (a no-op when
 * the engine did already, for a wait it gave up). */
static PyObject *group_raise(GroupObject *self, dptc_module_state *st, dptc_status status,
                             const dptc_error *err)
{
    if (status == DPTC_ERR_INTERRUPTED && self && self->group)
        dptc_group_abort_released(self->group, "a rank was interrupted (KeyboardInterrupt)");
    if (status == DPTC_ERR_PYTHON && !PyErr_Occurred() && self &&
        PyList_GET_SIZE(self->errors) > 0) {
        PyObject *exc = PyList_GET_ITEM(self->errors, PyList_GET_SIZE(self->errors) - 1);
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        return NULL;
    }
    return dptc_raise(st, status, err);
}

/* ------------------------------------------------------------------ */
/* Work */

typedef struct {
    PyObject_HEAD
    dptc_work *work;      /* owned */
    GroupObject *group;   /* strong */
    PyObject *keepalive;  /* (input, output): the tensors the work reads or writes */
    double timeout_s;
    void *device_stream;  /* NCCL: the CUDA stream it was issued after */
    int op;               /* dptc_op: what result() and the future hold */
    int size;             /* the group's size, for an all-gather's pieces */
    PyObject *future;     /* get_future()'s torch.futures.Future, once asked for */
} WorkObject;

/* [Note: dropped device work]
 * A NCCL collective's Work may be dropped while the device still runs it
 * (a blocking collective, or fully_shard's gathers, drop theirs as soon as
 * the current stream waits on them).  Its tensors must outlive the device
 * work, but waiting for it would block the host.  So the work and its
 * tensors go to the module's retired list, and each later NCCL submission
 * releases those the progress thread has since seen complete.  At module
 * teardown the rest are waited for. */
struct dptc_retired {
    dptc_work *work;
    PyObject *keepalive;
};

/* Releases the retired works that have completed.  GIL held. */
static void retired_prune(dptc_module_state *st)
{
    size_t kept = 0;
    for (size_t i = 0; i < st->nretired; i++) {
        struct dptc_retired *r = &st->retired[i];
        if (dptc_work_is_completed(r->work)) {
            dptc_work_release(r->work);
            Py_XDECREF(r->keepalive);
        } else {
            st->retired[kept++] = *r;
        }
    }
    st->nretired = kept;
}

/* Takes over w and keepalive (see [Note: dropped device work]); 0, or -1
 * when there is no memory for them (nothing taken).  GIL held. */
static int retired_add(dptc_module_state *st, dptc_work *w, PyObject *keepalive)
{
    retired_prune(st);
    if (st->nretired == st->retired_capacity) {
        size_t capacity = st->retired_capacity ? 2 * st->retired_capacity : 64;
        struct dptc_retired *grown = PyMem_Realloc(st->retired, capacity * sizeof *grown);
        if (!grown)
            return -1;
        st->retired = grown;
        st->retired_capacity = capacity;
    }
    st->retired[st->nretired++] = (struct dptc_retired){w, keepalive};
    return 0;
}

/* Waits for every retired work (each within its group's deadlines) and
 * releases them: module teardown. */
static void retired_clear(dptc_module_state *st)
{
    for (size_t i = 0; i < st->nretired; i++) {
        struct dptc_retired *r = &st->retired[i];
        Py_BEGIN_ALLOW_THREADS
        dptc_work_wait(r->work, 600.0, NULL);
        Py_END_ALLOW_THREADS
        if (!dptc_work_is_completed(r->work))
            dptc_leak(r->keepalive);
        dptc_work_release(r->work);
        Py_XDECREF(r->keepalive);
    }
    PyMem_Free(st->retired);
    st->retired = NULL;
    st->nretired = st->retired_capacity = 0;
}

/* Creates a Work around w (steals the reference to w) keeping `keepalive`
 * alive until the work has completed.  Returns a new reference. */
static PyObject *work_new(dptc_module_state *st, GroupObject *group, dptc_work *w,
                          PyObject *keepalive, double timeout_s, dptc_op op)
{
    WorkObject *self = PyObject_GC_New(WorkObject, st->work_type);
    if (!self) {
        /* The work is queued: it must not outlive its buffers unobserved. */
        Py_BEGIN_ALLOW_THREADS
        dptc_work_wait(w, timeout_s, NULL);
        Py_END_ALLOW_THREADS
        if (!dptc_work_is_completed(w))
            dptc_leak(keepalive);
        dptc_work_release(w);
        return NULL;
    }
    self->work = w;
    self->group = (GroupObject *)Py_NewRef((PyObject *)group);
    self->keepalive = Py_XNewRef(keepalive);
    self->timeout_s = timeout_s;
    self->device_stream = NULL;
    self->op = (int)op;
    self->size = group->size;
    self->future = NULL;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* The seconds a wait(timeout=...) may take: None or 0 (torch's default
 * timedelta(0), its "no timeout given") mean the work's own (twice the
 * group's timeout and a second); else a number of seconds or a
 * datetime.timedelta, as torch's Work.wait takes.  A wait that
 * gives up aborts the group (see [Note: memory of unfinished work]), so a
 * negative, NaN or non-numeric timeout is refused here, before any wait.
 * Returns 0, or -1 with an exception set. */
static int work_timeout_seconds(PyObject *timeout, double group_timeout, double *out)
{
    *out = group_timeout;
    if (timeout == Py_None)
        return 0;
    PyObject *value;
    if (PyObject_HasAttrString(timeout, "total_seconds"))
        value = PyObject_CallMethod(timeout, "total_seconds", NULL);
    else if (PyLong_Check(timeout) && !PyBool_Check(timeout))
        value = PyNumber_Float(timeout);
    else if (PyFloat_Check(timeout))
        value = Py_NewRef(timeout);
    else {
        PyErr_Format(PyExc_TypeError, "timeout must be None, a number of seconds or a "
                     "datetime.timedelta, got %.100R", timeout);
        return -1;
    }
    if (!value)
        return -1;
    double seconds = PyFloat_AsDouble(value);
    Py_DECREF(value);
    if (seconds == -1.0 && PyErr_Occurred())
        return -1;
    if (!(seconds >= 0.0 && seconds <= 1e9)) {
        char group_text[32];   /* PyErr_Format has no %g */
        snprintf(group_text, sizeof group_text, "%g", group_timeout);
        PyErr_Format(PyExc_ValueError, "timeout must be between 0 and 1e9 seconds (None or 0: "
                     "the default, %s s), got %.100R", group_text, timeout);
        return -1;
    }
    if (seconds > 0.0)
        *out = seconds;
    return 0;
}

/* synchronize(timeout=None): blocks the host until the collective has
 * completed (the only wait of a shared-memory collective). */
static PyObject *work_synchronize(WorkObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:synchronize", keywords, &timeout))
        return NULL;
    double seconds;
    if (work_timeout_seconds(timeout, self->timeout_s, &seconds) < 0)
        return NULL;
    dptc_error err;
    dptc_status status;
    dptc_watch watch;
    dptc_watch_signals(&watch);
    Py_BEGIN_ALLOW_THREADS
    status = dptc_work_wait(self->work, seconds, &err);
    Py_END_ALLOW_THREADS
    status = dptc_unwatch_signals(&watch, status, &err);
    if (!dptc_work_is_completed(self->work))
        dptc_leak(self->keepalive);
    if (status != DPTC_OK)
        return group_raise(self->group, dptc_state_from_type(Py_TYPE(self)), status, &err);
    Py_RETURN_TRUE;
}

int dptc_cuda_stream_handle(PyObject *stream, void **out)
{
    *out = NULL;
    if (stream == Py_None)
        return 0;
    PyObject *value = PyObject_GetAttrString(stream, "cuda_stream");
    if (!value) {
        PyErr_Format(PyExc_TypeError, "stream must be a torch.cuda.Stream or None, got %.100s",
                     Py_TYPE(stream)->tp_name);
        return -1;
    }
    *out = PyLong_AsVoidPtr(value);
    Py_DECREF(value);
    return *out == NULL && PyErr_Occurred() ? -1 : 0;
}

/* Makes the CUDA stream `stream` wait for this NCCL collective without
 * blocking the host, or raises its failure when it has already failed.  See
 * [Note: the NCCL transport] in nccl.h. */
static PyObject *work_stream_wait(WorkObject *self, void *stream)
{
    dptc_error err;
    dptc_status status = DPTC_OK;
    void *completion = dptc_work_device_completion(self->work);
    if (completion)
        status = dptc_nccl_stream_wait(completion, stream, &err);
    else if (dptc_work_is_completed(self->work))
        status = dptc_work_wait(self->work, 0, &err);
    if (status != DPTC_OK)
        return group_raise(self->group, dptc_state_from_type(Py_TYPE(self)), status, &err);
    Py_RETURN_TRUE;
}

/* wait_stream(stream): the given stream waits (torch's Work.wait() makes the
 * current stream wait). */
static PyObject *work_wait_stream(WorkObject *self, PyObject *stream)
{
    if (self->group->shm) {
        PyErr_SetString(PyExc_TypeError, "wait_stream is for collectives on CUDA tensors "
                                         "(NCCL); use wait()");
        return NULL;
    }
    void *handle;
    if (dptc_cuda_stream_handle(stream, &handle) < 0)
        return NULL;
    return work_stream_wait(self, handle);
}

/* wait(timeout=None): a shared-memory collective's synchronize; a NCCL
 * collective's makes the stream it was issued after wait for it, without
 * blocking the host, as torch's NCCL Work.wait() does. */
static PyObject *work_wait(WorkObject *self, PyObject *args, PyObject *kwargs)
{
    if (self->group->shm)
        return work_synchronize(self, args, kwargs);
    static char *keywords[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:wait", keywords, &timeout))
        return NULL;
    double unused;
    if (work_timeout_seconds(timeout, self->timeout_s, &unused) < 0)
        return NULL;
    return work_stream_wait(self, self->device_stream);
}

static PyObject *work_is_completed(WorkObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(dptc_work_is_completed(self->work));
}

/* Calls dptc._futures.<name>(self): the Python half of result() and
 * get_future() (see [Note: futures of works] there).  Returns a new
 * reference. */
static PyObject *work_call_futures(WorkObject *self, const char *name)
{
    PyObject *module = PyImport_ImportModule("dptc._futures");
    if (!module)
        return NULL;
    PyObject *out = PyObject_CallMethod(module, name, "O", (PyObject *)self);
    Py_DECREF(module);
    return out;
}

/* result(): the work's output tensors, as torch's gloo Work.result() gives
 * them (see dptc/_futures.py); RuntimeError before completion, as torch's,
 * and the collective's own exception when it failed. */
static PyObject *work_result(WorkObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!dptc_work_is_completed(self->work)) {
        PyErr_SetString(PyExc_RuntimeError, "Work needs to be completed before calling "
                        "result(). Should call wait() before result().");
        return NULL;
    }
    dptc_error err;
    dptc_status status = dptc_work_wait(self->work, 0, &err);  /* completed: no wait */
    if (status != DPTC_OK)
        return group_raise(self->group, dptc_state_from_type(Py_TYPE(self)), status, &err);
    return work_call_futures(self, "result");
}

/* get_future(): a torch.futures.Future completed with result()'s list, or
 * with the collective's exception, when the work completes, whoever waits
 * (see [Note: futures of works] in dptc/_futures.py).  The same future on
 * every call. */
static PyObject *work_get_future(WorkObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->group && self->group->pid != getpid()) {
        /* See [Note: forked children]: nothing completes it here. */
        PyErr_SetString(PyExc_RuntimeError, "get_future() on a work of the process this one "
                                            "was forked from: only that process can complete "
                                            "it; ask for the future there");
        return NULL;
    }
    if (self->future)
        return Py_NewRef(self->future);
    if (!self->group || !self->group->shm) {
        PyErr_SetString(PyExc_TypeError, "this is the engine's handle of a collective on CUDA "
                                         "tensors; call get_future() on the CudaWork dptc's "
                                         "collective returned");
        return NULL;
    }
    PyObject *future = work_call_futures(self, "watch");
    if (!future)
        return NULL;
    Py_XSETREF(self->future, Py_NewRef(future));
    return future;
}

/* _watch(): marks the work watched (see [Note: watched works] in engine.h). */
static PyObject *work_watch(WorkObject *self, PyObject *Py_UNUSED(ignored))
{
    dptc_work_watch(self->work);
    Py_RETURN_NONE;
}

/* _parts() -> (op, input, output, group size): what dptc/_futures.py builds
 * result()'s list from; output is a tuple for the several-output forms. */
static PyObject *work_parts(WorkObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *input = Py_None, *output = Py_None;
    if (self->keepalive && PyTuple_Check(self->keepalive) &&
        PyTuple_GET_SIZE(self->keepalive) == 2) {
        input = PyTuple_GET_ITEM(self->keepalive, 0);
        output = PyTuple_GET_ITEM(self->keepalive, 1);
    }
    return Py_BuildValue("(iOOi)", self->op, input, output, self->size);
}

/* _release_tensors(): drops the tensors the work keeps alive, once a caller
 * has made the stream they were allocated on wait for it (fully_shard's
 * buffers): torch's caching allocator hands their blocks out again only to
 * work on that stream, which now runs after the collective, as torch's NCCL
 * Work unstashes its tensors after its stream wait.  Otherwise they would
 * stay allocated until the host saw the collective complete (see [Note:
 * dropped device work]), while the host runs ahead of the device. */
static PyObject *work_release_tensors(WorkObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->group || self->group->shm) {
        PyErr_SetString(PyExc_TypeError, "_release_tensors is for collectives on CUDA tensors "
                                         "(NCCL), after a stream wait");
        return NULL;
    }
    Py_CLEAR(self->keepalive);
    Py_RETURN_NONE;
}

static PyObject *work_get_timeout(WorkObject *self, void *Py_UNUSED(closure))
{
    return PyFloat_FromDouble(self->timeout_s);
}

static int work_traverse(WorkObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->group);
    Py_VISIT(self->keepalive);
    Py_VISIT(self->future);
    return 0;
}

static int work_clear(WorkObject *self)
{
    /* Only completed work lets go of its tensors (see [Note: memory of
     * unfinished work]). */
    if (self->work && !dptc_work_is_completed(self->work))
        return 0;
    Py_CLEAR(self->future);
    Py_CLEAR(self->keepalive);
    Py_CLEAR(self->group);
    return 0;
}

static void work_dealloc(WorkObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->work && self->group && !self->group->shm && !dptc_work_is_completed(self->work) &&
        retired_add(dptc_state_from_type(type), self->work, self->keepalive) == 0) {
        self->work = NULL;        /* see [Note: dropped device work] */
        self->keepalive = NULL;
    }
    /* A forked child's copy of a rank's work: nothing completes it there, and
     * giving up would abort the rank's group ([Note: forked children]). */
    if (self->work && self->group && self->group->pid != getpid()) {
        dptc_leak(self->keepalive);
        self->work = NULL;
    }
    /* The engine may still write into the tensors we keep alive: wait;
     * dptc_work_wait aborts the group if it has to give up. */
    if (self->work && !dptc_work_is_completed(self->work)) {
        Py_BEGIN_ALLOW_THREADS
        dptc_work_wait(self->work, self->timeout_s, NULL);
        Py_END_ALLOW_THREADS
        if (!dptc_work_is_completed(self->work))
            dptc_leak(self->keepalive);
    }
    dptc_work_release(self->work);
    self->work = NULL;
    work_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> True\n\nBlocks until the collective completes; raises its error.  "
     "On CUDA tensors (NCCL): makes the stream it was issued after wait, not the host."},
    {"synchronize", (PyCFunction)(void (*)(void))work_synchronize, METH_VARARGS | METH_KEYWORDS,
     "synchronize(timeout=None) -> True\n\nBlocks the host until the collective completes; "
     "raises its error."},
    {"is_completed", (PyCFunction)work_is_completed, METH_NOARGS,
     "is_completed() -> bool"},
    {"wait_stream", (PyCFunction)work_wait_stream, METH_O,
     "wait_stream(stream) -> True\n\nMakes the CUDA stream wait for this collective (NCCL)."},
    {"result", (PyCFunction)work_result, METH_NOARGS,
     "result() -> list of tensors\n\nThe collective's output tensors, as torch's gloo Work "
     "gives them; RuntimeError before it completed, its error if it failed."},
    {"get_future", (PyCFunction)work_get_future, METH_NOARGS,
     "get_future() -> torch.futures.Future\n\nCompleted with result()'s list when the "
     "collective completes (no wait needed), or with its exception."},
    {"_watch", (PyCFunction)work_watch, METH_NOARGS, NULL},
    {"_parts", (PyCFunction)work_parts, METH_NOARGS, NULL},
    {"_release_tensors", (PyCFunction)work_release_tensors, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef work_getset[] = {
    {"_timeout", (getter)work_get_timeout, NULL,
     "seconds a wait() without a timeout waits (twice the group's timeout and a second)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot work_slots[] = {
    {Py_tp_doc, "Handle of an asynchronous dptc collective."},
    {Py_tp_methods, work_methods},
    {Py_tp_getset, work_getset},
    {Py_tp_traverse, work_traverse},
    {Py_tp_clear, work_clear},
    {Py_tp_dealloc, work_dealloc},
    {0, NULL},
};

static PyType_Spec work_spec = {
    .name = "dptc._C.Work",
    .basicsize = sizeof(WorkObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = work_slots,
};

/* ------------------------------------------------------------------ */
/* SharedBuffer: memory every local rank maps (see [Note: shared buffers]
 * in shm.h), exported through the buffer protocol so that
 * torch.frombuffer can put a tensor on it; the tensor's storage keeps the
 * SharedBuffer alive. */

typedef struct {
    PyObject_HEAD
    PyObject *group;      /* the GroupObject that made it (strong) */
    dptc_shared shared;   /* mappings, owned */
    dptc_shm_share_request request;  /* read by the share work */
} SharedObject;

static int shared_getbuffer(PyObject *op, Py_buffer *view, int flags)
{
    SharedObject *self = (SharedObject *)op;
    return PyBuffer_FillInfo(view, op, self->shared.base[self->shared.local_rank],
                             (Py_ssize_t)self->shared.bytes, 0, flags);
}

static int shared_traverse(SharedObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->group);
    return 0;
}

static void shared_dealloc(SharedObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    GroupObject *group = (GroupObject *)self->group;
    if (group && group->group)
        dptc_shm_unshare(dptc_group_transport(group->group), &self->shared);
    dptc_shm_shared_free(&self->shared);
    Py_CLEAR(self->group);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyObject *shared_get_nbytes(SharedObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->shared.bytes);
}

/* discard(): gives this rank's pages back to the system; the mapping stays,
 * and reads as zeros until written again.  For buffers used only during part
 * of a step (FSDP's reduce inputs), so they hold no memory in between. */
static PyObject *shared_discard(SharedObject *self, PyObject *Py_UNUSED(ignored))
{
    void *base = self->shared.base[self->shared.local_rank];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = base && self->shared.bytes ? madvise(base, self->shared.bytes, MADV_REMOVE) : 0;
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef shared_methods[] = {
    {"discard", (PyCFunction)shared_discard, METH_NOARGS,
     "discard()\n\nReturns this rank's pages to the system; the memory reads as zeros until "
     "written again."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef shared_getset[] = {
    {"nbytes", (getter)shared_get_nbytes, NULL, "bytes mapped (a multiple of the page size)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot shared_slots[] = {
    {Py_tp_doc, "Memory every local rank of a group maps; see Group.share."},
    {Py_bf_getbuffer, shared_getbuffer},
    {Py_tp_getset, shared_getset},
    {Py_tp_methods, shared_methods},
    {Py_tp_traverse, shared_traverse},
    {Py_tp_dealloc, shared_dealloc},
    {0, NULL},
};

static PyType_Spec shared_spec = {
    .name = "dptc._C.SharedBuffer",
    .basicsize = sizeof(SharedObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = shared_slots,
};

/* ------------------------------------------------------------------ */
/* Group methods */

int dptc_group_object_is_device(PyObject *obj)
{
    return !((GroupObject *)obj)->shm;
}

dptc_group *dptc_group_from_object(dptc_module_state *st, PyObject *obj, const char *argname)
{
    if (!PyObject_TypeCheck(obj, st->group_type)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dptc._C.Group, got %.100s", argname,
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    GroupObject *g = (GroupObject *)obj;
    if (!g->group) {
        PyErr_Format(PyExc_ValueError, "%s is a destroyed process group; create a new one with "
                                       "dptc.init_process_group()", argname);
        return NULL;
    }
    return g->group;
}

static PyObject *group_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"rank", "size", "local_rank", "local_size", "node", "nnodes",
                               "name", "create", "slot_bytes", "timeout", "streams", "ranks",
                               "nccl_id", "device", "staging", NULL};
    dptc_group_config cfg = {.nstreams = 1};
    dptc_shm_config shm = {.staging = DPTC_SHM_STAGING_AUTO};
    Py_ssize_t slot_bytes;
    PyObject *ranks = Py_None;
    Py_buffer nccl_id = {0};
    int device = -1;
    int staging = DPTC_SHM_STAGING_AUTO;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiiiiispnd|iO$y*ii:Group", keywords,
                                     &cfg.rank, &cfg.size, &cfg.local_rank, &cfg.local_size,
                                     &cfg.node, &cfg.nnodes, &cfg.shm_name, &cfg.create,
                                     &slot_bytes, &cfg.timeout_s, &cfg.nstreams, &ranks,
                                     &nccl_id, &device, &staging))
        return NULL;
    /* See [Note: staging] in shm.c. */
    shm.staging = (dptc_shm_staging)staging;
    cfg.transport_arg = &shm;
    /* With nccl_id, the group moves CUDA tensors of `device` through NCCL
     * (see [Note: the NCCL transport] in nccl.h); else shared memory. */
    const dptc_transport_ops *transport = &dptc_shm_transport;
    dptc_nccl_config nccl = {0};
    if (nccl_id.buf) {
        size_t id_bytes = (size_t)nccl_id.len;
        if (id_bytes == sizeof nccl.id.internal)
            memcpy(nccl.id.internal, nccl_id.buf, id_bytes);
        PyBuffer_Release(&nccl_id);
        if (id_bytes != sizeof nccl.id.internal || device < 0) {
            PyErr_Format(PyExc_ValueError, "nccl_id must be %zu bytes (nccl_unique_id()) and "
                         "device a CUDA device index, got %zu bytes and device %d",
                         sizeof nccl.id.internal, id_bytes, device);
            return NULL;
        }
        nccl.api = dptc_loaded_cuda(dptc_state_from_type(type));
        if (!nccl.api)
            return NULL;
        nccl.device = device;
        cfg.transport_arg = &nccl;
        transport = &dptc_nccl_transport;
    }
    int *global_ranks = NULL;
    if (ranks != Py_None) {
        /* The members' global ranks, for messages. */
        if (!PyList_Check(ranks) || PyList_GET_SIZE(ranks) != cfg.size || cfg.size < 1) {
            PyErr_Format(PyExc_ValueError, "ranks must be a list of %d global ranks", cfg.size);
            return NULL;
        }
        global_ranks = PyMem_Malloc((size_t)cfg.size * sizeof *global_ranks);
        if (!global_ranks)
            return PyErr_NoMemory();
        for (int r = 0; r < cfg.size; r++) {
            global_ranks[r] = (int)PyLong_AsLong(PyList_GET_ITEM(ranks, r));
            if (global_ranks[r] == -1 && PyErr_Occurred()) {
                PyMem_Free(global_ranks);
                return NULL;
            }
        }
        cfg.global_ranks = global_ranks;
    }
    GroupObject *self = NULL;
    if (slot_bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "slot_bytes must be > 0, got %zd", slot_bytes);
        goto fail;
    }
    cfg.slot_bytes = (size_t)slot_bytes;
    self = (GroupObject *)type->tp_alloc(type, 0);
    if (!self)
        goto fail;
    self->errors = PyList_New(0);
    if (!self->errors)
        goto fail;
    dptc_error err;
    dptc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dptc_group_create(transport, &cfg, &self->group, &err);
    Py_END_ALLOW_THREADS
    PyMem_Free(global_ranks);
    if (status != DPTC_OK) {
        self->group = NULL;
        Py_DECREF(self);
        return dptc_raise(dptc_state_from_type(type), status, &err);
    }
    self->rank = cfg.rank;
    self->size = cfg.size;
    self->shm = transport == &dptc_shm_transport;
    self->pid = getpid();
    return (PyObject *)self;
fail:
    PyMem_Free(global_ranks);
    Py_XDECREF(self);
    return NULL;
}

/* [Note: forked children]
 * A process forked from a rank (a DataLoader worker, a script's os.fork())
 * holds a copy of the rank's groups, but is no member: the engine's threads
 * were not copied, the segment's records and the communicator are the
 * rank's.  Closing the copy there (its interpreter's exit, atexit's
 * destroy_process_group) must leave the group alone: destroying it would mark
 * the rank's records left ([Note: a rank that leaves] in shm.c), so the
 * rank's node peers would fail while it still trains, and would join threads
 * the child does not have.  The child only forgets its copy (its memory goes
 * with the child), and so does a Work of the rank's that the child drops
 * (work_dealloc): waiting there for a completion nobody posts would end in an
 * abort of the rank's group at the deadline. */
static void group_close_now(GroupObject *self)
{
    dptc_group *g = self->group;
    self->group = NULL;
    if (!g || self->pid != getpid())
        return;
    Py_BEGIN_ALLOW_THREADS
    dptc_group_destroy(g);
    Py_END_ALLOW_THREADS
}

static int group_traverse(GroupObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->errors);
    return 0;
}

static int group_clear(GroupObject *self)
{
    Py_CLEAR(self->errors);
    return 0;
}

static void group_dealloc(GroupObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    group_close_now(self);
    group_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

/* The engine group of self and the module state, or NULL with an exception
 * when the group was closed. */
static dptc_group *open_group(GroupObject *self, dptc_module_state **st)
{
    *st = dptc_state_from_type(Py_TYPE(self));
    return dptc_group_from_object(*st, (PyObject *)self, "group");
}

/* open_group for what only the shared-memory transport has (its segment,
 * shared buffers, bridges, slots): TypeError on a NCCL group. */
static dptc_group *open_shm_group(GroupObject *self, dptc_module_state **st, const char *what)
{
    dptc_group *g = open_group(self, st);
    if (g && !self->shm) {
        PyErr_Format(PyExc_TypeError, "%s is for groups on the shared-memory transport; this "
                     "group moves CUDA tensors through NCCL", what);
        return NULL;
    }
    return g;
}

/* A collective being issued: the dptc_coll, the stream, and the arrays of
 * the several-output all-gather (freed by coll_done). */
typedef struct {
    dptc_coll coll;
    int stream;
    void *pieces;
} issued;

static void coll_done(issued *is) { PyMem_Free(is->pieces); }

/* Fills the several-output form from a sequence of output tensors (see
 * [Note: several pieces] in shm.c): for an all-gather, output j gets
 * `blocks` (the group size) times piece j's elements; for an all-reduce in
 * place (blocks 1), output j is piece j. */
static int parse_outputs(PyObject *outputs, int blocks, issued *is)
{
    PyObject *seq = PySequence_Fast(outputs, "output must be a tensor or a list of tensors");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int rc = -1;
    if (n < 1 || n > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "outputs must hold 1 or more tensors, got %zd", n);
        goto exit;
    }
    is->pieces = PyMem_Malloc((size_t)n * (sizeof(void *) + sizeof(size_t)));
    if (!is->pieces) {
        PyErr_NoMemory();
        goto exit;
    }
    void **ptrs = is->pieces;
    size_t *counts = (size_t *)(ptrs + n), total = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        size_t numel;
        PyObject *t = PySequence_Fast_GET_ITEM(seq, j);
        if (dptc_tensor_data(t, &ptrs[j]) != DPTC_OK || dptc_tensor_numel(t, &numel) != DPTC_OK)
            goto exit;
        if (numel % (size_t)blocks != 0) {
            PyErr_Format(PyExc_ValueError, "outputs[%zd] has %zu elements, not a multiple of "
                         "the group size %d", j, numel, blocks);
            goto exit;
        }
        counts[j] = numel / (size_t)blocks;
        total += counts[j];
    }
    if (total != is->coll.count) {
        PyErr_Format(PyExc_ValueError, "the input has %zu elements but the outputs' pieces add "
                     "up to %zu", is->coll.count, total);
        goto exit;
    }
    is->coll.noutputs = (int)n;
    is->coll.outputs = ptrs;
    is->coll.output_counts = counts;
    rc = 0;
exit:
    Py_DECREF(seq);
    return rc;
}

/* Parses (op, dtype, redop, input, output, count, root, stream[,
 * cuda_stream]) into is; input and output are tensors or None (an
 * all-gather's output may be a list of tensors, its several-output form);
 * cuda_stream, for a NCCL group, is the issuer's torch.cuda.Stream. */
static int parse_coll(GroupObject *self, PyObject *const *args, Py_ssize_t nargs, issued *is)
{
    memset(is, 0, sizeof *is);
    if (nargs != 8 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "expected (op, dtype, redop, input, output, count, "
                                         "root, stream[, cuda_stream])");
        return -1;
    }
    if (nargs == 9) {
        if (self->shm && args[8] != Py_None) {
            PyErr_SetString(PyExc_TypeError, "cuda_stream is for groups that move CUDA tensors "
                                             "(NCCL)");
            return -1;
        }
        if (dptc_cuda_stream_handle(args[8], &is->coll.device_stream) < 0)
            return -1;
    }
    long values[3];
    for (int i = 0; i < 3; i++) {
        values[i] = PyLong_AsLong(args[i]);
        if (values[i] == -1 && PyErr_Occurred())
            return -1;
    }
    if (values[0] < 0 || values[0] > DPTC_OP_BARRIER || values[1] < 0 ||
        values[1] >= DPTC_DTYPE_COUNT || values[2] < 0 || values[2] >= DPTC_REDOP_COUNT) {
        PyErr_Format(PyExc_ValueError, "invalid collective codes op=%ld dtype=%ld redop=%ld",
                     values[0], values[1], values[2]);
        return -1;
    }
    dptc_coll *c = &is->coll;
    c->op = (dptc_op)values[0];
    c->dtype = (dptc_dtype)values[1];
    c->redop = (dptc_redop)values[2];
    c->count = PyLong_AsSize_t(args[5]);
    if (c->count == (size_t)-1 && PyErr_Occurred())
        return -1;
    c->root = (int)PyLong_AsLong(args[6]);
    if (c->root == -1 && PyErr_Occurred())
        return -1;
    is->stream = (int)PyLong_AsLong(args[7]);
    if (is->stream == -1 && PyErr_Occurred())
        return -1;
    if (operand_data(args[3], &c->input) < 0)
        return -1;
    if (c->op == DPTC_OP_ALL_GATHER && (PyList_Check(args[4]) || PyTuple_Check(args[4])))
        return parse_outputs(args[4], self->size, is);
    if (c->op == DPTC_OP_ALL_REDUCE && PyList_Check(args[4])) {
        if (args[3] != Py_None) {
            PyErr_SetString(PyExc_ValueError, "an all-reduce of a list of tensors is in place: "
                                              "pass input=None");
            return -1;
        }
        if (!self->shm) {
            PyErr_SetString(PyExc_TypeError, "an all-reduce of a list of tensors runs on the "
                                             "shared-memory transport only; this group moves "
                                             "CUDA tensors through NCCL");
            return -1;
        }
        return parse_outputs(args[4], 1, is);
    }
    if (args[4] == args[3]) {  /* in place: one question to the tensor is enough */
        c->output = c->input;
        return 0;
    }
    return operand_data(args[4], &c->output);
}

/* Leaks an unfinished collective's tensors: the input, and the output or
 * each tensor of a list of outputs (the caller may empty the list). */
static void leak_operands(PyObject *input, PyObject *output)
{
    dptc_leak(input);
    if (!PyList_Check(output)) {
        dptc_leak(output);
        return;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(output); j++)
        dptc_leak(PyList_GET_ITEM(output, j));
}

static PyObject *group_submit(GroupObject *self, PyObject *const *args, Py_ssize_t nargs);

/* run(op, dtype, redop, input, output, count, root, stream): one collective
 * to completion, GIL released.  On a NCCL group, to the point where the
 * stream it follows waits for it (the host does not). */
static PyObject *group_run(GroupObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!self->shm) {
        PyObject *work = group_submit(self, args, nargs);
        PyObject *done = work ? PyObject_CallMethod(work, "wait", NULL) : NULL;
        Py_XDECREF(work);          /* see [Note: dropped device work] */
        if (!done)
            return NULL;
        Py_DECREF(done);
        Py_RETURN_NONE;
    }
    dptc_module_state *st;
    dptc_group *g = open_group(self, &st);
    issued is;
    if (!g || parse_coll(self, args, nargs, &is) < 0) {
        if (g)
            coll_done(&is);
        return NULL;
    }
    dptc_error err;
    dptc_status status;
    dptc_work *unfinished;
    dptc_watch watch;
    dptc_watch_signals(&watch);
    Py_BEGIN_ALLOW_THREADS
    status = dptc_group_run(g, is.stream, &is.coll, &unfinished, &err);
    Py_END_ALLOW_THREADS
    status = dptc_unwatch_signals(&watch, status, &err);
    if (unfinished) {
        leak_operands(args[3], args[4]);
        dptc_work_release(unfinished);
    }
    coll_done(&is);
    if (status != DPTC_OK)
        return group_raise(self, st, status, &err);
    Py_RETURN_NONE;
}

/* submit(op, dtype, redop, input, output, count, root, stream) -> Work; the
 * Work keeps input and output alive until the collective completes. */
static PyObject *group_submit(GroupObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    dptc_module_state *st;
    dptc_group *g = open_group(self, &st);
    issued is;
    if (!g || parse_coll(self, args, nargs, &is) < 0) {
        if (g)
            coll_done(&is);
        return NULL;
    }
    dptc_error err;
    dptc_work *w;
    dptc_status status;
    if (self->shm) {
        status = dptc_group_submit(g, is.stream, &is.coll, &w, &err);
    } else {
        /* NCCL issues here (see [Note: device transports] in transport.h). */
        Py_BEGIN_ALLOW_THREADS
        status = dptc_group_submit(g, is.stream, &is.coll, &w, &err);
        Py_END_ALLOW_THREADS
    }
    coll_done(&is);
    if (status != DPTC_OK)
        return group_raise(self, st, status, &err);
    /* A list of outputs is copied: the caller may empty it while the work runs. */
    PyObject *outputs = PyList_Check(args[4]) ? PyList_AsTuple(args[4]) : Py_NewRef(args[4]);
    PyObject *keep = outputs ? PyTuple_Pack(2, args[3], outputs) : NULL;
    Py_XDECREF(outputs);
    double timeout = dptc_group_wait_deadline(g);
    if (!keep) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        Py_BEGIN_ALLOW_THREADS
        dptc_work_wait(w, timeout, NULL);
        Py_END_ALLOW_THREADS
        if (!dptc_work_is_completed(w))
            leak_operands(args[3], args[4]);
        dptc_work_release(w);
        PyErr_Restore(type, value, traceback);
        return NULL;
    }
    PyObject *work = work_new(st, self, w, keep, timeout, is.coll.op);
    Py_DECREF(keep);
    if (work && !self->shm) {
        ((WorkObject *)work)->device_stream = is.coll.device_stream;
        retired_prune(st);
    }
    return work;
}

void dptc_group_abort_released(dptc_group *g, const char *reason)
{
    dptc_group_retain(g);  /* a close on another thread meanwhile leaves g to us */
    Py_BEGIN_ALLOW_THREADS
    dptc_group_abort(g, reason);
    Py_END_ALLOW_THREADS
    dptc_group_release(g);
}

static PyObject *group_abort(GroupObject *self, PyObject *reason)
{
    dptc_module_state *st;
    dptc_group *g = open_group(self, &st);
    if (!g)
        return NULL;
    const char *text = PyUnicode_AsUTF8(reason);
    if (!text)
        return NULL;
    dptc_group_abort_released(g, text);
    Py_RETURN_NONE;
}

/* share(nbytes) -> SharedBuffer.  Collective over the group, on stream 0:
 * every rank calls it in the same order with the same size. */
static PyObject *group_share(GroupObject *self, PyObject *arg)
{
    dptc_module_state *st;
    dptc_group *g = open_shm_group(self, &st, "share");
    if (!g)
        return NULL;
    Py_ssize_t nbytes = PyLong_AsSsize_t(arg);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %zd", nbytes);
        return NULL;
    }
    SharedObject *shared = PyObject_GC_New(SharedObject, st->shared_type);
    if (!shared)
        return NULL;
    shared->group = NULL;
    memset(&shared->shared, 0, sizeof shared->shared);
    shared->request.nbytes = (size_t)nbytes;
    shared->request.out = &shared->shared;
    dptc_coll c = {.op = DPTC_OP_CALL, .dtype = DPTC_UINT8, .count = (size_t)nbytes,
                   .call = dptc_shm_share, .call_arg = &shared->request};
    dptc_error err;
    dptc_status status;
    dptc_work *unfinished;
    dptc_watch watch;
    dptc_watch_signals(&watch);
    Py_BEGIN_ALLOW_THREADS
    status = dptc_group_run(g, 0, &c, &unfinished, &err);
    Py_END_ALLOW_THREADS
    status = dptc_unwatch_signals(&watch, status, &err);
    if (unfinished) {
        /* It may still use `shared`: leak it. */
        dptc_work_release(unfinished);
        return group_raise(self, st, status == DPTC_OK ? DPTC_ERR_TIMEOUT : status, &err);
    }
    if (status != DPTC_OK) {
        Py_DECREF(shared);
        return group_raise(self, st, status, &err);
    }
    shared->group = Py_NewRef((PyObject *)self);
    PyObject_GC_Track(shared);
    return (PyObject *)shared;
}

/* set_bridge(stream, callable): the cross-node step of a stream, see bridge.c. */
static PyObject *group_set_bridge(GroupObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    dptc_module_state *st;
    dptc_group *g = open_shm_group(self, &st, "set_bridge");
    if (!g)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_bridge(stream, callable)");
        return NULL;
    }
    long stream = PyLong_AsLong(args[0]);
    if (stream == -1 && PyErr_Occurred())
        return NULL;
    if (stream < 0 || stream >= dptc_group_streams(g)) {
        PyErr_Format(PyExc_ValueError, "stream must be in [0, %d), got %ld",
                     dptc_group_streams(g), stream);
        return NULL;
    }
    if (!PyCallable_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "bridge must be callable, got %.100s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    struct dptc_bridge *bridge = dptc_bridge_new(
        args[1], self->errors, dptc_state_from_type(Py_TYPE(self))->peer_lost_error);
    if (!bridge)
        return NULL;
    dptc_shm_set_bridge(dptc_group_transport(g), (int)stream, bridge);
    Py_RETURN_NONE;
}

static PyObject *group_unlink(GroupObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->group && self->shm)
        dptc_shm_unlink(dptc_group_transport(self->group));
    Py_RETURN_NONE;
}

static PyObject *group_close(GroupObject *self, PyObject *Py_UNUSED(ignored))
{
    group_close_now(self);
    Py_RETURN_NONE;
}

/* slot(stream, local_rank) -> writable memoryview over that rank's staging
 * slots on that stream. */
static PyObject *group_slot(GroupObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    dptc_module_state *st;
    dptc_group *g = open_shm_group(self, &st, "slot");
    if (!g)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "slot(stream, local_rank)");
        return NULL;
    }
    long stream = PyLong_AsLong(args[0]), local = PyLong_AsLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    size_t bytes;
    void *base = dptc_shm_slot(dptc_group_transport(g), (int)stream, (int)local, &bytes);
    if (!base) {
        PyErr_Format(PyExc_ValueError, "no slots for stream %ld, local rank %ld", stream, local);
        return NULL;
    }
    return PyMemoryView_FromMemory(base, (Py_ssize_t)bytes, PyBUF_WRITE);
}

/* _fill_slots_between(sentinel) -> fills so far.  Tests only: see [Note:
 * slots between collectives] in shm.c; sentinel a byte (0..255), -1 to
 * stop, or None to only count the fills. */
static PyObject *group_fill_slots_between(GroupObject *self, PyObject *arg)
{
    dptc_module_state *st;
    dptc_group *g = open_shm_group(self, &st, "_fill_slots_between");
    if (!g)
        return NULL;
    if (arg != Py_None) {
        long sentinel = PyLong_AsLong(arg);
        if (sentinel == -1 && PyErr_Occurred())
            return NULL;
        if (sentinel < -1 || sentinel > 255) {
            PyErr_Format(PyExc_ValueError, "sentinel must be a byte (0 to 255), -1 or None, "
                         "got %ld", sentinel);
            return NULL;
        }
        dptc_shm_fill_slots_between(dptc_group_transport(g), (int)sentinel);
    }
    return PyLong_FromUnsignedLongLong(dptc_shm_sentinel_fills(dptc_group_transport(g)));
}

/* segment_path(): what local peers open to map this rank's segment (the
 * creator's memfd as /proc/<pid>/fd/<fd>), or None when peers open the
 * /dev/shm name they were given. */
static PyObject *group_segment_path(GroupObject *self, PyObject *Py_UNUSED(ignored))
{
    dptc_module_state *st;
    dptc_group *g = open_shm_group(self, &st, "segment_path");
    if (!g)
        return NULL;
    int fd = dptc_shm_segment_fd(dptc_group_transport(g));
    if (fd < 0)
        Py_RETURN_NONE;
    return PyUnicode_FromFormat("/proc/%d/fd/%d", (int)getpid(), fd);
}

/* failure() -> None, or the message of the group's failure: its own, or an
 * abort a local peer recorded. */
static PyObject *group_failure(GroupObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->group)
        Py_RETURN_NONE;
    dptc_error err;
    if (dptc_group_failure(self->group, &err) == DPTC_OK &&
        (!self->shm || dptc_shm_failure(dptc_group_transport(self->group), &err) == DPTC_OK))
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(err.message, (Py_ssize_t)strnlen(err.message, sizeof err.message),
                                "replace");
}

static PyObject *group_get_rank(GroupObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->rank);
}

static PyObject *group_get_size(GroupObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->size);
}

static PyObject *group_get_streams(GroupObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->group ? dptc_group_streams(self->group) : 0);
}

static PyObject *group_get_closed(GroupObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->group == NULL);
}

/* stagings(stream): how the collectives on `stream` that went through the
 * staging slots were staged so far (see [Note: staging] in shm.c). */
static PyObject *group_stagings(GroupObject *self, PyObject *arg)
{
    static const struct {
        const char *name;
        dptc_op op;
    } staged[] = {{"all_reduce", DPTC_OP_ALL_REDUCE},
                  {"all_gather", DPTC_OP_ALL_GATHER},
                  {"reduce_scatter", DPTC_OP_REDUCE_SCATTER},
                  {"broadcast", DPTC_OP_BROADCAST}};
    dptc_module_state *st;
    dptc_group *g = open_shm_group(self, &st, "stagings");
    if (!g)
        return NULL;
    long stream = PyLong_AsLong(arg);
    if (stream == -1 && PyErr_Occurred())
        return NULL;
    int index = stream < 0 || stream > INT_MAX ? -1 : (int)stream;  /* -1: out of range */
    PyObject *out = PyDict_New();
    if (!out)
        return NULL;
    for (size_t i = 0; i < sizeof staged / sizeof staged[0]; i++) {
        uint64_t counts[2];
        dptc_shm_stagings(dptc_group_transport(g), index, staged[i].op, counts);
        PyObject *pair = Py_BuildValue("{sKsK}", "cached", (unsigned long long)counts[0],
                                       "streamed", (unsigned long long)counts[1]);
        if (!pair || PyDict_SetItemString(out, staged[i].name, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

static PyMethodDef group_methods[] = {
    {"run", (PyCFunction)(void (*)(void))group_run, METH_FASTCALL,
     "run(op, dtype, redop, input, output, count, root, stream)\n\n"
     "Runs one collective to completion (GIL released)."},
    {"submit", (PyCFunction)(void (*)(void))group_submit, METH_FASTCALL,
     "submit(op, dtype, redop, input, output, count, root, stream) -> Work"},
    {"abort", (PyCFunction)group_abort, METH_O,
     "abort(reason)\n\nFails the group here and on every local peer."},
    {"share", (PyCFunction)group_share, METH_O,
     "share(nbytes) -> SharedBuffer\n\nCollective: memory every local rank maps, zero-filled."},
    {"set_bridge", (PyCFunction)(void (*)(void))group_set_bridge, METH_FASTCALL,
     "set_bridge(stream, callable)\n\nAttaches a stream's cross-node step; call before its "
     "first collective."},
    {"unlink", (PyCFunction)group_unlink, METH_NOARGS,
     "unlink()\n\nForgets the shared segment's name (once every local rank mapped it)."},
    {"stagings", (PyCFunction)group_stagings, METH_O,
     "stagings(stream) -> dict\n\nStaged collectives on stream, per op, staged each way so far."},
    {"segment_path", (PyCFunction)group_segment_path, METH_NOARGS,
     "segment_path() -> str or None\n\nWhat local peers open to map the segment."},
    {"close", (PyCFunction)group_close, METH_NOARGS, "close()\n\nStops the engine and unmaps."},
    {"failure", (PyCFunction)group_failure, METH_NOARGS,
     "failure() -> None or str\n\nThe message of the group's failure, if it failed."},
    {"slot", (PyCFunction)(void (*)(void))group_slot, METH_FASTCALL,
     "slot(stream, local_rank) -> memoryview over that rank's staging buffers"},
    {"_fill_slots_between", (PyCFunction)group_fill_slots_between, METH_O,
     "_fill_slots_between(sentinel) -> int\n\nTests only: local rank 0 fills every slot "
     "with the byte between collectives (-1 stops, None only counts); returns the fills."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef group_getset[] = {
    {"rank", (getter)group_get_rank, NULL, "rank in the group", NULL},
    {"size", (getter)group_get_size, NULL, "ranks in the group", NULL},
    {"streams", (getter)group_get_streams, NULL, "independent ordered streams", NULL},
    {"closed", (getter)group_get_closed, NULL, "whether close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot group_slots[] = {
    {Py_tp_doc, "A dptc process group: the C engine of one set of ranks."},
    {Py_tp_new, group_new},
    {Py_tp_dealloc, group_dealloc},
    {Py_tp_traverse, group_traverse},
    {Py_tp_clear, group_clear},
    {Py_tp_methods, group_methods},
    {Py_tp_getset, group_getset},
    {0, NULL},
};

static PyType_Spec group_spec = {
    .name = "dptc._C.Group",
    .basicsize = sizeof(GroupObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = group_slots,
};

/* ------------------------------------------------------------------ */
/* The watched works' count, for dptc/_futures.py's watcher (see [Note:
 * watched works] in engine.h) */

static PyObject *watched_count(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLong(dptc_watched_count());
}

static PyObject *watched_wake(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    dptc_watched_wake();
    Py_RETURN_NONE;
}

/* _watched_sleep(seen, timeout): sleeps, GIL released, while the count is
 * `seen`, at most timeout seconds (None: no limit). */
static PyObject *watched_sleep(PyObject *Py_UNUSED(module), PyObject *const *args,
                               Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (seen, timeout)");
        return NULL;
    }
    unsigned long seen = PyLong_AsUnsignedLong(args[0]);
    if (seen == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    double timeout = -1.0;
    if (args[1] != Py_None) {
        timeout = PyFloat_AsDouble(args[1]);
        if (timeout == -1.0 && PyErr_Occurred())
            return NULL;
        if (!(timeout >= 0))
            timeout = 0;
    }
    Py_BEGIN_ALLOW_THREADS
    dptc_watched_sleep((uint32_t)seen, timeout);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef watched_functions[] = {
    {"_watched_count", watched_count, METH_NOARGS, NULL},
    {"_watched_wake", watched_wake, METH_NOARGS, NULL},
    {"_watched_sleep", (PyCFunction)(void (*)(void))watched_sleep, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------------ */
/* Module */

static int add_exception(PyObject *module, PyObject **slot, const char *name, PyObject *bases,
                         const char *doc)
{
    *slot = PyErr_NewExceptionWithDoc(name, doc, bases, NULL);
    if (!*slot)
        return -1;
    const char *short_name = strrchr(name, '.') + 1;
    return PyModule_AddObjectRef(module, short_name, *slot);
}

static int add_exceptions(PyObject *module, dptc_module_state *st)
{
    if (add_exception(module, &st->dist_error, "dptc.DistError", PyExc_RuntimeError,
                      "A collective failed on this rank or a peer.") < 0)
        return -1;
    PyObject *bases = PyTuple_Pack(2, st->dist_error, PyExc_TimeoutError);
    if (!bases)
        return -1;
    int rc = add_exception(module, &st->timeout_error, "dptc.DistTimeoutError", bases,
                           "A wait passed the group's timeout.");
    Py_DECREF(bases);
    if (rc < 0)
        return -1;
    if (add_exception(module, &st->peer_lost_error, "dptc.PeerLostError", st->dist_error,
                      "A peer exited or aborted the group.") < 0)
        return -1;
    if (add_exception(module, &st->mismatch_error, "dptc.CollectiveMismatchError",
                      st->dist_error, "Ranks issued different collectives.") < 0)
        return -1;
    return add_exception(module, &st->cuda_library_error, "dptc.CudaLibraryError",
                         st->dist_error, "NCCL or the CUDA runtime cannot be loaded: the file "
                         "is missing or lacks a function dptc calls.");
}

/* transports: the names of the transports compiled in (dptc.info reports them). */
static int add_transports(PyObject *module)
{
    PyObject *names = Py_BuildValue("(sss)", dptc_shm_transport.name, "bridge",
                                    dptc_nccl_transport.name);
    if (!names)
        return -1;
    int rc = PyModule_AddObjectRef(module, "transports", names);
    Py_DECREF(names);
    return rc;
}

static int add_type(PyObject *module, PyTypeObject **slot, PyType_Spec *spec)
{
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, NULL);
    if (!*slot)
        return -1;
    return PyModule_AddType(module, *slot);
}

static int module_exec(PyObject *module)
{
    dptc_module_state *st = dptc_state(module);
    if (add_type(module, &st->group_type, &group_spec) < 0 ||
        add_type(module, &st->work_type, &work_spec) < 0 ||
        add_type(module, &st->shared_type, &shared_spec) < 0 || add_exceptions(module, st) < 0 ||
        PyModule_AddFunctions(module, watched_functions) < 0)
        return -1;
    if (dptc_reducer_module_exec(module, st) < 0 || dptc_shard_module_exec(module, st) < 0)
        return -1;
    if (dptc_ranges_module_exec(module, st) < 0)
        return -1;
    if (dptc_cudalib_module_exec(module, st) < 0 || add_transports(module) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    dptc_module_state *st = dptc_state(module);
    Py_VISIT(st->group_type);
    Py_VISIT(st->work_type);
    Py_VISIT(st->shared_type);
    Py_VISIT(st->dist_error);
    Py_VISIT(st->timeout_error);
    Py_VISIT(st->peer_lost_error);
    Py_VISIT(st->mismatch_error);
    Py_VISIT(st->cuda_library_error);
    int rc = dptc_shard_traverse(st, visit, arg);
    rc = rc ? rc : dptc_ranges_traverse(st, visit, arg);
    return rc ? rc : dptc_reducer_traverse(st, visit, arg);
}

static int module_clear(PyObject *module)
{
    dptc_module_state *st = dptc_state(module);
    Py_CLEAR(st->group_type);
    Py_CLEAR(st->work_type);
    Py_CLEAR(st->shared_type);
    Py_CLEAR(st->dist_error);
    Py_CLEAR(st->timeout_error);
    Py_CLEAR(st->peer_lost_error);
    Py_CLEAR(st->mismatch_error);
    Py_CLEAR(st->cuda_library_error);
    dptc_reducer_clear(st);
    dptc_shard_clear(st);
    dptc_ranges_clear(st);
    retired_clear(st);
    return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef dptc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dptc._C",
    .m_doc = "dptc's C core: the collective engine, its transports, the DDP reducer and FSDP's units.",
    .m_size = sizeof(dptc_module_state),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&dptc_module); }
