/* fake_cuda.c — a stand-in for NCCL and the CUDA runtime, for testing the
 * NCCL transport (csrc/nccl.c) on a machine without a GPU.  One library
 * serves as both (tests/test_nccl_transport.py points DPTC_NCCL_LIBRARY and
 * DPTC_CUDART_LIBRARY at it).
 *
 * "Device" memory is host memory and every stream runs its work at once, so
 * a communicator of one rank copies its input to its output.  Events
 * complete at once unless the test asks them to hang; the test reads what
 * the transport called through the fake_* functions (ctypes loads the same
 * file, so it shares these globals). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int hang;            /* events recorded while set complete only once it is cleared */
static int async_error;     /* what ncclCommGetAsyncError reports */
static volatile int init_blocks;   /* ncclCommInitRank waits while set (a missing member) */
static volatile int calls_block;   /* collectives wait inside NCCL while set, until an abort */
static int corrupt_gather;  /* the next all-gather's byte corrupt_at comes back changed */
static size_t corrupt_at;
#define PEER_BYTES 64
static unsigned char peer_bytes[PEER_BYTES];  /* a peer's part of uint8 MAX all-reduces */
static size_t peer_count;
static long calls_stream_wait, calls_abort, calls_destroy, calls_init;
/* A thread that never set a device: the real runtime makes device 0's
 * context current for it on its first call that needs one. */
static __thread int device_set;
static long calls_without_device;
#define NEEDS_DEVICE() (calls_without_device += !device_set)
#define RECORDS 4
static void *recorded_on[RECORDS];   /* the streams of the last event records, newest first */
static void *waited_on[RECORDS];     /* the streams of the last stream waits, newest first */

typedef struct { int held; } event;

void fake_set_hang(int on) { hang = on; }
void fake_set_async_error(int result) { async_error = result; }
void fake_set_init_blocks(int on) { init_blocks = on; }
void fake_set_calls_block(int on) { calls_block = on; }
void fake_set_corrupt_gather(int on) { corrupt_gather = on; corrupt_at = 0; }
void fake_set_corrupt_gather_at(int at) { corrupt_gather = 1; corrupt_at = (size_t)at; }
/* Until called again with n = 0, every uint8 MAX all-reduce of at least n
 * elements also takes the maximum with these n bytes, as if a peer had sent
 * them (DDP's used-parameter map). */
void fake_set_peer_max(const unsigned char *bytes, size_t n)
{
    peer_count = n < PEER_BYTES ? n : PEER_BYTES;
    memcpy(peer_bytes, bytes, peer_count);
}
long fake_stream_waits(void) { return calls_stream_wait; }
long fake_aborts(void) { return calls_abort; }
long fake_destroys(void) { return calls_destroy; }
long fake_inits(void) { return calls_init; }
long fake_calls_without_device(void) { return calls_without_device; }
void *fake_recorded_stream(int back)
{
    return back >= 0 && back < RECORDS ? recorded_on[back] : NULL;
}
void *fake_waited_stream(int back)
{
    return back >= 0 && back < RECORDS ? waited_on[back] : NULL;
}

/* ---- CUDA runtime ---- */
/* Frees what a create or alloc call made. */
static int release(void *p)
{
    NEEDS_DEVICE();
    free(p);
    return 0;
}
/* Puts stream first in a ring of the last RECORDS streams. */
static void remember(void *ring[RECORDS], void *stream)
{
    memmove(ring + 1, ring, (RECORDS - 1) * sizeof ring[0]);
    ring[0] = stream;
}
int cudaGetDeviceCount(int *n) { *n = 1; return 0; }
int cudaGetDevice(int *d) { *d = 0; return 0; }
int cudaSetDevice(int d)
{
    if (d != 0)
        return 101; /* cudaErrorInvalidDevice */
    device_set = 1;
    return 0;
}
int cudaStreamCreateWithPriority(void **s, unsigned flags, int priority)
{
    (void)flags, (void)priority;
    NEEDS_DEVICE();
    *s = malloc(1);
    return *s ? 0 : 2;
}
int cudaStreamDestroy(void *s) { return release(s); }
int cudaEventCreateWithFlags(void **e, unsigned flags)
{
    (void)flags;
    NEEDS_DEVICE();
    *e = calloc(1, sizeof(event));
    return *e ? 0 : 2;
}
int cudaEventRecord(void *e, void *stream)
{
    NEEDS_DEVICE();
    ((event *)e)->held = hang;
    remember(recorded_on, stream);
    return 0;
}
int cudaEventQuery(void *e)
{
    NEEDS_DEVICE();
    return ((event *)e)->held && hang ? 600 : 0;
}
int cudaEventSynchronize(void *e) { (void)e; return 0; }
int cudaStreamWaitEvent(void *s, void *e, unsigned flags)
{
    (void)e, (void)flags;
    NEEDS_DEVICE();
    calls_stream_wait++;
    remember(waited_on, s);
    return 0;
}
int cudaEventDestroy(void *e) { return release(e); }
const char *cudaGetErrorString(int e) { return e ? "fake CUDA error" : "no error"; }
int cudaMalloc(void **p, size_t bytes)
{
    NEEDS_DEVICE();
    *p = calloc(1, bytes ? bytes : 1);
    return *p ? 0 : 2;
}
int cudaFree(void *p) { return release(p); }
int cudaHostAlloc(void **p, size_t bytes, unsigned flags)
{
    (void)flags;
    NEEDS_DEVICE();
    *p = calloc(1, bytes ? bytes : 1);
    return *p ? 0 : 2;
}
int cudaFreeHost(void *p) { return release(p); }
int cudaMemcpyAsync(void *dst, const void *src, size_t bytes, int kind, void *stream)
{
    (void)kind, (void)stream;
    NEEDS_DEVICE();
    memmove(dst, src, bytes);
    return 0;
}
int cudaRuntimeGetVersion(int *v) { *v = 12080; return 0; }
int cudaDriverGetVersion(int *v) { *v = 12090; return 0; }

/* ---- NCCL: every rank's collectives complete on their own ---- *
 * A communicator of n ranks runs each rank's collectives alone: a rank's
 * all-gather writes its piece into every rank's place, so the order check's
 * records agree; the other collectives copy.  Right numbers need n = 1. */
typedef struct { char internal[128]; } unique_id;

static size_t element_size(int dtype)
{
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return dtype >= 0 && dtype < 10 ? sizes[dtype] : 0;
}

static int copy(const void *send, void *recv, size_t count, int dtype)
{
    size_t size = element_size(dtype);
    if (!size)
        return 4; /* ncclInvalidArgument */
    if (send != recv)
        memmove(recv, send, count * size);
    return 0;
}

int ncclGetVersion(int *v) { *v = 22703; return 0; }
int ncclGetUniqueId(unique_id *id) { memset(id->internal, 'F', sizeof id->internal); return 0; }
int ncclCommInitRank(void **comm, int nranks, unique_id id, int rank)
{
    calls_init++;
    while (init_blocks) {
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
    }
    if (nranks < 1 || rank < 0 || rank >= nranks || id.internal[0] != 'F')
        return 5; /* ncclInvalidUsage */
    int *ranks = malloc(sizeof *ranks);
    if (!ranks)
        return 2;
    *ranks = nranks;
    *comm = ranks;
    return 0;
}
/* As NCCL's abort flag ends the communicator's kernels early, what they held
 * completes. */
int ncclCommAbort(void *comm)
{
    NEEDS_DEVICE();   /* NCCL's abort and destroy switch devices from the current one */
    __atomic_add_fetch(&calls_abort, 1, __ATOMIC_SEQ_CST);
    hang = 0;
    free(comm);
    return 0;
}
int ncclCommDestroy(void *comm)
{
    NEEDS_DEVICE();
    calls_destroy++;
    free(comm);
    return 0;
}
int ncclCommGetAsyncError(void *comm, int *result) { (void)comm; *result = async_error; return 0; }
/* While calls_block is set a collective waits inside NCCL, as one whose
 * peers have not come to connect, until the communicator is aborted from
 * another thread; then it fails, as NCCL's do. */
static int wait_inside(void)
{
    long aborts = __atomic_load_n(&calls_abort, __ATOMIC_SEQ_CST);
    while (calls_block) {
        if (__atomic_load_n(&calls_abort, __ATOMIC_SEQ_CST) != aborts)
            return 5; /* ncclInvalidUsage */
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
    }
    return 0;
}

int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, void *c, void *st)
{
    (void)c, (void)st;
    if (wait_inside())
        return 5;
    int result = copy(s, r, n, dt);
    if (result == 0 && dt == 1 /* ncclUint8 */ && op == 2 /* ncclMax */ && n >= peer_count)
        for (size_t i = 0; i < peer_count; i++)
            if (peer_bytes[i] > ((unsigned char *)r)[i])
                ((unsigned char *)r)[i] = peer_bytes[i];
    return result;
}
int ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, void *c, void *st)
{
    (void)op, (void)c, (void)st;
    return copy(s, r, n, dt);
}
int ncclAllGather(const void *s, void *r, size_t n, int dt, void *c, void *st)
{
    (void)st;
    if (!c)
        return 4; /* ncclInvalidArgument, as NCCL answers a NULL communicator */
    if (wait_inside())
        return 5;
    int rc = 0;
    for (int k = 0; k < *(int *)c && rc == 0; k++)
        rc = copy(s, (char *)r + k * n * element_size(dt), n, dt);
    if (corrupt_gather && n * element_size(dt) > corrupt_at) {
        ((unsigned char *)r)[corrupt_at] ^= 0x5a;
        corrupt_gather = 0;
    }
    return rc;
}
int ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, void *c, void *st)
{
    (void)c, (void)st;
    return root == 0 ? copy(s, r, n, dt) : 4;
}
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
const char *ncclGetErrorString(int r) { return r == 6 ? "remote process exited or there was a "
                                                        "network error" : "fake NCCL error"; }
