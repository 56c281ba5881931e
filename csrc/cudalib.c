/* cudalib.c — loads NCCL and the CUDA runtime with dlopen and resolves the
 * functions dptc calls; see [Note: loading NCCL and the CUDA runtime] in
 * cudalib.h.  No Python here: the NCCL transport calls it from any thread. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "cudalib.h"

/* dlsym returns an object pointer; POSIX guarantees that it converts to a
 * function pointer of the same size, which is how the table stores it. */
_Static_assert(sizeof(void *) == sizeof(void (*)(void)),
               "function pointers must have the size of void * (POSIX dlsym)");

/* One function of the table: its name and where its pointer lives. */
typedef struct {
    const char *name;
    size_t offset;      /* offsetof(dptc_cuda_api, name) */
    int optional;       /* a NULL pointer is fine (newer than what dptc requires) */
} symbol;

#define REQUIRED(fn) {#fn, offsetof(dptc_cuda_api, fn), 0}
#define OPTIONAL(fn) {#fn, offsetof(dptc_cuda_api, fn), 1}

static const symbol nccl_symbols[] = {
    REQUIRED(ncclGetVersion), REQUIRED(ncclGetUniqueId), REQUIRED(ncclCommInitRank),
    OPTIONAL(ncclCommInitRankConfig), REQUIRED(ncclCommAbort), REQUIRED(ncclCommDestroy),
    REQUIRED(ncclCommGetAsyncError), REQUIRED(ncclAllReduce), REQUIRED(ncclReduceScatter),
    REQUIRED(ncclAllGather), REQUIRED(ncclBroadcast), REQUIRED(ncclGroupStart),
    REQUIRED(ncclGroupEnd), REQUIRED(ncclGetErrorString),
};

static const symbol runtime_symbols[] = {
    REQUIRED(cudaGetDeviceCount), REQUIRED(cudaGetDevice), REQUIRED(cudaSetDevice),
    REQUIRED(cudaStreamCreateWithPriority), REQUIRED(cudaStreamDestroy),
    REQUIRED(cudaEventCreateWithFlags), REQUIRED(cudaEventRecord), REQUIRED(cudaEventQuery),
    REQUIRED(cudaEventSynchronize), REQUIRED(cudaStreamWaitEvent), REQUIRED(cudaEventDestroy),
    REQUIRED(cudaGetErrorString), REQUIRED(cudaMalloc), REQUIRED(cudaFree),
    REQUIRED(cudaHostAlloc), REQUIRED(cudaFreeHost), REQUIRED(cudaMemcpyAsync),
    REQUIRED(cudaRuntimeGetVersion), REQUIRED(cudaDriverGetVersion),
};

typedef struct {
    /* What it is, for messages. */
    const char *what;                /* "NCCL" */
    const char *remedy;              /* how to get a working copy */
    const symbol *symbols;
    size_t nsymbols;
    /* Asks the loaded library its version (fills report.version, and the
     * driver's for the runtime); a failure makes the load fail. */
    dptc_status (*probe)(const dptc_cuda_api *staged, dptc_library_report *report,
                         dptc_error *err);
    /* What happened; written once, under `lock`. */
    dptc_library_report report;
    void *handle;                    /* once loaded; never closed */
} library;

static dptc_status probe_nccl(const dptc_cuda_api *staged, dptc_library_report *report,
                              dptc_error *err);
static dptc_status probe_runtime(const dptc_cuda_api *staged, dptc_library_report *report,
                                 dptc_error *err);

#define COUNT(array) (sizeof(array) / sizeof((array)[0]))

/* The table every caller gets, and the libraries that fill it.  A library's
 * part of the table is written before its state becomes LOADED, under
 * `lock`, and never changes after. */
static dptc_cuda_api api;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static library libraries[] = {
    [DPTC_CUDA_NCCL] = {
        .what = "NCCL",
        .remedy = "install torch's CUDA build, which brings NCCL in the nvidia-nccl-cu12 wheel "
                  "(nvidia/nccl/lib/libnccl.so.2), or point DPTC_NCCL_LIBRARY at a libnccl.so.2",
        .symbols = nccl_symbols,
        .nsymbols = COUNT(nccl_symbols),
        .probe = probe_nccl,
    },
    [DPTC_CUDA_RUNTIME] = {
        .what = "the CUDA runtime",
        .remedy = "install torch's CUDA build, which brings the CUDA runtime in the "
                  "nvidia-cuda-runtime-cu12 wheel (nvidia/cuda_runtime/lib/libcudart.so.12), "
                  "or point DPTC_CUDART_LIBRARY at a libcudart.so",
        .symbols = runtime_symbols,
        .nsymbols = COUNT(runtime_symbols),
        .probe = probe_runtime,
    },
};

static dptc_status probe_nccl(const dptc_cuda_api *staged, dptc_library_report *report,
                              dptc_error *err)
{
    dptc_nccl_result result = staged->ncclGetVersion(&report->version);
    if (result != DPTC_NCCL_SUCCESS)
        return dptc_fail(err, DPTC_ERR_LIBRARY, "NCCL at '%s' does not work: ncclGetVersion "
                         "returned %d", report->path, result);
    return DPTC_OK;
}

static dptc_status probe_runtime(const dptc_cuda_api *staged, dptc_library_report *report,
                                 dptc_error *err)
{
    dptc_cuda_error result = staged->cudaRuntimeGetVersion(&report->version);
    if (result != DPTC_CUDA_SUCCESS)
        return dptc_fail(err, DPTC_ERR_LIBRARY, "the CUDA runtime at '%s' does not work: "
                         "cudaRuntimeGetVersion returned %d", report->path, result);
    /* No driver is not a loading failure: it shows when a device is used. */
    if (staged->cudaDriverGetVersion(&report->driver_version) != DPTC_CUDA_SUCCESS)
        report->driver_version = -1;
    return DPTC_OK;
}

/* Opens lib->report.path and resolves its symbols into `staged`; on
 * success, *handle holds the library.  A failure says what happened, and
 * library_load adds the remedy. */
static dptc_status library_resolve(library *lib, dptc_cuda_api *staged, void **handle,
                                   dptc_error *err)
{
    const char *path = lib->report.path;
    *handle = NULL;
    if (!path[0])
        return dptc_fail(err, DPTC_ERR_LIBRARY, "no file was given to load %s from", lib->what);
    dlerror();
    void *opened = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!opened) {
        const char *reason = dlerror();
        return dptc_fail(err, DPTC_ERR_LIBRARY, "dptc could not load %s from '%s' (%s)", lib->what,
                         path, reason ? reason : "dlopen failed");
    }
    for (size_t i = 0; i < lib->nsymbols; i++) {
        const symbol *s = &lib->symbols[i];
        dlerror();
        void *address = dlsym(opened, s->name);
        const char *reason = dlerror();
        if (!address && !s->optional) {
            dptc_status status = dptc_fail(
                err, DPTC_ERR_LIBRARY, "%s at '%s' lacks the function %s, which dptc calls (%s): "
                "the file is not %s, or too old a version", lib->what, path, s->name,
                reason ? reason : "dlsym returned NULL", lib->what);
            dlclose(opened);
            return status;
        }
        memcpy((char *)staged + s->offset, &address, sizeof address);
    }
    dptc_status status = lib->probe(staged, &lib->report, err);
    if (status != DPTC_OK) {
        dlclose(opened);
        return status;
    }
    *handle = opened;
    return DPTC_OK;
}

/* Loads lib from path unless it was tried before (then path is ignored and
 * the first outcome returned).  Holds `lock`. */
static dptc_status library_load(library *lib, const char *path)
{
    dptc_library_report *report = &lib->report;
    if (report->state == DPTC_LIBRARY_LOADED)
        return DPTC_OK;
    if (report->state == DPTC_LIBRARY_FAILED)
        return DPTC_ERR_LIBRARY;
    path = path ? path : "";
    snprintf(report->path, sizeof report->path, "%s", path);
    dptc_cuda_api staged = {0};
    dptc_status status = strlen(path) >= sizeof report->path
                             ? dptc_fail(&report->reason, DPTC_ERR_LIBRARY, "the path given for %s "
                                         "is %zu bytes long, more than %zu", lib->what,
                                         strlen(path), sizeof report->path - 1)
                             : library_resolve(lib, &staged, &lib->handle, &report->reason);
    if (status != DPTC_OK) {
        dptc_fail(&report->failure, status, "%s. To use CUDA tensors, %s.", report->reason.message,
                  lib->remedy);
        report->version = 0;
        report->driver_version = 0;
        report->state = DPTC_LIBRARY_FAILED;
        return status;
    }
    /* Only this library's part: the other's may be in use without the lock. */
    for (size_t i = 0; i < lib->nsymbols; i++)
        memcpy((char *)&api + lib->symbols[i].offset,
               (const char *)&staged + lib->symbols[i].offset, sizeof(void *));
    report->state = DPTC_LIBRARY_LOADED;
    return DPTC_OK;
}

dptc_status dptc_cuda_load(const char *nccl_path, const char *cudart_path,
                           const dptc_cuda_api **out, dptc_error *err)
{
    library *nccl = &libraries[DPTC_CUDA_NCCL], *runtime = &libraries[DPTC_CUDA_RUNTIME];
    *out = NULL;
    pthread_mutex_lock(&lock);
    dptc_status nccl_status = library_load(nccl, nccl_path);
    dptc_status runtime_status = library_load(runtime, cudart_path);
    dptc_status status = DPTC_OK;
    if (nccl_status != DPTC_OK && runtime_status != DPTC_OK)
        status = dptc_fail(err, DPTC_ERR_LIBRARY, "%s Also, %s", nccl->report.failure.message,
                           runtime->report.failure.message);
    else if (nccl_status != DPTC_OK)
        status = dptc_fail(err, DPTC_ERR_LIBRARY, "%s", nccl->report.failure.message);
    else if (runtime_status != DPTC_OK)
        status = dptc_fail(err, DPTC_ERR_LIBRARY, "%s", runtime->report.failure.message);
    pthread_mutex_unlock(&lock);
    if (status == DPTC_OK)
        *out = &api;
    return status;
}

void dptc_cuda_report(dptc_cuda_library which, dptc_library_report *out)
{
    pthread_mutex_lock(&lock);
    *out = libraries[which].report;
    pthread_mutex_unlock(&lock);
}

dptc_status dptc_cuda_device_count(int *count, dptc_error *err)
{
    *count = 0;
    pthread_mutex_lock(&lock);
    int loaded = libraries[DPTC_CUDA_RUNTIME].report.state == DPTC_LIBRARY_LOADED;
    pthread_mutex_unlock(&lock);
    if (!loaded)
        return dptc_fail(err, DPTC_ERR_LIBRARY, "the CUDA runtime is not loaded: dptc loads it "
                         "when a CUDA tensor first reaches it (dptc._cuda.load())");
    dptc_cuda_error result = api.cudaGetDeviceCount(count);
    if (result != DPTC_CUDA_SUCCESS) {
        const char *text = api.cudaGetErrorString(result);
        *count = 0;
        return dptc_fail(err, DPTC_ERR_CUDA, "cudaGetDeviceCount failed: %s (cudaError %d)",
                         text ? text : "unknown error", result);
    }
    return DPTC_OK;
}
