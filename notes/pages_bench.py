#!/usr/bin/env python3
"""The cost of refilling a 3 MiB unsharded buffer, as each gather refills it, three ways (see
"What would close the first row" in notes/MEMORY.md):

- today's: the storage resized to 0 bytes at reshard and back before the gather (glibc hands
  the same heap chunk back);
- an anonymous mapping whose pages madvise(MADV_DONTNEED) drops at reshard (every page faults
  and is zeroed again);
- the same with MADV_FREE (pages reclaimed only when the kernel is short of memory).

    OMP_NUM_THREADS=1 python notes/pages_bench.py
"""

import ctypes
import mmap
import time

import torch

MADV_DONTNEED, MADV_FREE = 4, 8
NBYTES = 3 << 20
REFILLS = 200

libc = ctypes.CDLL(None)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
source = torch.randn(NBYTES // 4)


def per_refill(buffer, release):
    began = time.perf_counter()
    for _ in range(REFILLS):
        release()
        buffer.copy_(source)
    return (time.perf_counter() - began) / REFILLS * 1e6


def kept():
    buffer = torch.empty(NBYTES // 4)
    return per_refill(buffer, lambda: None)


def resized():
    buffer = torch.empty(NBYTES // 4)
    storage = buffer.untyped_storage()

    def release():
        storage.resize_(0)
        storage.resize_(NBYTES)
    return per_refill(buffer, release)


def advised(advice):
    mapping = mmap.mmap(-1, NBYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.float32)
    address = buffer.data_ptr()
    return per_refill(buffer, lambda: libc.madvise(address, NBYTES, advice))


if __name__ == "__main__":
    for _ in range(3):
        print(f"3 MiB refill: copy only {kept():.0f} us, resize_ {resized():.0f} us, "
              f"MADV_DONTNEED {advised(MADV_DONTNEED):.0f} us, "
              f"MADV_FREE {advised(MADV_FREE):.0f} us")
