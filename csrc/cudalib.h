/* cudalib.h — NCCL and the CUDA runtime, loaded at run time.
 *
 * [Note: loading NCCL and the CUDA runtime]
 * dptc builds and imports without CUDA: no CUDA or NCCL header is needed at
 * build time and no CUDA library is linked.  The first CUDA tensor that
 * reaches dptc loads both libraries with dlopen (RTLD_NOW | RTLD_LOCAL) and
 * resolves every function the NCCL transport calls into dptc_cuda_api.
 * Which files to load is Python's choice (dptc/_cuda.py: $DPTC_NCCL_LIBRARY
 * and $DPTC_CUDART_LIBRARY, the copies torch already loaded, the nvidia
 * wheels, the plain sonames); this file loads what it is given.
 *
 * Each library is loaded at most once per process, under a lock: the first
 * attempt decides the path, and its outcome is remembered, so later calls
 * return the same table or the same failure, whatever path they pass (one
 * NCCL per process).  A failure names the library, the path tried (or the
 * missing symbol and the library) and the remedy, with status
 * DPTC_ERR_LIBRARY (dptc.CudaLibraryError).  A library is never unloaded.
 *
 * The few types the table needs are declared here as what they are at the
 * ABI: handles are opaque pointers, enums are ints, ncclUniqueId is 128
 * bytes passed by value.
 */
#ifndef DPTC_CUDALIB_H
#define DPTC_CUDALIB_H

#include "dptc.h"

typedef int dptc_nccl_result;      /* ncclResult_t */
typedef int dptc_nccl_datatype;    /* ncclDataType_t */
typedef int dptc_nccl_redop;       /* ncclRedOp_t */
typedef int dptc_cuda_error;       /* cudaError_t */
typedef struct dptc_nccl_comm *dptc_nccl_comm;        /* ncclComm_t */
typedef struct dptc_cuda_stream *dptc_cuda_stream;    /* cudaStream_t */
typedef struct dptc_cuda_event *dptc_cuda_event;      /* cudaEvent_t */

#define DPTC_NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[DPTC_NCCL_UNIQUE_ID_BYTES];
} dptc_nccl_unique_id;                                 /* ncclUniqueId */

/* Values from NCCL's and CUDA's public headers that the transport uses. */
#define DPTC_NCCL_SUCCESS 0                  /* ncclSuccess */
#define DPTC_NCCL_IN_PROGRESS 7              /* ncclInProgress (non-blocking communicators) */
#define DPTC_CUDA_SUCCESS 0                  /* cudaSuccess */
#define DPTC_CUDA_ERROR_NOT_READY 600        /* cudaErrorNotReady (cudaEventQuery) */
#define DPTC_CUDA_STREAM_NON_BLOCKING 0x01u  /* cudaStreamNonBlocking */
#define DPTC_CUDA_EVENT_DISABLE_TIMING 0x02u /* cudaEventDisableTiming */
#define DPTC_CUDA_HOST_ALLOC_DEFAULT 0x00u   /* cudaHostAllocDefault */
#define DPTC_CUDA_MEMCPY_HOST_TO_DEVICE 1    /* cudaMemcpyHostToDevice */
#define DPTC_CUDA_MEMCPY_DEVICE_TO_HOST 2    /* cudaMemcpyDeviceToHost */

/* Every function dptc calls, named as the libraries name them.  Only
 * ncclCommInitRankConfig may be NULL (NCCL < 2.14); its config is an
 * ncclConfig_t, whose layout the transport declares when it uses it. */
typedef struct {
    /* NCCL */
    dptc_nccl_result (*ncclGetVersion)(int *version);
    dptc_nccl_result (*ncclGetUniqueId)(dptc_nccl_unique_id *id);
    dptc_nccl_result (*ncclCommInitRank)(dptc_nccl_comm *comm, int nranks, dptc_nccl_unique_id id,
                                         int rank);
    dptc_nccl_result (*ncclCommInitRankConfig)(dptc_nccl_comm *comm, int nranks,
                                               dptc_nccl_unique_id id, int rank, void *config);
    dptc_nccl_result (*ncclCommAbort)(dptc_nccl_comm comm);
    dptc_nccl_result (*ncclCommDestroy)(dptc_nccl_comm comm);
    dptc_nccl_result (*ncclCommGetAsyncError)(dptc_nccl_comm comm, dptc_nccl_result *async_error);
    dptc_nccl_result (*ncclAllReduce)(const void *send, void *recv, size_t count,
                                      dptc_nccl_datatype dtype, dptc_nccl_redop op,
                                      dptc_nccl_comm comm, dptc_cuda_stream stream);
    dptc_nccl_result (*ncclReduceScatter)(const void *send, void *recv, size_t recv_count,
                                          dptc_nccl_datatype dtype, dptc_nccl_redop op,
                                          dptc_nccl_comm comm, dptc_cuda_stream stream);
    dptc_nccl_result (*ncclAllGather)(const void *send, void *recv, size_t send_count,
                                      dptc_nccl_datatype dtype, dptc_nccl_comm comm,
                                      dptc_cuda_stream stream);
    dptc_nccl_result (*ncclBroadcast)(const void *send, void *recv, size_t count,
                                      dptc_nccl_datatype dtype, int root, dptc_nccl_comm comm,
                                      dptc_cuda_stream stream);
    dptc_nccl_result (*ncclGroupStart)(void);
    dptc_nccl_result (*ncclGroupEnd)(void);
    const char *(*ncclGetErrorString)(dptc_nccl_result result);

    /* CUDA runtime */
    dptc_cuda_error (*cudaGetDeviceCount)(int *count);
    dptc_cuda_error (*cudaGetDevice)(int *device);
    dptc_cuda_error (*cudaSetDevice)(int device);
    dptc_cuda_error (*cudaStreamCreateWithPriority)(dptc_cuda_stream *stream, unsigned flags,
                                                    int priority);
    dptc_cuda_error (*cudaStreamDestroy)(dptc_cuda_stream stream);
    dptc_cuda_error (*cudaEventCreateWithFlags)(dptc_cuda_event *event, unsigned flags);
    dptc_cuda_error (*cudaEventRecord)(dptc_cuda_event event, dptc_cuda_stream stream);
    dptc_cuda_error (*cudaEventQuery)(dptc_cuda_event event);
    dptc_cuda_error (*cudaEventSynchronize)(dptc_cuda_event event);
    dptc_cuda_error (*cudaStreamWaitEvent)(dptc_cuda_stream stream, dptc_cuda_event event,
                                           unsigned flags);
    dptc_cuda_error (*cudaEventDestroy)(dptc_cuda_event event);
    const char *(*cudaGetErrorString)(dptc_cuda_error error);
    dptc_cuda_error (*cudaMalloc)(void **pointer, size_t bytes);
    dptc_cuda_error (*cudaFree)(void *pointer);
    dptc_cuda_error (*cudaHostAlloc)(void **pointer, size_t bytes, unsigned flags);
    dptc_cuda_error (*cudaFreeHost)(void *pointer);
    dptc_cuda_error (*cudaMemcpyAsync)(void *dst, const void *src, size_t bytes, int kind,
                                       dptc_cuda_stream stream);
    dptc_cuda_error (*cudaRuntimeGetVersion)(int *version);
    dptc_cuda_error (*cudaDriverGetVersion)(int *version);
} dptc_cuda_api;

/* Loads NCCL from nccl_path and the CUDA runtime from cudart_path (each once
 * per process, see [Note: loading NCCL and the CUDA runtime]) and points
 * *out at the table, valid for the life of the process.  Thread-safe; may
 * block in dlopen, so call without the GIL.  DPTC_ERR_LIBRARY names every
 * library that failed. */
dptc_status dptc_cuda_load(const char *nccl_path, const char *cudart_path,
                           const dptc_cuda_api **out, dptc_error *err);

/* What happened to one library, for reports (dptc.info). */
typedef enum {
    DPTC_CUDA_NCCL = 0,
    DPTC_CUDA_RUNTIME = 1,
} dptc_cuda_library;

typedef enum {
    DPTC_LIBRARY_UNTRIED = 0,  /* no CUDA tensor has reached dptc yet */
    DPTC_LIBRARY_LOADED,       /* every required symbol resolved; the table's part is filled */
    DPTC_LIBRARY_FAILED,       /* dlopen or a dlsym failed; `failure` says which and why */
} dptc_library_state;

typedef struct {
    dptc_library_state state;
    char path[4096];           /* the path tried ("" while untried) */
    int version;               /* ncclGetVersion / cudaRuntimeGetVersion; 0 unless loaded */
    int driver_version;        /* cudaDriverGetVersion (runtime only); -1 when it failed */
    dptc_error reason;         /* when FAILED: what happened, naming the file or the function */
    dptc_error failure;        /* when FAILED: the reason and the remedy (the error raised) */
} dptc_library_report;

void dptc_cuda_report(dptc_cuda_library which, dptc_library_report *out);

/* cudaGetDeviceCount through the loaded runtime: DPTC_ERR_LIBRARY while it
 * is not loaded, DPTC_ERR_CUDA (count 0) when the call fails (no driver, no
 * device).  May initialise the driver: call without the GIL. */
dptc_status dptc_cuda_device_count(int *count, dptc_error *err);

#endif /* DPTC_CUDALIB_H */
