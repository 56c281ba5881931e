"""Collective bandwidth table in the manner of nccl-tests: dptc against torch's gloo.

Both implementations run in the same job, on the same ranks and the same buffers, one size at a
time, so the ratio column is the number to read; absolute times on a shared machine drift.

Definitions (those of nccl-tests, doc/PERFORMANCE.md), with n ranks and t the time of one call:

- size, count: bytes and elements of the *full* buffer of the operation.  For all_reduce and
  broadcast that is the buffer every rank holds.  For all_gather it is the gathered output
  (n times each rank's input); for reduce_scatter it is the input that is scattered (n times
  each rank's output).
- algbw = size / t, in GB/s with GB = 1e9 bytes.
- busbw = algbw * factor, the bandwidth a link would need if the algorithm were optimal, which
  makes the numbers comparable across operations and rank counts:
      all_reduce                   2 (n - 1) / n
      all_gather, reduce_scatter   (n - 1) / n
      broadcast                    1
- time is the median over the timed calls on each rank; the table shows the largest of the
  ranks' medians, so every rank reports the same row.
- ratio = dptc busbw / gloo busbw, which equals gloo time / dptc time.

Run it as ``python -m dptc.bench`` (it starts its own ranks through torch.distributed.run with
OMP_NUM_THREADS=1) or under an existing ``torchrun``.  ``--impl torch`` puts torch's gloo
functions, on a group of their own, in dptc's place: a check of the benchmark itself, whose
ratios should sit near 1.0.
"""

import argparse
import json
import math
import operator
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from functools import partial, reduce
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["main", "parse_size", "bus_factor", "run_under_torchrun", "Backend", "staging_line"]

MIB = 1 << 20

_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "int8": torch.int8, "bool": torch.bool,
}
_REDOPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG,
           "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
           "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
_FLOATING = ("float32", "float64", "bfloat16", "float16")
# The bitwise reductions (integer and bool dtypes only, as torch's gloo).
_BITWISE = {"band": operator.and_, "bor": operator.or_, "bxor": operator.xor}
_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")

# How long one implementation's warm-up runs per size; the timed calls aim at --seconds.
_WARMUP_SECONDS = 0.05
_MAX_WARMUP = 50
_MAX_ITERS = 100_000
# Timed calls are split into short rounds taken in turn, A B B A A B ..., so that the machine's
# bursts of load (other processes, both ranks landing on one core) fall on both implementations
# alike.  A round lasts about this long, or one call where a call is longer.
_ROUND_SECONDS = 0.025


# ---------------------------------------------------------------------------------------------
# Pure helpers (no process group)

def parse_size(text):
    """'8', '4K', '64M', '64MiB', '1G' -> bytes (binary multiples)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    if value and value[-1] in "KMG":
        scale = 1 << (10 * ("KMG".index(value[-1]) + 1))
        value = value[:-1]
    try:
        size = int(float(value) * scale)
    except ValueError:
        raise ValueError(f"size must look like 8, 4K, 64M or 1G, got {text!r}") from None
    if size <= 0:
        raise ValueError(f"size must be > 0, got {text!r}")
    return size


def bus_factor(op, nranks):
    """nccl-tests' busbw / algbw for op on nranks ranks."""
    if op == "all_reduce":
        return 2 * (nranks - 1) / nranks
    if op in ("all_gather", "reduce_scatter"):
        return (nranks - 1) / nranks
    if op == "broadcast":
        return 1.0
    raise ValueError(f"op must be one of {', '.join(_OPS)}, got {op!r}")


def full_count(op, size, element_size, nranks):
    """Elements of the full buffer for a nominal byte size; 0 if the size is too small.

    all_gather and reduce_scatter need a count that splits evenly across the ranks, so their
    count is rounded down to a multiple of nranks (the reported size follows the count).
    """
    count = size // element_size
    if op in ("all_gather", "reduce_scatter"):
        count -= count % nranks
    return count


def sizes_between(min_bytes, max_bytes):
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def format_bytes(size):
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


# ---------------------------------------------------------------------------------------------
# Launching

def without_nproc(argv):
    """argv less --nproc: the ranks do not need it, and torch.distributed.run would take it
    for an abbreviation of its own --nproc-per-node."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def run_under_torchrun(target, argv, nproc):
    """Start nproc ranks of target (['-m', module] or [script]) and return their exit status.

    Children get OMP_NUM_THREADS=1 and the repository root on PYTHONPATH.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *target, *without_nproc(argv)]
    process = subprocess.Popen(command, env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        # torchrun forwards SIGTERM to its workers; a SIGKILL would orphan them.
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        raise


def init_torch_distributed(timeout_s):
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def import_dptc():
    try:
        import dptc
        dptc.all_reduce  # noqa: B018 -- fails on a half-written package, not only a missing one
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"dptc is not importable ({error}); build it (pip install -e .), or "
                         f"pass --impl torch to check the benchmark with torch's gloo in dptc's "
                         f"place") from error
    return dptc


# ---------------------------------------------------------------------------------------------
# Implementations under test

@dataclass(frozen=True)
class Backend:
    """One implementation of the collectives, with torch.distributed's signatures."""
    label: str
    all_reduce: Callable
    broadcast: Callable
    all_gather_into_tensor: Callable
    reduce_scatter_tensor: Callable
    barrier: Callable
    empty: Callable = None  # (count, dtype) -> zeroed tensor; None: torch.zeros

    @classmethod
    def torch_gloo(cls, label, group=None):
        bound = {name: partial(getattr(dist, name), group=group)
                 for name in ("all_reduce", "broadcast", "all_gather_into_tensor",
                              "reduce_scatter_tensor", "barrier")}
        return cls(label=label, **bound)

    @classmethod
    def dptc(cls, module, label="dptc", empty=None):
        return cls(label=label, all_reduce=module.all_reduce, broadcast=module.broadcast,
                   all_gather_into_tensor=module.all_gather_into_tensor,
                   reduce_scatter_tensor=module.reduce_scatter_tensor, barrier=module.barrier,
                   empty=empty)


def make_backends(impl):
    """(test sides, gloo reference).  The test sides are dptc on ordinary tensors (staged
    through the shared segment) and dptc on shared buffers (ProcessGroup.empty_shared: the
    in-place all_reduce, the all_gather's output and the reduce_scatter's input need no
    staging), or gloo on a group of its own."""
    if impl == "dptc":
        dptc = import_dptc()
        group = dptc.init_process_group()
        tests = [Backend.dptc(dptc),
                 Backend.dptc(dptc, "dptc-shm", lambda count, dtype: group.empty_shared(count,
                                                                                     dtype))]
    else:
        tests = [Backend.torch_gloo("gloo*", dist.new_group(backend="gloo"))]
    return tests, Backend.torch_gloo("gloo")


# ---------------------------------------------------------------------------------------------
# One operation: buffers, the call, and a check of its result

def make_buffers(op, count, dtype, nranks, empty=None):
    """Zeroed buffers; the first is the one whose size the table reports (and the one `empty`
    allocates: a collective allocation for shared buffers, so every rank makes the same)."""
    empty = empty or (lambda n, dt: torch.zeros(n, dtype=dt))
    if op in ("all_gather", "reduce_scatter"):
        return empty(count, dtype), torch.zeros(count // nranks, dtype=dtype)
    return (empty(count, dtype),)


def issue(op, backend, buffers, redop):
    if op == "all_reduce":
        backend.all_reduce(buffers[0], op=redop)
    elif op == "broadcast":
        backend.broadcast(buffers[0], src=0)
    elif op == "all_gather":
        backend.all_gather_into_tensor(buffers[0], buffers[1])
    else:
        backend.reduce_scatter_tensor(buffers[1], buffers[0], op=redop)


def rank_value(rank, dtype):
    return rank % 2 == 0 if dtype is torch.bool else rank + 1


def reduced_value(values, redop_name, dtype):
    if redop_name in _BITWISE:
        combined = reduce(_BITWISE[redop_name], values)
        return bool(combined) if dtype is torch.bool else combined
    if dtype is torch.bool:
        return any(values) if redop_name in ("sum", "max") else all(values)
    if redop_name == "sum":
        return sum(values)
    if redop_name == "avg":
        return sum(values) / len(values)
    if redop_name == "product":
        return math.prod(values)
    return max(values) if redop_name == "max" else min(values)


def check(op, backend, buffers, redop_name, rank, nranks):
    """Runs op once on known values; returns the number of wrong elements on this rank.

    The output starts out different from the expected result everywhere, so an operation that
    leaves it alone is caught.
    """
    dtype = buffers[0].dtype
    values = [rank_value(r, dtype) for r in range(nranks)]
    reduced = reduced_value(values, redop_name, dtype)
    if op == "all_gather":
        source, out = buffers[1], buffers[0]
        expected = torch.tensor(values, dtype=dtype).repeat_interleave(source.numel())
    elif op == "reduce_scatter":
        source, out = buffers[0], buffers[1]
        expected = torch.full_like(out, reduced)
    else:
        source = out = buffers[0]
        expected = torch.full_like(out, values[0] if op == "broadcast" else reduced)
    out.copy_(expected.logical_not() if dtype is torch.bool else expected + 1)
    source.fill_(values[rank])  # in-place operations overwrite the poison here
    issue(op, backend, buffers, _REDOPS[redop_name])
    wrong = int((out != expected).sum())
    for buffer in buffers:
        buffer.zero_()
    return wrong


# ---------------------------------------------------------------------------------------------
# Timing

def time_calls(call, iterations):
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def agree_max(value):
    """Largest value over the ranks, through torch's default (gloo) group."""
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def plan_iterations(call, args):
    """Warms up, then returns how many timed calls fill about args.seconds (same on all ranks)."""
    first = agree_max(time_calls(call, 1)[0])
    warmup = args.warmup
    if warmup is None:
        warmup = min(_MAX_WARMUP, max(1, round(_WARMUP_SECONDS / max(first, 1e-9))))
    samples = time_calls(call, warmup) if warmup else [first]
    if args.iters is not None:
        return args.iters
    estimate = agree_max(statistics.median(samples))
    return int(min(_MAX_ITERS, max(args.min_iters, math.ceil(args.seconds / max(estimate, 1e-9)))))


@dataclass
class Measurement:
    time_us: float
    algbw: float
    busbw: float
    iters: int
    wrong: int


def measure(op, count, dtype, backends, args, rank, nranks):
    """Times op at one size for every backend; returns {label: Measurement}."""
    buffers = {backend.label: make_buffers(op, count, dtype, nranks, backend.empty)
               for backend in backends}
    redop = _REDOPS[args.redop]
    size = count * torch.empty((), dtype=dtype).element_size()
    plans, wrong = {}, {}
    for backend in backends:
        backend.barrier()
        wrong[backend.label] = 0 if args.no_check else check(
            op, backend, buffers[backend.label], args.redop, rank, nranks)
        call = partial(issue, op, backend, buffers[backend.label], redop)
        plans[backend.label] = (call, plan_iterations(call, args))

    fewest = min(iterations for _, iterations in plans.values())
    rounds = max(1, min(fewest, math.ceil(args.seconds / _ROUND_SECONDS)))
    samples = {backend.label: [] for backend in backends}
    for round_index in range(rounds):
        order = backends if round_index % 2 == 0 else backends[::-1]
        for backend in order:
            call, iterations = plans[backend.label]
            backend.barrier()
            samples[backend.label] += time_calls(call, math.ceil(iterations / rounds))

    results = {}
    for backend in backends:
        seconds = agree_max(statistics.median(samples[backend.label]))
        algbw = size / seconds / 1e9
        results[backend.label] = Measurement(
            time_us=seconds * 1e6, algbw=algbw, busbw=algbw * bus_factor(op, nranks),
            iters=len(samples[backend.label]), wrong=int(agree_max(wrong[backend.label])))
    return results


# ---------------------------------------------------------------------------------------------
# Table

def table_header(labels, ratios):
    group = "".join(f"{'-' * 9} {label:^9} {'-' * 9}  " for label in labels)
    columns = "".join(f"{'time(us)':>9} {'algbw':>9} {'busbw':>9}  " for _ in labels)
    units = "".join(f"{'':>9} {'(GB/s)':>9} {'(GB/s)':>9}  " for _ in labels)
    lead = f"{'size(B)':>12} {'count':>11} {'dtype':>9} {'op':>15}  "
    names = "".join(f"{name:>10}" for name in ratios)
    return [f"#{'':{len(lead) - 1}}{group}",
            f"#{lead[1:]}{columns}{names}",
            f"#{'':{len(lead) - 1}}{units}"]


def table_row(row, labels, ratios):
    text = f"{row['size']:>12} {row['count']:>11} {row['dtype']:>9} {row['op']:>15}  "
    for label in labels:
        m = row[label]
        text += f"{m['time_us']:>9.1f} {m['algbw']:>9.3f} {m['busbw']:>9.3f}  "
    text += "".join(f"{row[name]:>10.2f}" for name in ratios)
    wrong = [label for label in labels if row[label]["wrong"]]
    if wrong:
        text += "  WRONG: " + ", ".join(f"{label} ({row[label]['wrong']} elements)"
                                        for label in wrong)
    return text


def summary(rows, test_label, shared_label=None):
    """The two target lines: 64 MiB all_reduce busbw and 8 B all_reduce latency."""
    def find(size):
        candidates = [r for r in rows if r["op"] == "all_reduce" and r["size"] == size]
        preferred = [r for r in candidates if r["dtype"] == "float32"]
        return (preferred or candidates or [None])[0]

    lines = []
    row = find(64 * MIB)
    if row is None:
        lines.append("64 MiB all_reduce busbw: not measured (needs all_reduce in --ops and "
                     "--max-bytes >= 64M)")
    else:
        lines.append(f"64 MiB all_reduce busbw: {test_label} {row[test_label]['busbw']:.2f} GB/s, "
                     f"gloo {row['gloo']['busbw']:.2f} GB/s, ratio {row['ratio']:.2f} "
                     f"(target >= 3)")
        if shared_label:
            lines.append(f"64 MiB all_reduce busbw on a shared buffer: {shared_label} "
                         f"{row[shared_label]['busbw']:.2f} GB/s, ratio "
                         f"{row['ratio_shared']:.2f}")
    row = find(8)
    if row is None:
        lines.append("8 B all_reduce latency: not measured (needs all_reduce in --ops and "
                     "--min-bytes <= 8)")
    else:
        lines.append(f"8 B all_reduce latency: {test_label} {row[test_label]['time_us']:.1f} us, "
                     + (f"{shared_label} {row[shared_label]['time_us']:.1f} us, "
                        if shared_label else "")
                     + f"gloo {row['gloo']['time_us']:.1f} us (target < 20 us)")
    return lines


# ---------------------------------------------------------------------------------------------
# Entry point

def staging_line(group):
    """How the group's staged collectives on stream 0 were staged (local rank 0 times both
    ways and chooses, see [Note: staging] in csrc/shm.c)."""
    counts = group.stagings(0)
    ran = [f"{op} {c['cached']} cached, {c['streamed']} streamed"
           for op, c in counts.items() if c["cached"] + c["streamed"]]
    return "# dptc's staged collectives: " + ("; ".join(ran) or "none")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m dptc.bench",
        description="nccl-tests style bandwidth table of dptc against torch's gloo")
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to start when not already under torchrun (default 2)")
    parser.add_argument("--ops", default="all_reduce",
                        help=f"comma-separated, from {', '.join(_OPS)}, or 'all' "
                             f"(default all_reduce)")
    parser.add_argument("--dtype", default="float32",
                        help=f"comma-separated, from {', '.join(_DTYPES)} (default float32)")
    parser.add_argument("--redop", default="sum", choices=sorted(_REDOPS),
                        help="reduction of all_reduce and reduce_scatter (default sum)")
    parser.add_argument("--min-bytes", type=parse_size, default=8, help="default 8")
    parser.add_argument("--max-bytes", type=parse_size, default=256 * MIB, help="default 256M")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls per size and implementation (default: enough for "
                             "--seconds, at least --min-iters)")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed calls per size and implementation (default: about "
                             f"{_WARMUP_SECONDS} s worth, 1 to {_MAX_WARMUP})")
    parser.add_argument("--seconds", type=float, default=0.5,
                        help="target timed seconds per size and implementation (default 0.5)")
    parser.add_argument("--min-iters", type=int, default=5, help="default 5")
    parser.add_argument("--impl", default="dptc", choices=("dptc", "torch"),
                        help="what runs on dptc's side: dptc, or torch's gloo on a group of "
                             "its own, to check the benchmark (ratios near 1.0)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the one checked call per size and implementation")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--timeout", type=float, default=600,
                        help="torch.distributed init timeout in seconds (default 600)")
    args = parser.parse_args(argv)

    ops = _OPS if args.ops == "all" else tuple(o.strip() for o in args.ops.split(","))
    for op in ops:
        if op not in _OPS:
            parser.error(f"--ops: {op!r} is not one of {', '.join(_OPS)} (or 'all')")
    dtypes = tuple(d.strip() for d in args.dtype.split(","))
    for name in dtypes:
        if name not in _DTYPES:
            parser.error(f"--dtype: {name!r} is not one of {', '.join(_DTYPES)}")
    if args.redop == "avg" and any(name not in _FLOATING for name in dtypes):
        parser.error(f"--redop avg needs floating dtypes ({', '.join(_FLOATING)}), got "
                     f"--dtype {args.dtype}")
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes ({args.min_bytes}) must be <= --max-bytes ({args.max_bytes})")
    for name in ("iters", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "iters" else 0):
            parser.error(f"--{name} must be >= {1 if name == 'iters' else 0}, got {value}")
    if args.min_iters < 1 or args.seconds <= 0:
        parser.error("--min-iters must be >= 1 and --seconds > 0")
    args.ops, args.dtypes = ops, dtypes
    return args


def main(argv=None, target=("-m", "dptc.bench")):
    """Runs the table; outside torchrun, starts args.nproc ranks that run target
    (see run_under_torchrun), which must call main again."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        if args.impl == "dptc":
            import_dptc()  # fail here, once, rather than on every rank
        return run_under_torchrun(list(target), argv, args.nproc)

    # torch 2.13 suggests reduce_scatter_single; the table keeps the name dptc mirrors.
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")
    init_torch_distributed(args.timeout)
    rank, nranks = dist.get_rank(), dist.get_world_size()
    tests, reference = make_backends(args.impl)
    test = tests[0]
    shared = tests[1] if len(tests) > 1 else None
    backends = [*tests, reference]
    labels = [b.label for b in backends]
    ratios = ["ratio"] + (["ratio-shm"] if shared else [])
    say = partial(print, flush=True) if rank == 0 else (lambda *a, **k: None)

    say(f"# dptc.bench: {nranks} ranks, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, redop {args.redop}, "
        f"~{args.seconds} s of timed calls per size and implementation"
        + (f", {args.iters} iterations" if args.iters else ""))
    if args.impl == "torch":
        say("# gloo*: torch.distributed gloo on a group of its own, standing in for dptc "
            "(--impl torch); ratios should be near 1.0")
    say("# time: max over ranks of the median call; algbw = size / time; busbw = algbw x "
        "2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter), 1 (broadcast)")
    if shared:
        say("# dptc: ordinary tensors, staged through the shared segment; dptc-shm: tensors in "
            "shared buffers (ProcessGroup.empty_shared), as DDP's buckets are; ratio = dptc "
            "busbw / gloo busbw, ratio-shm = dptc-shm busbw / gloo busbw")
    for line in table_header(labels, ratios):
        say(line)

    rows = []
    for op in args.ops:
        for dtype_name in args.dtypes:
            dtype = _DTYPES[dtype_name]
            element_size = torch.empty((), dtype=dtype).element_size()
            for nominal in sizes_between(args.min_bytes, args.max_bytes):
                count = full_count(op, nominal, element_size, nranks)
                if count == 0:
                    continue
                results = measure(op, count, dtype, backends, args, rank, nranks)
                row = {"size": count * element_size, "count": count, "dtype": dtype_name,
                       "op": op, "redop": args.redop, "nranks": nranks}
                for label, m in results.items():
                    row[label] = vars(m)
                row["ratio"] = results[test.label].busbw / results[reference.label].busbw
                if shared:
                    row["ratio_shared"] = (results[shared.label].busbw
                                           / results[reference.label].busbw)
                rows.append(row)
                say(table_row(row, labels, [r.replace("-shm", "_shared") for r in ratios]))

    for line in summary(rows, test.label, shared.label if shared else None):
        say(line)
    if args.impl == "dptc":
        say(staging_line(import_dptc().group.default_group()))
    if rank == 0 and args.json:
        meta = {"nranks": nranks, "impl": args.impl, "test_label": test.label,
                "torch": torch.__version__, "redop": args.redop, "seconds": args.seconds}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if any(row[label]["wrong"] for row in rows for label in labels):
        say("# some results were WRONG; see the rows marked above")
        status = 1
    else:
        status = 0
    dist.barrier()
    if args.impl == "dptc":
        import_dptc().destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
