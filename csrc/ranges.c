/* ranges.c — named ranges in torch.profiler traces, opened from C.
 *
 * The DDP reducer (reducer.c) and fully_shard's units (unit.c) open ranges
 * around the collectives they launch and the phases they run; the names and
 * what each range covers are in [Note: profiler ranges] (dptc/_ranges.py).
 * C knows nothing of torch: dptc/_ranges.py hands it, once, the dict that
 * holds torch's "a profiler records" flag and two Python functions that open
 * and close a range.  dptc_profiling reads the flag (one dict lookup, no
 * call) and is all that runs while no profiler records; the other functions
 * call Python and are used only after it returned 1.  The engine and its
 * transports never call any of them.  GIL held for every function here.
 */
#include <stdarg.h>

#include "module.h"

int dptc_profiling(dptc_module_state *st)
{
    if (!st || !st->profiler_flags)
        return 0;
    /* Borrowed; a str key never makes the lookup fail. */
    return PyDict_GetItemWithError(st->profiler_flags, st->profiler_flag) == Py_True;
}

dptc_status dptc_range_open(dptc_module_state *st, PyObject **out, const char *format, ...)
{
    *out = NULL;
    if (!st->range_open) {
        PyErr_SetString(PyExc_RuntimeError, "dptc: a profiler range was opened before "
                                            "dptc._ranges handed C its functions; import dptc");
        return DPTC_ERR_PYTHON;
    }
    va_list args;
    va_start(args, format);
    PyObject *name = PyUnicode_FromFormatV(format, args);
    va_end(args);
    if (!name)
        return DPTC_ERR_PYTHON;
    *out = PyObject_CallOneArg(st->range_open, name);
    Py_DECREF(name);
    return *out ? DPTC_OK : DPTC_ERR_PYTHON;
}

dptc_status dptc_range_close(dptc_module_state *st, PyObject **range)
{
    if (!*range)
        return DPTC_OK;
    PyObject *handle = *range;
    *range = NULL;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *done = st->range_close ? PyObject_CallOneArg(st->range_close, handle) : NULL;
    Py_DECREF(handle);  /* dropping a handle that was not closed ends its range too */
    if (!done && !st->range_close)
        PyErr_SetString(PyExc_RuntimeError, "dptc: a profiler range is open but C has no "
                                            "function to close it");
    int closed = done != NULL;
    Py_XDECREF(done);
    if (!type)
        return closed ? DPTC_OK : DPTC_ERR_PYTHON;
    /* The caller is already failing: its exception wins, this one is reported. */
    if (!closed)
        PyErr_WriteUnraisable(st->range_close ? st->range_close : Py_None);
    PyErr_Restore(type, value, traceback);
    return DPTC_OK;
}

PyDoc_STRVAR(set_profiler_doc,
"set_profiler(flags, flag_name, open_range, close_range)\n--\n\n"
"Called by dptc._ranges at import: flags[flag_name] is True while a torch\n"
"profiler records; open_range(name) -> handle and close_range(handle) open\n"
"and close a named range.  See [Note: profiler ranges] in dptc/_ranges.py.");

static PyObject *set_profiler(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyDict_Check(args[0]) || !PyUnicode_Check(args[1]) ||
        !PyCallable_Check(args[2]) || !PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "set_profiler(flags: dict, flag_name: str, "
                                         "open_range: callable, close_range: callable)");
        return NULL;
    }
    dptc_module_state *st = dptc_state(module);
    PyObject *flag = Py_NewRef(args[1]);
    PyUnicode_InternInPlace(&flag);
    Py_XSETREF(st->profiler_flags, Py_NewRef(args[0]));
    Py_XSETREF(st->profiler_flag, flag);
    Py_XSETREF(st->range_open, Py_NewRef(args[2]));
    Py_XSETREF(st->range_close, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

static PyMethodDef ranges_functions[] = {
    {"set_profiler", (PyCFunction)(void (*)(void))set_profiler, METH_FASTCALL, set_profiler_doc},
    {NULL, NULL, 0, NULL},
};

int dptc_ranges_module_exec(PyObject *module, dptc_module_state *Py_UNUSED(st))
{
    return PyModule_AddFunctions(module, ranges_functions);
}

int dptc_ranges_traverse(dptc_module_state *st, visitproc visit, void *arg)
{
    Py_VISIT(st->profiler_flags);
    Py_VISIT(st->profiler_flag);
    Py_VISIT(st->range_open);
    Py_VISIT(st->range_close);
    return 0;
}

void dptc_ranges_clear(dptc_module_state *st)
{
    Py_CLEAR(st->profiler_flags);
    Py_CLEAR(st->profiler_flag);
    Py_CLEAR(st->range_open);
    Py_CLEAR(st->range_close);
}
