/* unit.c — FSDP: the state machine of one fully_shard unit.
 *
 * A unit is the set of parameters one fully_shard call manages.  Between
 * steps each rank holds only its shard of them; around the unit's forward
 * and backward the unit gathers every rank's shard straight into the
 * unsharded parameters' storage, and once its gradients are complete it
 * reduce-scatters them into the sharded gradients.  dptc/fsdp/_unit.py owns
 * the tensors (layout, dtype casts, swapping parameters on the module) and
 * calls the transitions below from its hooks; this file decides what each
 * call does in each state, issues the collectives on the group's streams and
 * keeps the work handles, so a transition that is already done is a no-op
 * and one that is not allowed is an error naming both states.
 *
 * [Note: unit states]
 * Parameters and gradients have separate states because they overlap in
 * time: with set_reshard_after_backward(False) a unit's gradients reduce
 * while its parameters stay unsharded, and in backward one unit's gather
 * (a prefetch) runs while the next one's gradients reduce.  Gathers go on the
 * group's gather stream and reductions on its reduce stream, so a prefetch
 * never queues behind a reduce-scatter (see [Note: streams] in engine.h).
 *
 * The work handles are the engine's Work objects: they keep the tensors a
 * collective touches alive until it has completed, and leak them if a wait
 * gives up before it does (see [Note: memory of unfinished work] in
 * module.c).
 *
 * While a torch profiler records, each collective's range follows the
 * states: the gather's opens at unshard and closes when the unit leaves
 * UNIT_UNSHARDING, the reduce-scatter's opens at reduce and closes when its
 * wait returns, and HSDP's all-reduce across replicas has its own (see
 * [Note: profiler ranges] in dptc/_ranges.py).  The ranges carry the unit's
 * label, its module's name, which dptc/fsdp sets.
 */
#include "module.h"

typedef enum {
    /* Only the shards exist; the unsharded storage is freed.  Entered at
     * construction and by reshard. */
    UNIT_SHARDED = 0,
    /* An all-gather into the unsharded storage is in flight.  Entered by
     * unshard (a forward, a backward, a prefetch or the user's unshard). */
    UNIT_UNSHARDING = 1,
    /* The unsharded parameters hold every rank's shard.  Entered when the
     * gather's wait returns. */
    UNIT_UNSHARDED = 2,
} unit_state;

typedef enum {
    /* No reduction of this unit's gradients is in flight. */
    GRADS_IDLE = 0,
    /* A reduce-scatter of the unit's gradients (then, for HSDP, the
     * all-reduce of its output across replicas) is in flight.  Entered by
     * reduce, left by wait_reduce. */
    GRADS_REDUCING = 1,
} grads_state;

static const char *const unit_state_names[] = {"sharded", "unsharding", "unsharded"};

typedef struct {
    PyObject_HEAD
    /* Where the collectives go. */
    PyObject *group;          /* dptc._C.Group of the shard dimension */
    int gather_stream;
    int reduce_stream;
    /* Parameters. */
    unit_state state;
    PyObject *gather_work;    /* Work of the gather in flight, or NULL */
    /* Gradients: which parameters' gradients are complete this backward. */
    grads_state grads;
    Py_ssize_t nparams;
    Py_ssize_t nready;
    unsigned char *ready;     /* nparams flags */
    PyObject *reduce_work;    /* Work of the reduce-scatter in flight, or NULL */
    PyObject *after_reduce;   /* (group, dtype, redop, tensor, stream): HSDP's all-reduce */
    PyObject *current_stream; /* a device unit's () -> torch.cuda.Stream, or NULL */
    /* Profiler ranges: the unit's name in them, and the ranges open now. */
    PyObject *label;          /* str */
    PyObject *gather_range;   /* while UNIT_UNSHARDING, when a profiler recorded at unshard */
    PyObject *reduce_range;   /* while GRADS_REDUCING, likewise */
} UnitObject;

static PyObject *unit_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"group", "nparams", "gather_stream", "reduce_stream",
                               "current_stream", NULL};
    PyObject *group, *current_stream = Py_None;
    Py_ssize_t nparams;
    int gather_stream = 0, reduce_stream = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|ii$O:Unit", keywords, &group, &nparams,
                                     &gather_stream, &reduce_stream, &current_stream))
        return NULL;
    if (current_stream != Py_None && !PyCallable_Check(current_stream)) {
        PyErr_SetString(PyExc_TypeError, "Unit: current_stream must be None or a callable");
        return NULL;
    }
    dptc_module_state *st = dptc_state_from_type(type);
    dptc_group *g = dptc_group_from_object(st, group, "group");
    if (!g)
        return NULL;
    int nstreams = dptc_group_streams(g);
    if (nparams < 0 || gather_stream < 0 || gather_stream >= nstreams || reduce_stream < 0 ||
        reduce_stream >= nstreams) {
        PyErr_Format(PyExc_ValueError, "Unit needs nparams >= 0 and streams in [0, %d), got "
                     "nparams=%zd gather_stream=%d reduce_stream=%d", nstreams, nparams,
                     gather_stream, reduce_stream);
        return NULL;
    }
    UnitObject *self = (UnitObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->ready = PyMem_Calloc((size_t)nparams + 1, 1);
    if (!self->ready) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->label = PyUnicode_FromString("unit");
    if (!self->label) {
        Py_DECREF(self);
        return NULL;
    }
    self->group = Py_NewRef(group);
    self->current_stream = current_stream == Py_None ? NULL : Py_NewRef(current_stream);
    self->gather_stream = gather_stream;
    self->reduce_stream = reduce_stream;
    self->nparams = nparams;
    self->state = UNIT_SHARDED;
    self->grads = GRADS_IDLE;
    return (PyObject *)self;
}

/* group.submit(op, dtype, redop, input, output, count, root, stream[,
 * cuda_stream]): a device unit's collectives follow its current stream
 * (current_stream(), see [Note: the NCCL transport] in nccl.h).  Returns a
 * new reference to the Work. */
static PyObject *submit(UnitObject *self, PyObject *group, int op, PyObject *dtype,
                        PyObject *redop, PyObject *input, PyObject *output, PyObject *count,
                        int stream)
{
    PyObject *values[3] = {PyLong_FromLong(op), PyLong_FromLong(0), PyLong_FromLong(stream)};
    PyObject *cuda_stream = self->current_stream ? PyObject_CallNoArgs(self->current_stream)
                                                 : NULL;
    PyObject *work = NULL;
    if (values[0] && values[1] && values[2] && (cuda_stream || !self->current_stream)) {
        PyObject *call[] = {group,  values[0], dtype,     redop,    input,
                            output, count,     values[1], values[2], cuda_stream};
        PyObject *name = PyUnicode_FromString("submit");
        if (name) {
            size_t nargs = cuda_stream ? 10 : 9;
            work = PyObject_VectorcallMethod(name, call, nargs | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                             NULL);
            Py_DECREF(name);
        }
    }
    for (int i = 0; i < 3; i++)
        Py_XDECREF(values[i]);
    Py_XDECREF(cuda_stream);
    return work;
}

/* [Note: a device unit's waits]
 * A collective on CUDA tensors is waited for by streams, not by the host.
 * Two streams wait: the one it was issued after (Work.wait()), where the
 * unit allocated its buffers, so that freeing them afterwards is safe; and
 * the stream current now, which reads what it wrote.  They differ where a
 * script runs backward under a side stream (`with torch.cuda.stream(s):
 * loss.backward()`, which torch documents): autograd's hooks issue on the
 * streams the forward ran on, while the end-of-backward callback, the
 * optimizer and HSDP's step run on s.  torch's NCCL Work.wait() makes the
 * current stream wait, and so does its fully_shard.  Then the work lets go
 * of its tensors (Work._release_tensors): the issuing stream has waited. */

/* Waits for *work and drops it.  0, or -1 with the work's exception. */
static int finish(UnitObject *self, PyObject **work)
{
    if (!*work)
        return 0;
    PyObject *done = PyObject_CallMethod(*work, "wait", NULL);
    if (done && self->current_stream) {  /* see [Note: a device unit's waits] */
        Py_DECREF(done);
        PyObject *stream = PyObject_CallNoArgs(self->current_stream);
        done = stream ? PyObject_CallMethod(*work, "wait_stream", "O", stream) : NULL;
        Py_XDECREF(stream);
        if (done) {
            Py_DECREF(done);
            done = PyObject_CallMethod(*work, "_release_tensors", NULL);
        }
    }
    Py_CLEAR(*work);
    if (!done)
        return -1;
    Py_DECREF(done);
    return 0;
}

static dptc_module_state *unit_module_state(UnitObject *self)
{
    return dptc_state_from_type(Py_TYPE(self));
}

/* Opens the range "<collective> <label>" into *range while a profiler
 * records.  0, or -1 with an exception. */
static int unit_open_range(UnitObject *self, PyObject **range, const char *collective)
{
    dptc_module_state *st = unit_module_state(self);
    if (!dptc_profiling(st))
        return 0;
    return dptc_range_open(st, range, "%s %U", collective, self->label) == DPTC_OK ? 0 : -1;
}

/* Closes *range, if open, keeping an exception already set.  0, or -1 with
 * an exception. */
static int unit_close_range(UnitObject *self, PyObject **range)
{
    if (!*range)
        return 0;
    return dptc_range_close(unit_module_state(self), range) == DPTC_OK ? 0 : -1;
}

/* unshard(dtype, input, outputs, count[, group]) -> bool: SHARDED ->
 * UNSHARDING.  Gathers every rank's `input` (count elements, the
 * concatenation of this rank's pieces) into the list of unsharded
 * `outputs`, over the unit's group or, after a reshard to a smaller group
 * in forward, over `group` (a dptc._C.Group with as many streams).  False,
 * doing nothing, when the unit is already unsharding or unsharded.  With
 * input None there is nothing to gather (the unsharded parameters are the
 * shard buffer, see [Note: a shard group of one] in dptc/fsdp/_unit.py): the
 * unit goes to UNSHARDING with no work in flight. */
static PyObject *unit_unshard(UnitObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "unshard(dtype, input, outputs, count[, group])");
        return NULL;
    }
    if (self->state != UNIT_SHARDED)
        Py_RETURN_FALSE;
    if (args[1] == Py_None) {
        self->state = UNIT_UNSHARDING;
        Py_RETURN_TRUE;
    }
    PyObject *group = nargs == 5 && args[4] != Py_None ? args[4] : self->group;
    if (unit_open_range(self, &self->gather_range, "dptc::all_gather") < 0)
        return NULL;
    PyObject *zero = PyLong_FromLong(0);
    if (zero)
        self->gather_work = submit(self, group, DPTC_OP_ALL_GATHER, args[0], zero, args[1],
                                   args[2], args[3], self->gather_stream);
    Py_XDECREF(zero);
    if (!self->gather_work) {
        unit_close_range(self, &self->gather_range);  /* keeps submit's exception */
        return NULL;
    }
    self->state = UNIT_UNSHARDING;
    Py_RETURN_TRUE;
}

/* wait_unshard(): UNSHARDING -> UNSHARDED; a no-op when UNSHARDED. */
static PyObject *unit_wait_unshard(UnitObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->state == UNIT_SHARDED) {
        PyErr_SetString(PyExc_RuntimeError, "wait_unshard: the unit is sharded; call unshard "
                                            "first");
        return NULL;
    }
    if (self->state == UNIT_UNSHARDING) {
        int rc = finish(self, &self->gather_work);
        /* Failed or not, the gather is over: a failure leaves the group
         * aborted and the unit sharded. */
        self->state = rc == 0 ? UNIT_UNSHARDED : UNIT_SHARDED;
        if (unit_close_range(self, &self->gather_range) < 0 || rc < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* reshard() -> bool: UNSHARDED -> SHARDED, after waiting for a gather still
 * in flight (its tensors are about to be freed).  False when already
 * sharded. */
static PyObject *unit_reshard(UnitObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->state == UNIT_SHARDED)
        Py_RETURN_FALSE;
    int rc = self->state == UNIT_UNSHARDING ? finish(self, &self->gather_work) : 0;
    self->state = UNIT_SHARDED;
    if (unit_close_range(self, &self->gather_range) < 0 || rc < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* grad_ready(index) -> bool: marks parameter `index`'s gradient complete for
 * this backward; True for the call that completes the unit (each index
 * counts once, so a tied parameter's second hook changes nothing). */
static PyObject *unit_grad_ready(UnitObject *self, PyObject *arg)
{
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred())
        return NULL;
    if (index < 0 || index >= self->nparams) {
        PyErr_Format(PyExc_IndexError, "grad_ready: index %zd outside [0, %zd)", index,
                     self->nparams);
        return NULL;
    }
    if (self->ready[index])
        Py_RETURN_FALSE;
    self->ready[index] = 1;
    self->nready++;
    return PyBool_FromLong(self->nready == self->nparams);
}

static PyObject *unit_reset_ready(UnitObject *self, PyObject *Py_UNUSED(ignored))
{
    memset(self->ready, 0, (size_t)self->nparams);
    self->nready = 0;
    Py_RETURN_NONE;
}

/* reduce(dtype, redop, input, output, count, after=None): IDLE -> REDUCING.
 * Reduce-scatters `input` (group size * count elements) into `output` on the
 * reduce stream.  `after`, when given, is (group, dtype, redop, stream): the
 * all-reduce of `output` across that group (HSDP's replicas) that
 * wait_reduce runs once the reduce-scatter is done.
 *
 * Over a shard group of one rank the reduce-scatter would leave its input
 * as it is, so input may be None with output a list of tensors of count
 * elements in all: nothing is reduce-scattered, and `after` all-reduces the
 * list in place, piece by piece (see [Note: a shard group of one] in
 * dptc/fsdp/_unit.py). */
static PyObject *unit_reduce(UnitObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "reduce(dtype, redop, input, output, count, after=None)");
        return NULL;
    }
    if (self->grads != GRADS_IDLE) {
        PyErr_SetString(PyExc_RuntimeError, "reduce: the unit's previous gradient reduction "
                                            "is still in flight; call wait_reduce first");
        return NULL;
    }
    PyObject *after = nargs == 6 && args[5] != Py_None ? args[5] : NULL;
    if (after && (!PyTuple_Check(after) || PyTuple_GET_SIZE(after) != 4)) {
        PyErr_SetString(PyExc_TypeError, "reduce: after must be (group, dtype, redop, stream)");
        return NULL;
    }
    int pieces = args[2] == Py_None;
    if (pieces && !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "reduce: with input None, output must be a list of "
                                         "tensors (a shard group of one)");
        return NULL;
    }
    if (!pieces) {
        if (unit_open_range(self, &self->reduce_range, "dptc::reduce_scatter") < 0)
            return NULL;
        self->reduce_work = submit(self, self->group, DPTC_OP_REDUCE_SCATTER, args[0], args[1],
                                   args[2], args[3], args[4], self->reduce_stream);
        if (!self->reduce_work) {
            unit_close_range(self, &self->reduce_range);  /* keeps submit's exception */
            return NULL;
        }
    }
    self->grads = GRADS_REDUCING;
    Py_XSETREF(self->after_reduce,
               after ? PyTuple_Pack(6, PyTuple_GET_ITEM(after, 0), PyTuple_GET_ITEM(after, 1),
                                    PyTuple_GET_ITEM(after, 2), args[3],
                                    PyTuple_GET_ITEM(after, 3), args[4])
                     : NULL);
    if (after && !self->after_reduce)
        return NULL;
    Py_RETURN_NONE;
}

/* The all-reduce that follows a reduce-scatter across replicas, run to
 * completion.  0, or -1 with an exception. */
static int run_after_reduce(UnitObject *self)
{
    PyObject *after = self->after_reduce;
    self->after_reduce = NULL;
    if (!after)
        return 0;
    int rc = -1;
    /* (group, dtype, redop, output, stream, count); a list of outputs is
     * all-reduced in place as pieces (input None). */
    PyObject *group = PyTuple_GET_ITEM(after, 0), *output = PyTuple_GET_ITEM(after, 3);
    PyObject *input = PyList_Check(output) ? Py_None : output;
    PyObject *range = NULL;
    long stream = PyLong_AsLong(PyTuple_GET_ITEM(after, 4));
    PyObject *work = NULL;
    if (!(stream == -1 && PyErr_Occurred()) &&
        unit_open_range(self, &range, "dptc::all_reduce") == 0)
        work = submit(self, group, DPTC_OP_ALL_REDUCE, PyTuple_GET_ITEM(after, 1),
                      PyTuple_GET_ITEM(after, 2), input, output, PyTuple_GET_ITEM(after, 5),
                      (int)stream);
    if (work)
        rc = finish(self, &work);
    if (unit_close_range(self, &range) < 0)
        rc = -1;
    Py_DECREF(after);
    return rc;
}

/* wait_reduce() -> bool: REDUCING -> IDLE; False when nothing was in
 * flight. */
static PyObject *unit_wait_reduce(UnitObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->grads == GRADS_IDLE)
        Py_RETURN_FALSE;
    int rc = finish(self, &self->reduce_work);
    if (unit_close_range(self, &self->reduce_range) < 0)
        rc = -1;
    if (rc == 0)
        rc = run_after_reduce(self);
    Py_CLEAR(self->after_reduce);
    self->grads = GRADS_IDLE;
    if (rc < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *unit_get_state(UnitObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(unit_state_names[self->state]);
}

static PyObject *unit_get_reducing(UnitObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->grads == GRADS_REDUCING);
}

static PyObject *unit_get_ready(UnitObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->nready);
}

static PyObject *unit_get_label(UnitObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->label);
}

static int unit_set_label(UnitObject *self, PyObject *value, void *Py_UNUSED(closure))
{
    if (!value || !PyUnicode_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "Unit.label must be a str");
        return -1;
    }
    Py_SETREF(self->label, Py_NewRef(value));
    return 0;
}

static int unit_traverse(UnitObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->group);
    Py_VISIT(self->gather_work);
    Py_VISIT(self->reduce_work);
    Py_VISIT(self->after_reduce);
    Py_VISIT(self->current_stream);
    Py_VISIT(self->label);
    Py_VISIT(self->gather_range);
    Py_VISIT(self->reduce_range);
    return 0;
}

static int unit_clear(UnitObject *self)
{
    Py_CLEAR(self->group);
    Py_CLEAR(self->gather_work);   /* a Work's dealloc waits for its collective */
    Py_CLEAR(self->reduce_work);
    Py_CLEAR(self->after_reduce);
    Py_CLEAR(self->current_stream);
    Py_CLEAR(self->label);
    Py_CLEAR(self->gather_range);  /* dropping a handle ends its range */
    Py_CLEAR(self->reduce_range);
    return 0;
}

static void unit_dealloc(UnitObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    unit_clear(self);
    PyMem_Free(self->ready);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyMethodDef unit_methods[] = {
    {"unshard", (PyCFunction)(void (*)(void))unit_unshard, METH_FASTCALL,
     "unshard(dtype, input, outputs, count[, group]) -> bool\n\nsharded -> unsharding: "
     "gathers into outputs on the gather stream (of group, default the unit's); False when "
     "already unsharding or unsharded."},
    {"wait_unshard", (PyCFunction)unit_wait_unshard, METH_NOARGS,
     "wait_unshard()\n\nunsharding -> unsharded; a no-op when unsharded."},
    {"reshard", (PyCFunction)unit_reshard, METH_NOARGS,
     "reshard() -> bool\n\n-> sharded, waiting for a gather in flight; False when sharded."},
    {"grad_ready", (PyCFunction)unit_grad_ready, METH_O,
     "grad_ready(index) -> bool\n\nTrue when this completes the unit's gradients."},
    {"reset_ready", (PyCFunction)unit_reset_ready, METH_NOARGS,
     "reset_ready()\n\nForgets which gradients were complete (a new backward)."},
    {"reduce", (PyCFunction)(void (*)(void))unit_reduce, METH_FASTCALL,
     "reduce(dtype, redop, input, output, count, after=None)\n\nidle -> reducing: "
     "reduce-scatters input into output on the reduce stream."},
    {"wait_reduce", (PyCFunction)unit_wait_reduce, METH_NOARGS,
     "wait_reduce() -> bool\n\nreducing -> idle, running the replicas' all-reduce if any; "
     "False when nothing was in flight."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef unit_getset[] = {
    {"state", (getter)unit_get_state, NULL, "'sharded', 'unsharding' or 'unsharded'", NULL},
    {"reducing", (getter)unit_get_reducing, NULL, "a gradient reduction is in flight", NULL},
    {"ready", (getter)unit_get_ready, NULL, "gradients complete this backward", NULL},
    {"label", (getter)unit_get_label, (setter)unit_set_label,
     "the unit's name in profiler ranges, e.g. 'blocks.2'", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot unit_slots[] = {
    {Py_tp_doc, "Unit(group, nparams, gather_stream=0, reduce_stream=1)\n\nThe state machine "
                "of one fully_shard unit (see [Note: unit states] in csrc/unit.c)."},
    {Py_tp_new, unit_new},
    {Py_tp_methods, unit_methods},
    {Py_tp_getset, unit_getset},
    {Py_tp_traverse, unit_traverse},
    {Py_tp_clear, unit_clear},
    {Py_tp_dealloc, unit_dealloc},
    {0, NULL},
};

static PyType_Spec unit_spec = {
    .name = "dptc._C.Unit",
    .basicsize = sizeof(UnitObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = unit_slots,
};

int dptc_shard_module_exec(PyObject *module, dptc_module_state *st)
{
    st->unit_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &unit_spec, NULL);
    if (!st->unit_type)
        return -1;
    return PyModule_AddType(module, st->unit_type);
}

int dptc_shard_traverse(dptc_module_state *st, visitproc visit, void *arg)
{
    Py_VISIT(st->unit_type);
    return 0;
}

void dptc_shard_clear(dptc_module_state *st) { Py_CLEAR(st->unit_type); }
