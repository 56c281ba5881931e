"""Rank-side functions for tests/test_collectives.py and tests/scripts/two_node_collectives.py.

Every rank fills its inputs from (seed, case number, rank) and can therefore regenerate every
other rank's input: the expected result of each collective is computed locally, from the math,
never from another implementation.  Inputs are chosen so that the expected value is exact where
exactness is a fair demand:

    "small"    integers in [-8, 8] ([0, 59] for uint8): sums over <= 4 ranks are exact in
               every dtype, bf16 included;
    "round16"  bf16: k/64 with |k| <= 255, f16: k/1024 with |k| <= 2047: every input is exact in
               the 16-bit type, their float32 sum is exact, and that sum needs rounding back to
               16 bits, so the result shows how many times the implementation rounded;
    "round"    uniform floats in [-1, 1): sums are compared with a tolerance;
    "any"      values over the dtype's range (MAX/MIN);
    "bits"     "any" plus NaN, +-inf and -0.0 for floating dtypes, compared bit for bit (copies);
    "product"  factors in {+-0.5, +-1, +-2} ({1, 2, 3} for uint8): products are exact;
    "shifted"  one shared tensor of integers in [-8, 4], plus the rank: for the 64 MiB case,
               whose expected sum is then one multiply-add instead of world_size regenerations.

One call runs hundreds of cases and returns the failures as strings, so a test pays process
start-up once per world size.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import signal
import threading
import time

import torch

from tests._rank import load_impl, start_clock

__all__ = [
    "sweep", "run_sync_cases", "run_async_checks", "peer_killed", "mismatch", "bad_arguments",
    "bitwise", "make_input", "DTYPES", "FLOATING", "SIZES", "LARGE_COUNT",
]

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16,
          torch.int32, torch.int64, torch.uint8, torch.int8)
FLOATING = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
SIZES = (0, 1, 1023, 12345)
# A float32 count that spans several chunks of any chunked transport; once per collective.
MEDIUM_COUNT = 300_001
# float32 all_reduce SUM only: 17e6 * 4 bytes = 64.8 MiB, past 64 MiB.
LARGE_COUNT = 17_000_001

# Integer dtypes of the same width, to compare floating results bit for bit.
_BITS_VIEW = {
    torch.float32: torch.int32, torch.float64: torch.int64,
    torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8,
}
_MAX_REPORTED = 40


# ---------------------------------------------------------------------------------------------
# Inputs

def _generator(seed: int, case: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + case * 1009 + rank) % (2 ** 62))


def _pick(values, n, generator, dtype):
    choices = torch.tensor(values, dtype=torch.float64)
    return choices[torch.randint(0, len(values), (n,), generator=generator)].to(dtype)


def make_input(kind: str, dtype: torch.dtype, n: int, seed: int, case: int, rank: int):
    """The input of `rank` for case number `case`: the same on every process."""
    g = _generator(seed, case, rank)
    if kind == "small":
        low, high = (0, 60) if dtype == torch.uint8 else (-8, 9)
        return torch.randint(low, high, (n,), generator=g, dtype=dtype)
    if kind == "shifted":
        base = torch.randint(-8, 5, (n,), generator=_generator(seed, case, 0), dtype=dtype)
        return base.add_(rank)
    if kind == "round16":
        scale, bound = (64, 255) if dtype == torch.bfloat16 else (1024, 2047)
        ints = torch.randint(-bound, bound + 1, (n,), generator=g, dtype=torch.float64)
        return (ints / scale).to(dtype)
    if kind == "round":
        return (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    if kind == "product":
        if dtype == torch.uint8:
            return _pick([1, 2, 3], n, g, dtype)
        if dtype in FLOATING:
            return _pick([-2, -1, -0.5, 0.5, 1, 2], n, g, dtype)
        return _pick([-2, -1, 1, 2], n, g, dtype)
    if kind in ("any", "bits"):
        if dtype == torch.bool:
            return torch.randint(0, 2, (n,), generator=g).bool()
        if dtype in FLOATING:
            values = (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
            if kind == "bits" and n >= 4:
                values[:4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0]).to(dtype)
            return values
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)
    raise ValueError(f"unknown input kind {kind!r}")


def _garbage(dtype, n, rank):
    """Output buffers start as this, so a collective that forgets to write shows."""
    fill = True if dtype == torch.bool else 77 + rank
    return torch.full((n,), fill, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Expected values and comparison

def _reduce(op: str, inputs: list, dtype, kind: str):
    """(expected result, sum of |inputs| in float64 for tolerances) of reducing `inputs`."""
    if op == "SUM" and kind == "small":
        # Exact in the dtype itself by construction; no float64 copies of the larger cases.
        result = inputs[0].clone()
        for tensor in inputs[1:]:
            result += tensor
        return result, None
    if op in ("MAX", "MIN"):
        stacked = torch.stack(inputs)
        if dtype == torch.bool:
            return (stacked.any(0) if op == "MAX" else stacked.all(0)), None
        return (stacked.amax(0) if op == "MAX" else stacked.amin(0)), None
    wide = torch.float64 if dtype in FLOATING else torch.int64
    stacked = torch.stack([tensor.to(wide) for tensor in inputs])
    abs_sum = stacked.abs().sum(0).to(torch.float64)
    if op == "SUM":
        total = stacked.sum(0)
        if dtype in SIXTEEN_BIT:
            total = total.to(torch.float32)  # exact for "round16": then rounded once, below
        return total.to(dtype), abs_sum
    if op == "AVG":
        return (stacked.sum(0) / len(inputs)).to(dtype), abs_sum / len(inputs)
    if op == "PRODUCT":
        return stacked.prod(0).to(dtype), None
    raise ValueError(f"unknown reduce op {op!r}")


def _tolerance(op, kind, dtype, world_size, strict_16bit, abs_sum):
    """Per-element absolute tolerance (a float64 tensor), or None for exact equality.

    Summation error is bounded by (terms - 1) * eps * sum|x| plus half an ulp for the final
    rounding; the factors below are that bound with a little room.
    """
    if op in ("MAX", "MIN", "PRODUCT") or kind in ("small", "shifted"):
        return None
    eps = torch.finfo(dtype).eps
    if op == "SUM" and kind == "round16":
        # dptc accumulates 16-bit floats in float32 and rounds once: the result must equal the
        # float32 sum rounded to 16 bits exactly.  gloo may add in the 16-bit type, rounding
        # after every step, so for the torch reference (or across nodes, where a second
        # rounding happens by design) it gets one 16-bit rounding per rank.
        return None if strict_16bit else world_size * eps * abs_sum
    if op == "SUM":
        return world_size * eps * abs_sum
    if op == "AVG":
        return (world_size + 1) * eps * abs_sum
    raise ValueError(f"no tolerance for op {op!r}")


def _values(tensor):
    return tensor.to(torch.float64) if tensor.dtype != torch.bool else tensor.to(torch.int64)


def _compare(label: str, got, expected, *, mode: str, tolerance=None):
    """None if `got` matches; otherwise a line saying how it differs.

    mode "bits": identical bit patterns (copies); "exact": equal values; "close": within the
    per-element `tolerance`.
    """
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return (f"{label}: got dtype {got.dtype} shape {tuple(got.shape)}, expected "
                f"{expected.dtype} {tuple(expected.shape)}")
    if got.numel() == 0:
        return None
    view = _BITS_VIEW.get(got.dtype)
    if mode == "exact" and torch.equal(got, expected):
        return None  # fast path; NaN never reaches "exact" mode
    if mode == "bits" and (torch.equal(got.view(view), expected.view(view)) if view
                           else torch.equal(got, expected)):
        return None
    if mode == "bits":
        bad = (got.view(view) != expected.view(view)) if view else (got != expected)
    elif mode == "exact":
        bad = got != expected
    else:
        bad = ~((_values(got) - _values(expected)).abs() <= tolerance)
    count = int(bad.sum())
    if count == 0:
        return None
    index = int(bad.nonzero()[0])
    finite = bad & torch.isfinite(_values(expected)) & torch.isfinite(_values(got))
    diff = (_values(got) - _values(expected)).abs()
    nonzero = finite & (expected != 0)
    detail = ""
    if finite.any():
        detail += f"max abs diff {float(diff[finite].max()):.6g}, "
    if nonzero.any():
        rel = diff[nonzero] / _values(expected)[nonzero].abs()
        detail += f"max rel diff {float(rel.max()):.6g}, "
    allowed = (f" (allowed {float(tolerance[index]):.3g} there)"
               if tolerance is not None and mode == "close" else "")
    return (f"{label}: {count} of {got.numel()} elements differ ({mode}); {detail}first at "
            f"index {index}: got {got[index].item()!r}, expected {expected[index].item()!r}"
            f"{allowed}")


# ---------------------------------------------------------------------------------------------
# Cases

def _cases(world_size: int, sizes, large: bool):
    """Every synchronous case as (collective, arg, dtype, kind, n), in one order for all ranks."""
    cases = []
    for n in sizes:
        for dtype in DTYPES:
            cases.append(("all_reduce", "SUM", dtype, "small", n))
            if dtype in FLOATING:
                cases.append(("all_reduce", "SUM", dtype,
                              "round16" if dtype in SIXTEEN_BIT else "round", n))
                cases.append(("all_reduce", "AVG", dtype,
                              "round16" if dtype in SIXTEEN_BIT else "round", n))
            cases.append(("all_reduce", "PRODUCT", dtype, "product", n))
        for dtype in DTYPES + (torch.bool,):
            cases.append(("all_reduce", "MAX", dtype, "any", n))
            cases.append(("all_reduce", "MIN", dtype, "any", n))
            for src in range(world_size):
                cases.append(("broadcast", src, dtype, "bits", n))
            cases.append(("all_gather_into_tensor", None, dtype, "bits", n))
        for dtype in DTYPES:
            cases.append(("reduce_scatter_tensor", "SUM", dtype, "small", n))
            if dtype in FLOATING:
                kind = "round16" if dtype in SIXTEEN_BIT else "round"
                cases.append(("reduce_scatter_tensor", "SUM", dtype, kind, n))
                cases.append(("reduce_scatter_tensor", "AVG", dtype, kind, n))
    if large:
        cases.append(("all_reduce", "SUM", torch.float32, "small", MEDIUM_COUNT))
        cases.append(("all_reduce", "AVG", torch.float32, "round", MEDIUM_COUNT))
        cases.append(("broadcast", world_size - 1, torch.float32, "bits", MEDIUM_COUNT))
        cases.append(("all_gather_into_tensor", None, torch.float32, "bits", MEDIUM_COUNT))
        cases.append(("reduce_scatter_tensor", "SUM", torch.float32, "small", MEDIUM_COUNT))
        cases.append(("all_reduce", "SUM", torch.float32, "shifted", LARGE_COUNT))
    return cases


class _Runner:
    def __init__(self, api, seed, strict_16bit):
        self.api = api
        self.rank = api.get_rank()
        self.world_size = api.get_world_size()
        self.seed = seed
        self.strict_16bit = strict_16bit

    def inputs(self, case, kind, dtype, n):
        return [make_input(kind, dtype, n, self.seed, case, r) for r in range(self.world_size)]

    def run(self, case, collective, arg, dtype, kind, n):
        label = (f"{collective}({arg if arg is not None else ''}) dtype={str(dtype)[6:]} "
                 f"kind={kind} n={n} rank={self.rank}/{self.world_size}")
        return getattr(self, collective)(label, case, arg, dtype, kind, n)

    def all_reduce(self, label, case, op, dtype, kind, n):
        tensor = make_input(kind, dtype, n, self.seed, case, self.rank)
        address = tensor.data_ptr()
        self.api.all_reduce(tensor, op=getattr(self.api.ReduceOp, op))
        if tensor.data_ptr() != address:
            return f"{label}: the tensor's storage was replaced, not written in place"
        if kind == "shifted" and op == "SUM":
            # sum over r of (base + r) = world_size * base + world_size * (world_size - 1) / 2
            expected = make_input(kind, dtype, n, self.seed, case, 0)
            expected.mul_(self.world_size).add_(self.world_size * (self.world_size - 1) // 2)
            return _compare(label, tensor, expected, mode="exact")
        inputs = self.inputs(case, kind, dtype, n)
        expected, abs_sum = _reduce(op, inputs, dtype, kind)
        return self._check(label, tensor, expected, op, kind, dtype, abs_sum)

    def broadcast(self, label, case, src, dtype, kind, n):
        tensor = make_input(kind, dtype, n, self.seed, case, self.rank)
        self.api.broadcast(tensor, src)
        expected = make_input(kind, dtype, n, self.seed, case, src)
        return _compare(label, tensor, expected, mode="bits")

    def all_gather_into_tensor(self, label, case, _, dtype, kind, n):
        mine = make_input(kind, dtype, n, self.seed, case, self.rank)
        before = mine.clone()
        output = _garbage(dtype, n * self.world_size, self.rank)
        self.api.all_gather_into_tensor(output, mine)
        expected = torch.cat(self.inputs(case, kind, dtype, n))
        return (_compare(label, output, expected, mode="bits")
                or _compare(label + " (input changed)", mine, before, mode="bits"))

    def reduce_scatter_tensor(self, label, case, op, dtype, kind, n):
        mine = make_input(kind, dtype, n * self.world_size, self.seed, case, self.rank)
        before = mine.clone()
        output = _garbage(dtype, n, self.rank)
        self.api.reduce_scatter_tensor(output, mine, op=getattr(self.api.ReduceOp, op))
        inputs = [chunk[self.rank * n:(self.rank + 1) * n]
                  for chunk in self.inputs(case, kind, dtype, n * self.world_size)]
        expected, abs_sum = _reduce(op, inputs, dtype, kind)
        return (self._check(label, output, expected, op, kind, dtype, abs_sum)
                or _compare(label + " (input changed)", mine, before, mode="bits"))

    def _check(self, label, got, expected, op, kind, dtype, abs_sum):
        tolerance = _tolerance(op, kind, dtype, self.world_size, self.strict_16bit, abs_sum)
        if tolerance is None:
            return _compare(label, got, expected, mode="exact")
        return _compare(label, got, expected, mode="close", tolerance=tolerance)


def run_sync_cases(api, *, seed=0, sizes=SIZES, large=True, strict_16bit=None):
    """Runs every synchronous case; returns the failures (strings).

    An exception propagates (with the case in a note): the rank fails, and the harness stops the
    others, which may be waiting in a collective it will never issue.
    strict_16bit: demand the exactly-rounded 16-bit sum (default: for dptc only).
    """
    if strict_16bit is None:
        strict_16bit = api.name == "dptc"
    runner = _Runner(api, seed, strict_16bit)
    failures = []
    expected_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if (runner.rank, runner.world_size) != expected_rank:
        failures.append(f"get_rank(), get_world_size() = {runner.rank}, {runner.world_size}; "
                        f"the environment says {expected_rank}")
    suppressed = 0
    # Every rank runs every case whatever it finds: stopping early on one rank would leave the
    # others waiting in a collective.
    for case, (collective, arg, dtype, kind, n) in enumerate(_cases(runner.world_size, sizes,
                                                                     large)):
        try:
            problem = runner.run(case, collective, arg, dtype, kind, n)
        except Exception as error:
            error.add_note(f"in case {case}: {collective}({arg}) dtype={dtype} kind={kind} n={n}; "
                           f"{len(failures) + suppressed} failures before it: {failures[:5]}")
            raise
        if problem and len(failures) < _MAX_REPORTED:
            failures.append(problem)
        elif problem:
            suppressed += 1
    if suppressed:
        failures.append(f"... and {suppressed} more failures")
    failures.extend(_barrier_checks(api, runner.rank))
    return failures


def _barrier_checks(api, rank):
    """barrier() (and group=None explicitly) holds every rank until the last one arrives."""
    failures = []
    api.barrier()
    if rank == 0:
        time.sleep(0.5)
    started = time.monotonic()
    api.barrier(group=None)
    waited = time.monotonic() - started
    if rank != 0 and waited < 0.25:
        failures.append(f"barrier on rank {rank} returned after {waited:.3f} s although rank 0 "
                        f"arrived 0.5 s later")
    return failures


# ---------------------------------------------------------------------------------------------
# Async handles

def _check_handle(label, handle, failures):
    if handle is None:
        failures.append(f"{label}: async_op=True returned None, expected a work handle")
        return False
    return True


def run_async_checks(api, *, seed=0):
    """Async handles: back-to-back ops complete in order, wait() -> True, is_completed()."""
    rank, world_size = api.get_rank(), api.get_world_size()
    failures = []
    RO = api.ReduceOp
    # dptc runs a group's work in one ordered queue, so completion follows issue order and ops on
    # one tensor see each other's results.  gloo spreads async work over several threads: two
    # outstanding ops on one tensor race there (observed with torch 2.13), so the reference
    # skips the order checks.
    ordered = api.name != "torch"

    # 1. Several independent operations outstanding at once, waited for newest first.
    n = 1023
    inputs = {dt: [make_input("small", dt, n * world_size, seed, 10_000 + i, r)
                   for r in range(world_size)]
              for i, dt in enumerate((torch.float32, torch.bfloat16, torch.int64))}
    reduced = inputs[torch.float32][rank][:n].clone()
    reduced_bf16 = inputs[torch.bfloat16][rank][:n].clone()
    broadcasted = inputs[torch.int64][rank][:n].clone()
    gathered = _garbage(torch.float32, n * world_size, rank)
    scattered = _garbage(torch.bfloat16, n, rank)
    maxed = inputs[torch.int64][rank].clone()
    ops = [
        ("all_reduce(SUM) float32", lambda: api.all_reduce(reduced, op=RO.SUM, async_op=True)),
        ("broadcast(src=last) int64",
         lambda: api.broadcast(broadcasted, world_size - 1, async_op=True)),
        ("all_gather_into_tensor float32", lambda: api.all_gather_into_tensor(
            gathered, inputs[torch.float32][rank][:n], async_op=True)),
        ("barrier", lambda: api.barrier(async_op=True)),
        ("reduce_scatter_tensor(SUM) bfloat16", lambda: api.reduce_scatter_tensor(
            scattered, inputs[torch.bfloat16][rank], op=RO.SUM, async_op=True)),
        ("all_reduce(MAX) int64", lambda: api.all_reduce(maxed, op=RO.MAX, async_op=True)),
        ("all_reduce(SUM) bfloat16",
         lambda: api.all_reduce(reduced_bf16, op=RO.SUM, async_op=True)),
    ]
    handles = [(label, issue()) for label, issue in ops]
    if not all(_check_handle(label, handle, failures) for label, handle in handles):
        return failures
    for label, handle in reversed(handles):
        result = handle.wait()
        if result is not True:
            failures.append(f"async {label}: wait() returned {result!r}, expected True")
        if not handle.is_completed() and not _gloo_reduce_scatter_quirk(api, label):
            failures.append(f"async {label}: is_completed() is False after wait()")
        if ordered and handle is handles[-1][1]:
            unfinished = [name for name, earlier in handles[:-1] if not earlier.is_completed()]
            if unfinished:
                failures.append(f"async: after waiting for the last op, earlier ops {unfinished} "
                                f"are not completed (ops must complete in issue order)")
    if handles[-1][1].wait() is not True:
        failures.append("async: a second wait() on a completed handle did not return True")

    def column(dtype, count):
        return _reduce("SUM", [x[:count] for x in inputs[dtype]], dtype, "small")[0]

    full_i64 = _reduce("MAX", inputs[torch.int64], torch.int64, "any")[0]
    scatter_expected = _reduce("SUM", [x[rank * n:(rank + 1) * n]
                                       for x in inputs[torch.bfloat16]],
                               torch.bfloat16, "small")[0]
    for label, got, expected in (
            ("all_reduce(SUM) float32", reduced, column(torch.float32, n)),
            ("broadcast int64", broadcasted, inputs[torch.int64][world_size - 1][:n]),
            ("all_gather_into_tensor float32", gathered,
             torch.cat([x[:n] for x in inputs[torch.float32]])),
            ("reduce_scatter_tensor bfloat16", scattered, scatter_expected),
            ("all_reduce(MAX) int64", maxed, full_i64),
            ("all_reduce(SUM) bfloat16", reduced_bf16, column(torch.bfloat16, n))):
        problem = _compare(f"async {label} rank={rank}", got, expected, mode="exact")
        if problem:
            failures.append(problem)

    # 2. Operations on one tensor, issued back to back, run in issue order:
    #    SUM then PRODUCT gives (sum of (r+1))**world_size everywhere; any other order differs.
    if ordered:
        failures.extend(_chained_ops(api, rank, world_size))

    # 3. async_op=True returns before the collective can complete.
    api.barrier()
    if rank == 0:
        time.sleep(1.0)
    late = torch.full((3,), float(rank), dtype=torch.float32)
    started = time.monotonic()
    handle = api.all_reduce(late, op=RO.SUM, async_op=True)
    returned_after = time.monotonic() - started
    completed_early = handle is not None and handle.is_completed()
    if rank != 0 and returned_after > 0.5:
        failures.append(f"async all_reduce blocked for {returned_after:.2f} s on rank {rank} "
                        f"(rank 0 joined 1 s later); async_op=True must return at once")
    if rank != 0 and completed_early:
        failures.append(f"async all_reduce on rank {rank}: is_completed() was True before rank 0 "
                        f"had issued the collective")
    if _check_handle("late all_reduce", handle, failures):
        if handle.wait() is not True:
            failures.append("async late all_reduce: wait() did not return True")
        expected = float(world_size * (world_size - 1) // 2)
        if not torch.equal(late, torch.full((3,), expected)):
            failures.append(f"async late all_reduce gave {late.tolist()}, expected {expected}")
    return failures


def _gloo_reduce_scatter_quirk(api, label):
    """torch 2.13's gloo never sets is_completed() on a reduce_scatter_tensor handle, even
    after wait() returned True; that reference quirk is not held against the test."""
    return api.name == "torch" and label.startswith("reduce_scatter_tensor")


def _chained_ops(api, rank, world_size):
    """SUM, PRODUCT, broadcast on one tensor, outstanding together, take effect in that order."""
    RO = api.ReduceOp
    failures = []
    chain = torch.full((5,), float(rank + 1), dtype=torch.float64)
    first = api.all_reduce(chain, op=RO.SUM, async_op=True)
    second = api.all_reduce(chain, op=RO.PRODUCT, async_op=True)
    third = api.broadcast(chain, 0, async_op=True)
    if all(_check_handle("chained op", h, failures) for h in (first, second, third)):
        third.wait()
        for label, handle in (("first", first), ("second", second)):
            if not handle.is_completed():
                failures.append(f"async chain: the {label} op is not completed after the third "
                                f"one was waited for (ops must complete in issue order)")
        first.wait()
        second.wait()
        expected = float(world_size * (world_size + 1) // 2) ** world_size
        if not torch.equal(chain, torch.full((5,), expected, dtype=torch.float64)):
            failures.append(f"async chain SUM, PRODUCT, broadcast on one tensor gave "
                            f"{chain.tolist()} on rank {rank}, expected {expected} "
                            f"(ops ran out of order?)")

    return failures


def sweep(impl: str, seed: int = 0, large: bool = True, strict_16bit=None):
    """Every synchronous case, then the async checks; {"sync": [...], "async": [...]}."""
    api = load_impl(impl)
    result = {"sync": run_sync_cases(api, seed=seed, large=large, strict_16bit=strict_16bit)}
    result["async"] = run_async_checks(api, seed=seed)
    api.destroy_process_group()
    return result


# ---------------------------------------------------------------------------------------------
# Bitwise reductions (BAND, BOR, BXOR), and bool's other reductions, bit for bit against gloo

# The dtypes torch's gloo reduces bitwise (floating ones raise RuntimeError; int16 and the
# unsigned 16/32/64-bit types it refuses altogether, as dptc does).
BITWISE_DTYPES = (torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool)
BITWISE_OPS = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
# bool's arithmetic reductions, which gloo runs as logical ones (SUM and MAX or, MIN and
# PRODUCT and).  They are compared by value: gloo's all_reduce SUM leaves the byte 2 in a bool
# that two ranks set (torch 2.13: True + True stored unnormalised), where dptc stores 1.
BOOL_OPS = {"SUM": torch.logical_or, "MAX": torch.logical_or, "MIN": torch.logical_and,
            "PRODUCT": torch.logical_and}


def bitwise_sizes(dtype):
    """Element counts: odd ones (no multiple of a vector or of a staging round), one past the
    small all-reduce's 16 KiB, and one of 1.5 MiB and 7 elements, more than a staging slot
    (DEFAULT_SLOT_BYTES, 1 MiB), so that several rounds run."""
    return (1, 37, 12_345 // dtype.itemsize + 3, (3 << 19) // dtype.itemsize + 7)


def _bitwise_cases():
    cases = []
    for collective in ("all_reduce", "reduce_scatter_tensor"):
        for dtype in BITWISE_DTYPES:
            ops = list(BITWISE_OPS) + (list(BOOL_OPS) if dtype == torch.bool else [])
            for op in ops:
                for n in bitwise_sizes(dtype):
                    cases.append((collective, op, dtype, n))
    return cases


def _bitwise_input(dtype, n, seed, case, rank):
    """Random bytes (any bit pattern of the dtype), or random bools; the same on every rank."""
    g = _generator(seed, 20_000 + case, rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    return torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype)


def _digest(tensor):
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()[:20]


def bitwise(impl: str, seed: int = 0, shared: bool = False):
    """all_reduce and reduce_scatter_tensor with BAND, BOR, BXOR (and bool's SUM, MAX, MIN,
    PRODUCT) over every dtype gloo takes and bitwise_sizes(); each result is checked against
    torch.bitwise_* of every rank's regenerated input here, and its digest returned so the test
    can compare dptc's bytes with gloo's.  shared (dptc): each case runs a second time on
    tensors in shared buffers (ProcessGroup.empty_shared), the copy-free path DDP's buckets
    take.  Returns {"failures", "digests": {label: sha256 prefix}, "stagings"}."""
    api = load_impl(impl)
    rank, world_size = api.get_rank(), api.get_world_size()
    failures, digests = [], {}
    buffers = {}
    if shared:
        # One buffer per dtype, each case at its start: the same place on every rank.
        pg = api.module.group.default_group()
        for dtype in BITWISE_DTYPES:
            buffers[dtype] = pg.empty_shared(bitwise_sizes(dtype)[-1] * world_size, dtype)
    for case, (collective, op, dtype, n) in enumerate(_bitwise_cases()):
        total = n * world_size if collective == "reduce_scatter_tensor" else n
        inputs = [_bitwise_input(dtype, total, seed, case, r) for r in range(world_size)]
        combine = BITWISE_OPS.get(op) or BOOL_OPS[op]
        expected = functools.reduce(combine, inputs)
        if collective == "reduce_scatter_tensor":
            expected = expected[rank * n:(rank + 1) * n]
        places = ["plain"] + (["shared"] if shared else [])
        for place in places:
            label = f"{collective}({op}) dtype={str(dtype)[6:]} n={n}"
            where = f"{label} {place} rank={rank}/{world_size}"
            got = _run_bitwise(api, buffers.get(dtype), collective, op, inputs[rank], n, place)
            problem = None
            if op in BOOL_OPS:
                if impl == "dptc" and got.numel() and int(got.view(torch.uint8).max()) > 1:
                    problem = f"{where}: a bool holds the byte {int(got.view(torch.uint8).max())}"
                got = got.view(torch.uint8) != 0
            problem = problem or _compare(where, got, expected, mode="bits")
            if problem and len(failures) < _MAX_REPORTED:
                failures.append(problem)
            digests[f"{label} {place}"] = _digest(got)
    result = {"failures": failures, "digests": digests}
    if impl == "dptc":
        result["stagings"] = api.module.group.default_group().stagings()
        api.destroy_process_group()
    return result


def _run_bitwise(api, buffer, collective, op, mine, n, place):
    """The output of one collective on this rank's input `mine` (left unchanged), run on a
    copy of it: at the start of the shared `buffer` for place "shared"."""
    reduce_op = getattr(api.ReduceOp, op)
    if place == "shared":
        source = buffer[:mine.numel()]
        source.copy_(mine)
    else:
        source = mine.clone()
    if collective == "all_reduce":
        api.all_reduce(source, op=reduce_op)
        return source
    output = _garbage(mine.dtype, n, api.get_rank())
    api.reduce_scatter_tensor(output, source, op=reduce_op)
    if not torch.equal(source, mine):
        raise AssertionError(f"reduce_scatter_tensor({op}) of {mine.dtype} changed its input")
    return output


# ---------------------------------------------------------------------------------------------
# Failures (dptc only; each returns normally only if the implementation failed to raise)

def peer_killed(impl: str, victim: int, when: str):
    """`victim` dies by SIGKILL; every other rank must raise from its collective.

    when="before": the victim dies before issuing the collective the others are waiting in.
    when="during": all ranks loop over 4 MiB all_reduces and the victim dies 0.5 s in,
    mid-stream.  The clock ("elapsed") starts right before the collective that should fail.
    """
    api = load_impl(impl)
    rank = api.get_rank()
    api.all_reduce(torch.ones(16))  # every rank is up and the group is initialised
    if when == "before":
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        start_clock()
        api.all_reduce(torch.ones(1000))
    elif when == "during":
        tensor = torch.ones(1 << 20)
        if rank == victim:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        start_clock()
        for _ in range(1_000_000):
            api.all_reduce(tensor, op=api.ReduceOp.MAX)
    else:
        raise ValueError(f"when must be 'before' or 'during', got {when!r}")
    return "completed"


def mismatch(impl: str, kind: str):
    """Rank 0 and the others issue different collectives; every rank must raise.

    kind="count": all_reduce of 10 float32 on rank 0, of 11 on the others.
    kind="op": all_reduce of 10 float32 on rank 0, broadcast of 10 float32 on the others.
    """
    api = load_impl(impl)
    rank = api.get_rank()
    api.all_reduce(torch.ones(4))
    start_clock()
    if kind == "count":
        api.all_reduce(torch.ones(10 if rank == 0 else 11))
    elif kind == "op":
        if rank == 0:
            api.all_reduce(torch.ones(10))
        else:
            api.broadcast(torch.ones(10), 0)
    else:
        raise ValueError(f"kind must be 'count' or 'op', got {kind!r}")
    return "completed"


def bad_arguments(impl: str):
    """Every rank makes the same bad calls; each must raise TypeError/ValueError naming the
    argument (and the offending value) before any communication, leaving the group usable."""
    api = load_impl(impl)
    world_size = api.get_world_size()
    RO = api.ReduceOp
    n = 6
    x = torch.ones(n)
    cases = [
        # Non-contiguous tensors are taken, as torch's gloo takes them; integer AVG raises
        # torch's RuntimeError (tests/test_bad_input.py for both).
        # complex SUM and AVG are torch's (tests/test_bad_input.py); MAX is refused, as torch's.
        ("complex64 tensor, op=MAX", lambda: api.all_reduce(torch.ones(n, dtype=torch.complex64),
                                                           op=RO.MAX),
         [r"\btensor\b", r"complex64"]),
        ("not a tensor", lambda: api.all_reduce([1.0, 2.0]), [r"\btensor\b"]),
        ("all_gather_into_tensor output too large",
         lambda: api.all_gather_into_tensor(torch.empty(n * world_size + 1), x),
         [r"\boutput_tensor\b"]),
        ("all_gather_into_tensor output too small",
         lambda: api.all_gather_into_tensor(torch.empty(n), x), [r"\boutput_tensor\b"]),
        ("all_gather_into_tensor dtype mismatch",
         lambda: api.all_gather_into_tensor(torch.empty(n * world_size, dtype=torch.float64), x),
         [r"\b(output_tensor|input_tensor)\b"]),
        ("reduce_scatter_tensor output of wrong size",
         lambda: api.reduce_scatter_tensor(torch.empty(n + 1), torch.ones(n * world_size)),
         [r"\b(output|input)\b"]),
        ("reduce_scatter_tensor input not a multiple of the world size",
         lambda: api.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world_size + 1)),
         [r"\b(output|input)\b"]),
        ("broadcast src == world_size", lambda: api.broadcast(x.clone(), world_size),
         [r"\bsrc\b", rf"\b{world_size}\b"]),
        ("broadcast src < 0", lambda: api.broadcast(x.clone(), -1), [r"\bsrc\b", r"-1\b"]),
        ("meta tensor", lambda: api.all_reduce(torch.ones(n, device="meta")),
         [r"\btensor\b", r"meta", r"to_empty"]),
    ]
    if torch.cuda.is_available():
        cases.append(("cuda tensor mixed with cpu output", lambda: api.all_gather_into_tensor(
            torch.empty(n * world_size), x.cuda()), [r"\b(output_tensor|input_tensor)\b"]))
    failures = []
    for label, call, patterns in cases:
        try:
            call()
        except (TypeError, ValueError) as error:
            message = str(error)
            missing = [p for p in patterns if not re.search(p, message)]
            if missing:
                failures.append(f"{label}: {type(error).__name__} message {message!r} does not "
                                f"match {missing}")
        except Exception as error:  # noqa: BLE001
            failures.append(f"{label}: raised {type(error).__name__}: {error}; expected "
                            f"TypeError or ValueError")
        else:
            failures.append(f"{label}: no exception; expected TypeError or ValueError")
    # The group survived the bad calls: the ranks are still in step.
    check = torch.full((3,), float(api.get_rank() + 1))
    api.all_reduce(check)
    expected = float(world_size * (world_size + 1) // 2)
    if not torch.equal(check, torch.full((3,), expected)):
        failures.append(f"all_reduce after the bad calls gave {check.tolist()}, "
                        f"expected {expected}")
    api.destroy_process_group()
    return failures


# ---------------------------------------------------------------------------------------------
# AVG against torch's gloo, bit for bit (same process: gloo's default group and dptc's engine)

AVG_SIZES = (1, 1023, 300_001)


def _avg_input(kind, dtype, n, seed, case, rank):
    """"random": uniform in [-1, 1) (sums depend on the order of the additions); "exact":
    multiples of a power of two small enough that every partial sum over <= 4 ranks is exact in
    the dtype, whatever the order, while the division by the group size still rounds."""
    g = _generator(seed, 30_000 + case, rank)
    if kind == "random":
        return (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    bits = {torch.float32: 21, torch.float64: 50, torch.bfloat16: 6, torch.float16: 9}[dtype]
    ints = torch.randint(-(1 << bits) + 1, 1 << bits, (n,), generator=g, dtype=torch.int64)
    return (ints.to(torch.float64) * 2.0 ** -bits).to(dtype)


def _bits(tensor):
    return tensor.view(_BITS_VIEW[tensor.dtype])


def avg_against_gloo(seed: int):
    """all_reduce and reduce_scatter_tensor with AVG and SUM, through torch's gloo and through
    dptc in the same ranks, on float32, float64, bfloat16 and float16, "random" and "exact"
    inputs (see _avg_input) of AVG_SIZES elements; all_reduce also on a dptc shared buffer.
    Returns one record per case: element counts where dptc's AVG differs from gloo's AVG
    ("avg"), from dptc's own SUM divided by the group size in the dtype ("own"), and where
    dptc's SUM differs from gloo's ("sum") or gloo's AVG from gloo's SUM / n ("gloo_own"),
    the elements where the AVGs differ but the SUMs agree ("avg_not_sum"), and where dptc's
    AVG differs from its definition, ((x0 + x1) + ...) / n of every rank's regenerated input
    x, added and divided in float32 for the 16-bit dtypes and rounded once ("formula")."""
    import torch.distributed as dist
    load_impl("torch")
    import dptc
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dptc.group.default_group()
    shared = {dtype: group.empty_shared(max(AVG_SIZES), dtype) for dtype in FLOATING}
    records = []
    case = 0
    for dtype in FLOATING:
        for kind in ("random", "exact"):
            for n in AVG_SIZES:
                for collective in ("all_reduce", "reduce_scatter_tensor"):
                    places = ("plain", "shared") if collective == "all_reduce" else ("plain",)
                    total = n * world_size if collective == "reduce_scatter_tensor" else n
                    inputs = [_avg_input(kind, dtype, total, seed, case, r)
                              for r in range(world_size)]
                    mine = inputs[rank]
                    case += 1
                    out = {}
                    for impl, module in (("gloo", dist), ("dptc", dptc)):
                        for op in ("AVG", "SUM"):
                            for place in (places if impl == "dptc" else ("plain",)):
                                out[impl, op, place] = _run_avg_case(
                                    module, collective, getattr(dist.ReduceOp, op), mine, n,
                                    shared[dtype] if place == "shared" else None)
                    for place in places:
                        records.append(_avg_record(out, place, dtype, kind, n, collective,
                                                   _avg_formula(inputs, rank, n, collective)))
    return records


def _run_avg_case(module, collective, op, mine, n, shared):
    if collective == "all_reduce":
        if shared is not None:
            tensor = shared[:mine.numel()]
            tensor.copy_(mine)
        else:
            tensor = mine.clone()
        module.all_reduce(tensor, op=op)
        return tensor.clone()
    output = torch.zeros(n, dtype=mine.dtype)
    module.reduce_scatter_tensor(output, mine.clone(), op=op)
    return output


def _avg_formula(inputs, rank, n, collective):
    """dptc's AVG by definition: sources added in rank order, then divided by their number."""
    wide = torch.float32 if inputs[0].dtype in SIXTEEN_BIT else inputs[0].dtype
    total = inputs[0].to(wide)
    for tensor in inputs[1:]:
        total = total + tensor.to(wide)
    result = (total / len(inputs)).to(inputs[0].dtype)
    return result[rank * n:(rank + 1) * n] if collective == "reduce_scatter_tensor" else result


def _avg_record(out, place, dtype, kind, n, collective, formula):
    gloo_avg, gloo_sum = out["gloo", "AVG", "plain"], out["gloo", "SUM", "plain"]
    avg, total = out["dptc", "AVG", place], out["dptc", "SUM", place]
    avg_differs = _bits(avg) != _bits(gloo_avg)
    sum_differs = _bits(total) != _bits(gloo_sum)
    world_size = torch.distributed.get_world_size()
    return {"dtype": str(dtype)[6:], "kind": kind, "n": n, "collective": collective,
            "place": place,
            "avg": int(avg_differs.sum()),
            "own": int((_bits(avg) != _bits(total / world_size)).sum()),
            "sum": int(sum_differs.sum()),
            "gloo_own": int((_bits(gloo_avg) != _bits(gloo_sum / world_size)).sum()),
            "avg_not_sum": int((avg_differs & ~sum_differs).sum()),
            "formula": int((_bits(avg) != _bits(formula)).sum())}
