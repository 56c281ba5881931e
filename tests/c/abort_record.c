/* abort_record.c — one abort of a one-rank shared-memory group, for
 * tests/test_abort_record.py, which runs this program under gdb and steps
 * the aborting rank through shm_abort one instruction at a time, reading the
 * segment's abort record after each (see [Note: abort record] in
 * csrc/shm.c).
 *
 * Built from this file, tests/c/no_bridge.c, csrc/engine.c, csrc/shm.c,
 * csrc/kernels.c and csrc/common.c with the extension's optimisation level.
 * Usage: abort_record REASON.  Aborts the group with REASON, checks that the
 * group reports it, and exits 0. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../../csrc/engine.h"
#include "../../csrc/shm.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s REASON\n", argv[0]);
        return 2;
    }
    char name[64];
    snprintf(name, sizeof name, "/dptc-abort-record-%d", (int)getpid());
    dptc_group_config cfg = {
        .rank = 0, .size = 1, .local_rank = 0, .local_size = 1, .node = 0, .nnodes = 1,
        .nstreams = 1, .shm_name = name, .create = 1, .slot_bytes = 65536, .timeout_s = 10.0,
    };
    dptc_group *g = NULL;
    dptc_error err;
    if (dptc_group_create(&dptc_shm_transport, &cfg, &g, &err) != DPTC_OK) {
        fprintf(stderr, "abort_record: creating the group failed: %s\n", err.message);
        return 1;
    }
    dptc_shm_unlink(dptc_group_transport(g));
    dptc_group_abort(g, argv[1]);
    dptc_status status = dptc_group_failure(g, &err);
    int ok = status == DPTC_ERR_ABORTED && strstr(err.message, argv[1]) != NULL;
    if (!ok)
        fprintf(stderr, "abort_record: the group reports %d: %s\n", (int)status, err.message);
    dptc_group_destroy(g);
    return ok ? 0 : 1;
}
