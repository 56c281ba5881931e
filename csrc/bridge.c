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
    /* dptc.PeerLostError: the callable raises it when a member on another
     * node failed (dptc/group.py _run_bridged); see take_exception. */
    PyObject *peer_lost;
};

dptc_bridge *dptc_bridge_new(PyObject *callable, PyObject *errors, PyObject *peer_lost)
{
    dptc_bridge *b = PyMem_RawCalloc(1, sizeof *b);
    if (!b) {
        PyErr_NoMemory();
        return NULL;
    }
    b->callable = Py_NewRef(callable);
    b->errors = Py_NewRef(errors);
    b->peer_lost = Py_NewRef(peer_lost);
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
        Py_CLEAR(b->peer_lost);
        PyGILState_Release(gil);
    }
    PyMem_RawFree(b);
}

/* Formats the pending Python exception into err and clears it.  A
 * PeerLostError (a member on another node failed) becomes
 * DPTC_ERR_PEER_LOST with its own message, so every path that raises for
 * the group's failure (a collective's wait, DDP's reducer, fully_shard's
 * units) raises PeerLostError for it, as for a peer lost on this node.
 * Any other exception is kept in b->errors, for the rank to raise the
 * original (group_raise in module.c), and is DPTC_ERR_PYTHON. */
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
    dptc_status status = DPTC_ERR_PYTHON;
    if (exc && PyObject_TypeCheck(exc, (PyTypeObject *)b->peer_lost)) {
        status = dptc_fail(err, DPTC_ERR_PEER_LOST, "%s",
                           message ? message : "a member on another node failed");
    } else {
        dptc_fail(err, DPTC_ERR_PYTHON, "the cross-node step (gloo) failed: %s: %s",
                  exc ? Py_TYPE(exc)->tp_name : "error", message ? message : "(no message)");
        if (exc && PyList_Append(b->errors, exc) < 0)
            PyErr_Clear();
    }
    Py_XDECREF(text);
    Py_XDECREF(exc);
    return status;
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
                              size_t count, uint64_t seq, int root, uint64_t pieces,
                              const char *text, dptc_error *err)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    dptc_status status = DPTC_OK;
    PyObject *result = PyObject_CallFunction(b->callable, "iiiinKisK", (int)DPTC_BRIDGE_CHECK,
                                             (int)op, (int)dtype, (int)redop, (Py_ssize_t)count,
                                             (unsigned long long)seq, root, text,
                                             (unsigned long long)pieces);
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
