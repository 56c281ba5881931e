/* cudalib_module.c — the Python face of cudalib.c: dptc._C.load_cuda,
 * cuda_libraries and cuda_device_count.  Which files to load is decided in
 * dptc/_cuda.py; see [Note: loading NCCL and the CUDA runtime] in cudalib.h. */
#include "cudalib.h"
#include "module.h"

/* Returns a new reference. */
static PyObject *message_text(const dptc_error *err)
{
    return PyUnicode_DecodeUTF8(err->message, (Py_ssize_t)strnlen(err->message,
                                                                  sizeof err->message),
                                "replace");
}

/* What happened to one library, as a dict.  Returns a new reference. */
static PyObject *report_dict(dptc_cuda_library which)
{
    dptc_library_report report;
    dptc_cuda_report(which, &report);
    static const char *states[] = {
        [DPTC_LIBRARY_UNTRIED] = "untried",
        [DPTC_LIBRARY_LOADED] = "loaded",
        [DPTC_LIBRARY_FAILED] = "failed",
    };
    int loaded = report.state == DPTC_LIBRARY_LOADED;
    int failed = report.state == DPTC_LIBRARY_FAILED;
    PyObject *result = Py_BuildValue(
        "{s:s, s:N, s:N, s:N, s:N}", "state", states[report.state],
        "path", report.state == DPTC_LIBRARY_UNTRIED ? Py_NewRef(Py_None)
                                                     : PyUnicode_DecodeFSDefault(report.path),
        "version", loaded ? PyLong_FromLong(report.version) : Py_NewRef(Py_None),
        "reason", failed ? message_text(&report.reason) : Py_NewRef(Py_None),
        "error", failed ? message_text(&report.failure) : Py_NewRef(Py_None));
    if (!result || which != DPTC_CUDA_RUNTIME)
        return result;
    PyObject *driver = loaded && report.driver_version >= 0
                           ? PyLong_FromLong(report.driver_version)
                           : Py_NewRef(Py_None);
    if (!driver || PyDict_SetItemString(result, "driver_version", driver) < 0) {
        Py_XDECREF(driver);
        Py_DECREF(result);
        return NULL;
    }
    Py_DECREF(driver);
    return result;
}

/* cuda_libraries() -> {"nccl": {...}, "cudart": {...}}: what loading found,
 * without loading anything. */
static PyObject *cuda_libraries(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("{s:N, s:N}", "nccl", report_dict(DPTC_CUDA_NCCL), "cudart",
                         report_dict(DPTC_CUDA_RUNTIME));
}

/* load_cuda(nccl_path, cudart_path) -> cuda_libraries(), or CudaLibraryError. */
static PyObject *load_cuda(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "load_cuda(nccl_path, cudart_path) takes 2 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    PyObject *nccl = NULL, *runtime = NULL;
    if (!PyUnicode_FSConverter(args[0], &nccl) || !PyUnicode_FSConverter(args[1], &runtime)) {
        Py_XDECREF(nccl);
        return NULL;
    }
    const dptc_cuda_api *api;
    dptc_error err;
    dptc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dptc_cuda_load(PyBytes_AS_STRING(nccl), PyBytes_AS_STRING(runtime), &api, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(nccl);
    Py_DECREF(runtime);
    if (status != DPTC_OK)
        return dptc_raise(dptc_state(module), status, &err);
    return cuda_libraries(module, NULL);
}

/* The loaded table, or NULL with dptc.CudaLibraryError set (load first). */
const dptc_cuda_api *dptc_loaded_cuda(dptc_module_state *st)
{
    const dptc_cuda_api *api;
    dptc_error err;
    dptc_status status = dptc_cuda_load(NULL, NULL, &api, &err);
    if (status != DPTC_OK) {
        dptc_raise(st, status, &err);
        return NULL;
    }
    return api;
}

/* nccl_unique_id() -> bytes: a new NCCL unique id, for a group's rank 0 to
 * share through the store. */
static PyObject *nccl_unique_id(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    const dptc_cuda_api *api = dptc_loaded_cuda(dptc_state(module));
    if (!api)
        return NULL;
    dptc_nccl_unique_id id;
    dptc_nccl_result rc;
    Py_BEGIN_ALLOW_THREADS
    rc = api->ncclGetUniqueId(&id);
    Py_END_ALLOW_THREADS
    if (rc != DPTC_NCCL_SUCCESS) {
        const char *text = api->ncclGetErrorString(rc);
        dptc_error err;
        dptc_fail(&err, DPTC_ERR_CUDA, "ncclGetUniqueId failed: %s (ncclResult %d)",
                  text ? text : "unknown error", rc);
        return dptc_raise(dptc_state(module), DPTC_ERR_CUDA, &err);
    }
    return PyBytes_FromStringAndSize(id.internal, sizeof id.internal);
}

/* cuda_device_count() -> int, through the loaded runtime's cudaGetDeviceCount. */
static PyObject *cuda_device_count(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    int count;
    dptc_error err;
    dptc_status status;
    Py_BEGIN_ALLOW_THREADS
    status = dptc_cuda_device_count(&count, &err);
    Py_END_ALLOW_THREADS
    if (status != DPTC_OK)
        return dptc_raise(dptc_state(module), status, &err);
    return PyLong_FromLong(count);
}

static PyMethodDef cudalib_functions[] = {
    {"load_cuda", (PyCFunction)(void (*)(void))load_cuda, METH_FASTCALL,
     "load_cuda(nccl_path, cudart_path) -> dict\n\n"
     "Loads NCCL and the CUDA runtime (once per process: the first call decides the files) and "
     "returns cuda_libraries(); raises dptc.CudaLibraryError naming the file, or the missing "
     "function, and the remedy."},
    {"cuda_libraries", cuda_libraries, METH_NOARGS,
     "cuda_libraries() -> dict\n\n"
     "For 'nccl' and 'cudart': state ('untried', 'loaded', 'failed'), path, version (NCCL's "
     "code, e.g. 22703; the runtime's, e.g. 12080), reason (what failed) and error (the "
     "message raised: the reason and the remedy); and the runtime's driver_version. "
     "Loads nothing."},
    {"nccl_unique_id", nccl_unique_id, METH_NOARGS,
     "nccl_unique_id() -> bytes\n\nA new NCCL unique id (NCCL must be loaded: load_cuda)."},
    {"cuda_device_count", cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int\n\n"
     "cudaGetDeviceCount through the loaded CUDA runtime; dptc.DistError when it fails."},
    {NULL, NULL, 0, NULL},
};

int dptc_cudalib_module_exec(PyObject *module, dptc_module_state *Py_UNUSED(st))
{
    return PyModule_AddFunctions(module, cudalib_functions);
}
