/* module.h — the extension module's state and the Python-facing helpers
 * shared by module.c (groups, work handles) and reducer.c (DDP). */
#ifndef DPTC_MODULE_H
#define DPTC_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cudalib.h"
#include "dptc.h"
#include "engine.h"

typedef struct {
    /* Types created from specs at module exec (heap types). */
    PyTypeObject *group_type;      /* dptc._C.Group */
    PyTypeObject *work_type;       /* dptc._C.Work */
    PyTypeObject *shared_type;     /* dptc._C.SharedBuffer */
    PyTypeObject *reducer_type;    /* dptc._C.Reducer (reducer.c) */
    PyTypeObject *hook_type;       /* dptc._C.GradHook (reducer.c) */
    PyTypeObject *unit_type;       /* dptc._C.Unit (unit.c) */
    /* Exceptions: DistError and its subclasses. */
    PyObject *dist_error;
    PyObject *timeout_error;
    PyObject *peer_lost_error;
    PyObject *mismatch_error;
    PyObject *cuda_library_error;  /* NCCL or the CUDA runtime cannot be loaded (cudalib.c) */
    /* torch's profiler, for ranges.c; NULL until dptc/_ranges.py calls set_profiler. */
    PyObject *profiler_flags;      /* dict holding the "a profiler records" flag */
    PyObject *profiler_flag;       /* the flag's key (interned str) */
    PyObject *range_open;          /* open_range(name) -> handle */
    PyObject *range_close;         /* close_range(handle) */
    /* NCCL works dropped before the device finished them, with the tensors
     * they keep alive; see [Note: dropped device work] in module.c. */
    struct dptc_retired *retired;
    size_t nretired, retired_capacity;
} dptc_module_state;

dptc_module_state *dptc_state(PyObject *module);
/* The module a heap type (or an instance's type) was created by. */
dptc_module_state *dptc_state_from_type(PyTypeObject *type);

/* The one function that turns an engine status into a Python exception.
 * Always returns NULL.  DPTC_ERR_PYTHON leaves the current exception if one
 * is set. */
PyObject *dptc_raise(dptc_module_state *st, dptc_status status,
                     const dptc_error *err);

/* Borrowed pointer to the engine group inside a dptc._C.Group, or NULL with
 * TypeError set (naming `argname`) when obj is not one / is closed. */
dptc_group *dptc_group_from_object(dptc_module_state *st, PyObject *obj,
                                   const char *argname);
/* dptc_group_abort with the GIL let go meanwhile (a device transport's
 * abort can wait a moment, see [Note: aborting under an issuer] in nccl.c),
 * holding a reference to g so that a close on another thread cannot free
 * it.  GIL held by the caller; a pending exception stays pending. */
void dptc_group_abort_released(dptc_group *g, const char *reason);
/* Whether a dptc._C.Group (checked by dptc_group_from_object) moves device
 * tensors through NCCL rather than CPU tensors through shared memory. */
int dptc_group_object_is_device(PyObject *obj);
/* A CUDA stream's handle from an object with `cuda_stream` (torch.cuda.Stream);
 * None is the legacy default stream.  0, or -1 with an exception. */
int dptc_cuda_stream_handle(PyObject *stream, void **out);


/* The cross-node step around a Python callable (bridge.c); exceptions the
 * callable raises are appended to the list `errors`, except instances of
 * `peer_lost` (dptc.PeerLostError), which fail with DPTC_ERR_PEER_LOST.
 * Returns NULL with an exception set on failure. */
struct dptc_bridge *dptc_bridge_new(PyObject *callable, PyObject *errors, PyObject *peer_lost);

/* Installs the Ctrl-C check of [Note: interrupts] (dptc.h) on this thread
 * for the length of a wait that can raise; unwatch restores the previous
 * one and returns the wait's status, made DPTC_ERR_INTERRUPTED (with its
 * message in err) when the check fired just as the work completed: every
 * caller then aborts and raises alike.  GIL held for both. */
typedef struct {
    dptc_interrupt_check check;
    void *arg;
} dptc_watch;
void dptc_watch_signals(dptc_watch *saved);
dptc_status dptc_unwatch_signals(const dptc_watch *saved, dptc_status status, dptc_error *err);

/* A tensor's data pointer and element count, asked of the tensor (see
 * [Note: tensors across the C boundary] in engine.h).  DPTC_ERR_PYTHON with
 * an exception set on failure; an int is refused (no raw addresses). */
dptc_status dptc_tensor_data(PyObject *tensor, void **out);
dptc_status dptc_tensor_numel(PyObject *tensor, size_t *out);

/* Keeps obj alive for good: memory that unfinished work may still touch
 * (see [Note: memory of unfinished work] in module.c).  GIL held. */
void dptc_leak(PyObject *obj);

/* Implemented by reducer.c: adds Reducer and GradHook to the module. */
int dptc_reducer_module_exec(PyObject *module, dptc_module_state *st);
int dptc_reducer_traverse(dptc_module_state *st, visitproc visit, void *arg);
void dptc_reducer_clear(dptc_module_state *st);

/* Implemented by cudalib_module.c: adds load_cuda, cuda_libraries and
 * cuda_device_count (see [Note: loading NCCL and the CUDA runtime]). */
int dptc_cudalib_module_exec(PyObject *module, dptc_module_state *st);
/* The loaded NCCL and CUDA runtime, or NULL with dptc.CudaLibraryError set
 * when they were not loaded (dptc/_cuda.py loads them first). */
const dptc_cuda_api *dptc_loaded_cuda(dptc_module_state *st);

/* Implemented by unit.c: adds Unit, FSDP's unit state machine. */
int dptc_shard_module_exec(PyObject *module, dptc_module_state *st);
int dptc_shard_traverse(dptc_module_state *st, visitproc visit, void *arg);
void dptc_shard_clear(dptc_module_state *st);

/* Implemented by ranges.c: named ranges in torch.profiler traces (see
 * [Note: profiler ranges] in dptc/_ranges.py); adds set_profiler.  GIL held
 * for all.  dptc_profiling (1 while a torch profiler records) is the only
 * one to call when no profiler records: it reads a flag and calls nothing. */
int dptc_ranges_module_exec(PyObject *module, dptc_module_state *st);
int dptc_ranges_traverse(dptc_module_state *st, visitproc visit, void *arg);
void dptc_ranges_clear(dptc_module_state *st);
int dptc_profiling(dptc_module_state *st);
/* Opens the range named by the PyUnicode_FromFormat `format`; *out receives
 * a new reference to its handle.  DPTC_ERR_PYTHON with an exception set on
 * failure. */
dptc_status dptc_range_open(dptc_module_state *st, PyObject **out, const char *format, ...);
/* Closes *range, if any, and clears it, on the thread that opened it.  With
 * an exception already set it keeps that one (a failure to close is written
 * as unraisable) and returns DPTC_OK; otherwise a failure is DPTC_ERR_PYTHON
 * with its exception set. */
dptc_status dptc_range_close(dptc_module_state *st, PyObject **range);

#endif /* DPTC_MODULE_H */
