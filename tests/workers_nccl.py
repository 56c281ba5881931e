"""Rank-side bodies of tests/test_nccl_transport.py's multi-rank test (run_ranks): dptc groups
whose NCCL engines run against tests/c/fake_cuda.c, chosen by DPTC_NCCL_LIBRARY."""

import ctypes
import os
import time

import torch


def peer_abort(delay_s: float):
    """Rank 1's collective never completes on its (fake) device; rank 0 aborts the group after
    `delay_s`.  Rank 1 returns what its wait raised and when, rank 0 nothing."""
    import dptc
    from dptc._dtypes import OP_ALL_REDUCE, dtype_code
    from dptc.group import default_group
    fake = ctypes.CDLL(os.environ["DPTC_NCCL_LIBRARY"])
    rank = dptc.get_rank()
    pg = default_group()
    engine = pg.device_engine(torch.device("cuda", 0))
    if rank == 0:
        time.sleep(delay_s)
        pg.abort("rank 0 gave up on purpose")
        time.sleep(1.0)                # the watcher publishes the failure
        return {}
    fake.fake_set_hang(1)
    x = torch.ones(4)
    work = engine.submit(OP_ALL_REDUCE, dtype_code(torch.float32), 0, x, x, 4, 0, 0, None)
    started = time.monotonic()
    try:
        work.synchronize()
        error = None
    except Exception as caught:  # noqa: BLE001 - reported to the test
        error = {"type": type(caught).__name__, "message": str(caught)}
    return {"error": error, "waited_s": time.monotonic() - started}
