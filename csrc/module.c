/* module.c — dptc._C: multi-phase init, module state, the Group and Work
 * types, and the one function that turns a status into an exception. */
#include "module.h"
#include "transport.h"

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
    case DPTC_ERR_PYTHON:
        if (PyErr_Occurred())
            return NULL;
        type = st->dist_error;
        break;
    default:
        type = st->dist_error;
        break;
    }
    PyErr_SetString(type, message);
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Work */

typedef struct {
    PyObject_HEAD
    dptc_work *work;      /* owned */
    PyObject *keepalive;  /* tensors the work reads or writes */
    double timeout_s;
} WorkObject;

PyObject *dptc_work_new(dptc_module_state *st, dptc_work *w, PyObject *keepalive)
{
    WorkObject *self = PyObject_GC_New(WorkObject, st->work_type);
    if (!self) {
        dptc_work_release(w);
        return NULL;
    }
    self->work = w;
    self->keepalive = Py_XNewRef(keepalive);
    self->timeout_s = 300.0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyObject *work_wait(WorkObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:wait", keywords, &timeout))
        return NULL;
    double seconds = self->timeout_s;
    if (timeout != Py_None) {
        /* Seconds, or a datetime.timedelta as torch's Work.wait takes. */
        PyObject *value = PyObject_HasAttrString(timeout, "total_seconds")
                              ? PyObject_CallMethod(timeout, "total_seconds", NULL)
                              : Py_NewRef(timeout);
        if (!value)
            return NULL;
        seconds = PyFloat_AsDouble(value);
        Py_DECREF(value);
        if (seconds == -1.0 && PyErr_Occurred())
            return NULL;
    }
    dptc_error err;
    dptc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dptc_work_wait(self->work, seconds, &err);
    Py_END_ALLOW_THREADS
    if (status != DPTC_OK)
        return dptc_raise(dptc_state_from_type(Py_TYPE(self)), status, &err);
    Py_RETURN_TRUE;
}

static PyObject *work_is_completed(WorkObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(dptc_work_is_completed(self->work));
}

static int work_traverse(WorkObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->keepalive);
    return 0;
}

static int work_clear(WorkObject *self)
{
    Py_CLEAR(self->keepalive);
    return 0;
}

static void work_dealloc(WorkObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    /* The engine may still write into the tensors we keep alive: wait. */
    if (self->work && !dptc_work_is_completed(self->work)) {
        Py_BEGIN_ALLOW_THREADS
        dptc_work_wait(self->work, self->timeout_s * 2 + 1, NULL);
        Py_END_ALLOW_THREADS
    }
    dptc_work_release(self->work);
    work_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyMethodDef work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))work_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> True\n\nBlocks until the collective completes; raises its error."},
    {"is_completed", (PyCFunction)work_is_completed, METH_NOARGS,
     "is_completed() -> bool"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot work_slots[] = {
    {Py_tp_doc, "Handle of an asynchronous dptc collective."},
    {Py_tp_methods, work_methods},
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
/* Group */

typedef struct {
    PyObject_HEAD
    dptc_group *group;    /* owned; NULL once closed */
    int rank, size;
} GroupObject;

/* ------------------------------------------------------------------ */
/* SharedBuffer: memory every local rank maps (see [Note: shared buffers]
 * in engine.h), exported through the buffer protocol so that
 * torch.frombuffer can put a tensor on it; the tensor's storage keeps the
 * SharedBuffer alive. */

typedef struct {
    PyObject_HEAD
    PyObject *group;      /* the GroupObject that made it (strong) */
    dptc_shared shared;   /* mappings, owned */
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
        dptc_group_unshare(group->group, &self->shared);
    dptc_shared_free(&self->shared);
    Py_CLEAR(self->group);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyObject *shared_get_nbytes(SharedObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->shared.bytes);
}

static PyGetSetDef shared_getset[] = {
    {"nbytes", (getter)shared_get_nbytes, NULL, "bytes mapped (a multiple of the page size)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot shared_slots[] = {
    {Py_tp_doc, "Memory every local rank of a group maps; see Group.share."},
    {Py_bf_getbuffer, shared_getbuffer},
    {Py_tp_getset, shared_getset},
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
                               "name", "create", "slot_bytes", "timeout", NULL};
    dptc_group_config cfg = {0};
    Py_ssize_t slot_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiiiiispnd:Group", keywords, &cfg.rank,
                                     &cfg.size, &cfg.local_rank, &cfg.local_size, &cfg.node,
                                     &cfg.nnodes, &cfg.shm_name, &cfg.create, &slot_bytes,
                                     &cfg.timeout_s))
        return NULL;
    if (slot_bytes <= 0) {
        PyErr_Format(PyExc_ValueError, "slot_bytes must be > 0, got %zd", slot_bytes);
        return NULL;
    }
    cfg.slot_bytes = (size_t)slot_bytes;
    GroupObject *self = (GroupObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    dptc_error err;
    dptc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dptc_group_create(&cfg, &self->group, &err);
    Py_END_ALLOW_THREADS
    if (status != DPTC_OK) {
        Py_DECREF(self);
        return dptc_raise(dptc_state_from_type(type), status, &err);
    }
    self->rank = cfg.rank;
    self->size = cfg.size;
    return (PyObject *)self;
}

static void group_close_now(GroupObject *self)
{
    dptc_group *g = self->group;
    self->group = NULL;
    if (!g)
        return;
    Py_BEGIN_ALLOW_THREADS
    dptc_group_destroy(g);
    Py_END_ALLOW_THREADS
}

static void group_dealloc(GroupObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    group_close_now(self);
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

/* Parses (op, dtype, redop, input, output, count, root) into c. */
static int parse_coll(PyObject *const *args, Py_ssize_t nargs, dptc_coll *c)
{
    if (nargs < 7) {
        PyErr_SetString(PyExc_TypeError,
                        "expected (op, dtype, redop, input_ptr, output_ptr, count, root)");
        return -1;
    }
    long values[3];
    for (int i = 0; i < 3; i++) {
        values[i] = PyLong_AsLong(args[i]);
        if (values[i] == -1 && PyErr_Occurred())
            return -1;
    }
    if (values[0] < 0 || values[0] >= DPTC_OP_COUNT || values[1] < 0 ||
        values[1] >= DPTC_DTYPE_COUNT || values[2] < 0 || values[2] >= DPTC_REDOP_COUNT) {
        PyErr_Format(PyExc_ValueError, "invalid collective codes op=%ld dtype=%ld redop=%ld",
                     values[0], values[1], values[2]);
        return -1;
    }
    c->op = (dptc_op)values[0];
    c->dtype = (dptc_dtype)values[1];
    c->redop = (dptc_redop)values[2];
    c->input = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred())
        return -1;
    c->output = PyLong_AsVoidPtr(args[4]);
    if (PyErr_Occurred())
        return -1;
    c->count = PyLong_AsSize_t(args[5]);
    if (c->count == (size_t)-1 && PyErr_Occurred())
        return -1;
    c->root = (int)PyLong_AsLong(args[6]);
    if (c->root == -1 && PyErr_Occurred())
        return -1;
    return 0;
}

static PyObject *group_run(GroupObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    dptc_module_state *st;
    dptc_group *g = open_group(self, &st);
    dptc_coll c;
    if (!g || parse_coll(args, nargs, &c) < 0)
        return NULL;
    dptc_error err;
    dptc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dptc_group_run(g, &c, &err);
    Py_END_ALLOW_THREADS
    if (status != DPTC_OK)
        return dptc_raise(st, status, &err);
    Py_RETURN_NONE;
}

/* submit(op, dtype, redop, input, output, count, root, keepalive) -> Work */
static PyObject *group_submit(GroupObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    dptc_module_state *st;
    dptc_group *g = open_group(self, &st);
    dptc_coll c;
    if (!g || parse_coll(args, nargs, &c) < 0)
        return NULL;
    dptc_error err;
    dptc_work *w;
    dptc_status status = dptc_group_submit(g, &c, &w, &err);
    if (status != DPTC_OK)
        return dptc_raise(st, status, &err);
    PyObject *keep = PyTuple_Pack(2, (PyObject *)self, nargs > 7 ? args[7] : Py_None);
    if (!keep) {
        /* The work is queued: it must not outlive its buffers unobserved. */
        Py_BEGIN_ALLOW_THREADS
        dptc_work_wait(w, dptc_group_timeout(g) * 2 + 1, NULL);
        Py_END_ALLOW_THREADS
        dptc_work_release(w);
        return NULL;
    }
    PyObject *work = dptc_work_new(st, w, keep);
    Py_DECREF(keep);
    if (work)
        ((WorkObject *)work)->timeout_s = dptc_group_timeout(g) * 2 + 1;
    return work;
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
    dptc_group_abort(g, text);
    Py_RETURN_NONE;
}

/* share(nbytes) -> SharedBuffer.  Collective over the group: every rank
 * calls it in the same order with the same size. */
static PyObject *group_share(GroupObject *self, PyObject *arg)
{
    dptc_module_state *st;
    dptc_group *g = open_group(self, &st);
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
    dptc_error err;
    dptc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dptc_group_share(g, (size_t)nbytes, &shared->shared, &err);
    Py_END_ALLOW_THREADS
    if (status != DPTC_OK) {
        Py_DECREF(shared);
        return dptc_raise(st, status, &err);
    }
    shared->group = Py_NewRef((PyObject *)self);
    PyObject_GC_Track(shared);
    return (PyObject *)shared;
}

/* set_bridge(callable): the cross-node step, see bridge.c. */
static PyObject *group_set_bridge(GroupObject *self, PyObject *callable)
{
    dptc_module_state *st;
    dptc_group *g = open_group(self, &st);
    if (!g)
        return NULL;
    if (!PyCallable_Check(callable)) {
        PyErr_Format(PyExc_TypeError, "bridge must be callable, got %.100s",
                     Py_TYPE(callable)->tp_name);
        return NULL;
    }
    struct dptc_bridge *bridge = dptc_bridge_new(callable);
    if (!bridge)
        return NULL;
    dptc_group_set_bridge(g, bridge);
    Py_RETURN_NONE;
}

static PyObject *group_unlink(GroupObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->group)
        dptc_group_unlink(self->group);
    Py_RETURN_NONE;
}

static PyObject *group_close(GroupObject *self, PyObject *Py_UNUSED(ignored))
{
    group_close_now(self);
    Py_RETURN_NONE;
}

/* slot(local_rank) -> writable memoryview over that rank's staging slots. */
static PyObject *group_slot(GroupObject *self, PyObject *arg)
{
    dptc_module_state *st;
    dptc_group *g = open_group(self, &st);
    if (!g)
        return NULL;
    long local = PyLong_AsLong(arg);
    if (local == -1 && PyErr_Occurred())
        return NULL;
    size_t bytes;
    void *base = dptc_group_slot(g, (int)local, &bytes);
    if (!base) {
        PyErr_Format(PyExc_ValueError, "local_rank must be a local rank of this node, got %ld",
                     local);
        return NULL;
    }
    return PyMemoryView_FromMemory(base, (Py_ssize_t)bytes, PyBUF_WRITE);
}

static PyObject *group_get_rank(GroupObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->rank);
}

static PyObject *group_get_size(GroupObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->size);
}

static PyObject *group_get_closed(GroupObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->group == NULL);
}

static PyMethodDef group_methods[] = {
    {"run", (PyCFunction)(void (*)(void))group_run, METH_FASTCALL,
     "run(op, dtype, redop, input_ptr, output_ptr, count, root)\n\n"
     "Runs one collective to completion (GIL released)."},
    {"submit", (PyCFunction)(void (*)(void))group_submit, METH_FASTCALL,
     "submit(op, dtype, redop, input_ptr, output_ptr, count, root, keepalive) -> Work"},
    {"abort", (PyCFunction)group_abort, METH_O,
     "abort(reason)\n\nFails the group here and on every local peer."},
    {"share", (PyCFunction)group_share, METH_O,
     "share(nbytes) -> SharedBuffer\n\nCollective: memory every local rank maps, zero-filled."},
    {"set_bridge", (PyCFunction)group_set_bridge, METH_O,
     "set_bridge(callable)\n\nAttaches the cross-node step; call before the first collective."},
    {"unlink", (PyCFunction)group_unlink, METH_NOARGS,
     "unlink()\n\nRemoves the shared segment's name (once every local rank mapped it)."},
    {"close", (PyCFunction)group_close, METH_NOARGS, "close()\n\nStops the engine and unmaps."},
    {"slot", (PyCFunction)group_slot, METH_O,
     "slot(local_rank) -> memoryview over that rank's staging buffers"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef group_getset[] = {
    {"rank", (getter)group_get_rank, NULL, "rank in the group", NULL},
    {"size", (getter)group_get_size, NULL, "ranks in the group", NULL},
    {"closed", (getter)group_get_closed, NULL, "whether close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot group_slots[] = {
    {Py_tp_doc, "A dptc process group: the C engine of one set of ranks."},
    {Py_tp_new, group_new},
    {Py_tp_dealloc, group_dealloc},
    {Py_tp_methods, group_methods},
    {Py_tp_getset, group_getset},
    {0, NULL},
};

static PyType_Spec group_spec = {
    .name = "dptc._C.Group",
    .basicsize = sizeof(GroupObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = group_slots,
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
    return add_exception(module, &st->mismatch_error, "dptc.CollectiveMismatchError",
                         st->dist_error, "Ranks issued different collectives.");
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
        add_type(module, &st->shared_type, &shared_spec) < 0 || add_exceptions(module, st) < 0)
        return -1;
    if (dptc_reducer_module_exec(module, st) < 0)
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
    return dptc_reducer_traverse(st, visit, arg);
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
    dptc_reducer_clear(st);
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
    .m_doc = "dptc's C core: the collective engine, its transports and the DDP reducer.",
    .m_size = sizeof(dptc_module_state),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&dptc_module); }
