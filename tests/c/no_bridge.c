/* no_bridge.c — the cross-node bridge for C test programs of one-node
 * groups (tests/c/test_engine.c, tests/c/abort_record.c), which never reach
 * it: bridge.c needs Python. */
#include "../../csrc/shm.h"

dptc_status dptc_bridge_call(dptc_bridge *b, dptc_bridge_op op, dptc_dtype dtype,
                             dptc_redop redop, size_t offset, size_t offset2, size_t count,
                             int root, dptc_error *err)
{
    (void)b, (void)op, (void)dtype, (void)redop, (void)offset, (void)offset2, (void)count,
        (void)root;
    return dptc_fail(err, DPTC_ERR_INVALID, "a one-node test group called the bridge");
}

dptc_status dptc_bridge_check(dptc_bridge *b, dptc_op op, dptc_dtype dtype, dptc_redop redop,
                              size_t count, uint64_t seq, int root, uint64_t pieces,
                              const char *text, dptc_error *err)
{
    (void)b, (void)op, (void)dtype, (void)redop, (void)count, (void)seq, (void)root, (void)pieces,
        (void)text;
    return dptc_fail(err, DPTC_ERR_INVALID, "a one-node test group checked the bridge");
}

void dptc_bridge_free(dptc_bridge *b) { (void)b; }
