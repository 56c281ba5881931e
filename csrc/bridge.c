/* bridge.c — the cross-node CPU step, handed to torch.distributed (gloo).
 *
 * dptc does not speak TCP itself: between nodes, the rank with local index
 * i talks to the ranks with local index i on the other nodes through a gloo
 * group that dptc/group.py built for that purpose.  The Python side wraps
 * this rank's staging slots in tensors once; each call names a byte range
 * of them, so no tensor is created from C.  The call takes the GIL; gloo
 * releases it while it waits on the network.
 */
#include "bridge.h"
#include "module.h"

struct dptc_bridge {
    /* callable(op, dtype, redop, offset, offset2, count, root) -> None moves
     * bytes; callable(DPTC_BRIDGE_CHECK, collective, dtype, redop, count, seq,
     * root, text) -> None, or a message naming the mismatch. */
    PyObject *callable;
    /* A list the exceptions the callable raised are appended to, so that the
     * rank raises the original exception (see group_raise in module.c). */
    PyObject *errors;
};

dptc_bridge *dptc_bridge_new(PyObject *callable, PyObject *errors)
{
    dptc_bridge *b = PyMem_RawCalloc(1, sizeof *b);
    if (!b) {
        PyErr_NoMemory();
        return NULL;
    }
    b->callable = Py_NewRef(callable);
    b->errors = Py_NewRef(errors);
    return b;
}

void dptc_bridge_free(dptc_bridge *b)
{
    if (!b)
        return;
    if (Py_IsInitialized()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_CLEAR(b->callable);
        Py_CLEAR(b->errors);
        PyGILState_Release(gil);
    }
    PyMem_RawFree(b);
}

/* Formats the pending Python exception into err, keeps it in b->errors and
 * clears it.  Returns DPTC_ERR_PYTHON. */
static dptc_status take_exception(dptc_bridge *b, dptc_error *err)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *type, *exc, *traceback;
    PyErr_Fetch(&type, &exc, &traceback);
    PyErr_NormalizeException(&type, &exc, &traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
#endif
    PyObject *text = exc ? PyObject_Str(exc) : NULL;
    const char *message = text ? PyUnicode_AsUTF8(text) : NULL;
    if (!message)
        PyErr_Clear();
    dptc_fail(err, DPTC_ERR_PYTHON, "the cross-node step (gloo) failed: %s: %s",
              exc ? Py_TYPE(exc)->tp_name : "error", message ? message : "(no message)");
    if (exc && PyList_Append(b->errors, exc) < 0)
        PyErr_Clear();
    Py_XDECREF(text);
    Py_XDECREF(exc);
    return DPTC_ERR_PYTHON;
}

dptc_status dptc_bridge_call(dptc_bridge *b, dptc_bridge_op op, dptc_dtype dtype,
                             dptc_redop redop, size_t offset, size_t offset2, size_t count,
                             int root, dptc_error *err)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    dptc_status status = DPTC_OK;
    PyObject *result = PyObject_CallFunction(b->callable, "iiinnni", (int)op, (int)dtype,
                                             (int)redop, (Py_ssize_t)offset, (Py_ssize_t)offset2,
                                             (Py_ssize_t)count, root);
    if (!result)
        status = take_exception(b, err);
    Py_XDECREF(result);
    PyGILState_Release(gil);
    return status;
}

dptc_status dptc_bridge_check(dptc_bridge *b, dptc_op op, dptc_dtype dtype, dptc_redop redop,
                              size_t count, uint64_t seq, int root, const char *text,
                              dptc_error *err)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    dptc_status status = DPTC_OK;
    PyObject *result = PyObject_CallFunction(b->callable, "iiiinKis", (int)DPTC_BRIDGE_CHECK,
                                             (int)op, (int)dtype, (int)redop, (Py_ssize_t)count,
                                             (unsigned long long)seq, root, text);
    if (!result) {
        status = take_exception(b, err);
    } else if (result != Py_None) {
        const char *message = PyUnicode_Check(result) ? PyUnicode_AsUTF8(result) : NULL;
        if (!message)
            PyErr_Clear();
        status = dptc_fail(err, DPTC_ERR_MISMATCH, "%s", message ? message : "collective mismatch");
    }
    Py_XDECREF(result);
    PyGILState_Release(gil);
    return status;
}
