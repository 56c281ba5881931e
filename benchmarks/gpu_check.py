"""The one prepared check for a machine with one GPU (issue 8 §3): dptc against torch on CUDA.

    python benchmarks/gpu_check.py             # each section in its own torchrun process
    torchrun --standalone --nproc_per_node=1 benchmarks/gpu_check.py   # all in this process
    python benchmarks/gpu_check.py --rehearse  # the same on CPU with a tiny model (see below)

It finishes within --deadline (270 s), prints a fixed-width table last and writes the same rows
as JSON to $OUT/gpu_check.json (./gpu_check.json without $OUT), with each section's log in
$OUT/gpu_check_logs/ (five files in all: the device tool brings back at most eight).  Every
section records rows (check, outcome, detail, numbers) and has its own time budget; one that
fails, crashes or hangs costs only its own rows.  Outcomes:

    ok         checked and right (and any performance target met)
    FAIL       an exception (type and first line), a wrong value, or a hang cut at the budget
    NOT BUILT  dptc said its CUDA path does not exist yet: NotImplementedError, or the
               "transport is not built yet" / "... for now" errors it raises for CUDA tensors
    MISS       right results, but a performance target below was missed
    SKIP       not run: no CUDA device (the detail says why), or no time left

Sections:

1. env          torch, CUDA and NCCL versions, the GPU, and `python -m dptc.info --json`
                (kept whole in the JSON).
2. collectives  dptc's collectives on CUDA tensors at world size 1, one row per dtype dptc
                communicates: all_reduce and reduce_scatter_tensor with SUM, AVG (floating
                types only, as dptc/_dtypes.py rules), MAX, MIN and PRODUCT, broadcast,
                all_gather_into_tensor and all_gather_into_tensors; blocking and async_op;
                on the default stream and on a side stream made current; 7 and 2^20 + 3
                elements.  Each output is compared exactly with what world size 1 must give
                (its input).  Inputs are written on the current stream behind a short GPU
                sleep just before the call, the input's memory is handed back to the caching
                allocator and scribbled over right after it, and outputs are read on the
                current stream after it (after wait() for async_op): a collective that does
                not order itself after the current stream, does not keep its input alive, or a
                wait() that does not make the current stream wait, shows as a mismatch.  Then
                a barrier row, and a 256 MiB all_reduce timed with dptc and torch's NCCL for
                information (world size 1: algbw; busbw is 0 by definition).
3. ddp          examples/gpt.py's GPT (vocab 32768, d_model 1024, 12 layers, 16 heads, ctx 512,
                185 M parameters; batch 16, bf16 autocast over float32 parameters, AdamW; by
                estimate 20 to 40 ms a step on an H200): the unwrapped model, torch's DDP on
                NCCL and dptc's DDP, one after another from the same initial weights on the
                same batches, after a warm-up pass that pays the GPU's first-use costs.  Per
                implementation (5 warm-up steps, 20 timed): median step time (synchronised
                around each step) and torch.cuda.max_memory_allocated (reset before each, with
                only that implementation alive); parameters after the steps against the
                unwrapped model's.  Then dptc's DDP once more with find_unused_parameters=True
                (its used map all-reduced on the device), against the same two.
4. fsdp         fully_shard on each block then the root, MixedPrecisionPolicy(param_dtype=
                bfloat16, reduce_dtype=float32), same model: torch's fully_shard on NCCL, then
                dptc's; parameters against torch's, step time and peak memory as ratios.
                Then dptc's again with backward and the optimizer step on a side stream made
                current (forward on the default stream), parameters against torch's: the
                end-of-backward waits must order that stream after the reduce-scatters.
5. drill        a communicator timeout must become an exception, not a hang: a dptc group with
                a 1 s timeout (dptc.new_group(timeout=)), a collective issued behind a GPU
                stall of 12 s (torch.cuda._sleep on the current stream); a dptc.DistError
                (DistTimeoutError expected) must be raised within timeout + 4 s, by the call,
                work.is_completed(), work.wait(), or the group's next collective.

Parameters "within tolerance" means ||p - p_ref|| / ||p_ref - p_initial|| <= --rtol (0.02):
the two runs' updates agree to 2%; bf16 rounding and non-deterministic kernels (atomics in
attention's backward) move them apart by far less, while a gradient read before backward
wrote it or left out of a bucket moves them by its whole size.  The max |p - p_ref| is
reported too.

Targets on one GPU (a missed one makes the row MISS): dptc's DDP step within 2% of the
unwrapped model's and no slower than torch DDP's; dptc's fully_shard step no slower than
torch's, with peak memory no higher.  Ratios come from one run each: on a GPU step medians
move by well under 1% between runs, so read a miss by a fraction of a percent as noise.

Without the torchrun environment the script is the launcher: it checks for CUDA (none: every
GPU section is a SKIP row and it exits 0 within seconds), then starts each section with
`python -m torch.distributed.run --standalone --nproc_per_node=1`, kills its process tree at
the section's budget or the overall deadline (a section's log holds every thread's stack, dumped
a few seconds before), and keeps the rows the section wrote before.  Under torchrun directly the
sections run in that one process, in order, and a section past its budget ends the run with the
table.  The exit status is 1 when a row FAILs, else 0.

--rehearse runs the collectives, ddp and fsdp sections on CPU (torch on gloo, a tiny model) to
check this script's own logic on a machine without a GPU; its numbers mean nothing.
"""

import argparse
import contextlib
import copy
import faulthandler
import functools
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from _checkout import ROOT, extension_built, put_checkout_on_path

put_checkout_on_path()

from examples.gpt import GPT, build_gpt  # noqa: E402

DEADLINE_S = 270.0
# Each GPU section's own limit; a launched section is killed there.
BUDGETS_S = {"collectives": 60.0, "ddp": 75.0, "fsdp": 75.0, "drill": 50.0}
GPU_SECTIONS = tuple(BUDGETS_S)
INFO_TIMEOUT_S = 30.0
# Kept back from the deadline for stopping a section's processes and printing the table.
RESERVE_S = 10.0
# A section is not started with less than this left: it could not even set up NCCL.
MIN_SECTION_S = 15.0
# The stack dump comes this long before a section's budget runs out.
DUMP_BEFORE_S = 8.0
# How long a signalled process tree gets to exit before the next, harsher signal.
KILL_WAIT_S = 5.0
# How much of a failed section's log its FAIL row carries into the JSON.
LOG_TAIL_CHARS = 6000
# dptc's own timeout in the sections: a wait stuck in dptc then raises before the budget kills.
SECTION_DPTC_TIMEOUT_S = "20"

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64,
          torch.uint8, torch.int8, torch.bool)
FLOATING = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
REDUCE_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")
# A few elements (a tail no vector width divides) and a megabyte-scale count with such a tail.
COUNTS = (7, (1 << 20) + 3)
# GPU time the input of a checked collective is written behind (see written_late).
LATE_WRITE_S = 1e-4
LEARNING_RATE = 3e-4
MIXED_PRECISION = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}

# The drill: group timeout and slack (seconds); the GPU stall lasts well past both.
DRILL_SLACK_S = 4.0
DRILL_STALL_S = 12.0
POLL_S = 0.02

# Phrases of the errors dptc raises for CUDA tensors before its NCCL transport exists
# (dptc/_cuda.py, dptc/fsdp/_fully_shard.py): a path not built is not a failure.
NOT_BUILT_MARKERS = ("not built yet", "for now")
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                    "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
# --rehearse: a model and sizes a CPU runs in seconds.
REHEARSAL = {"vocab": 256, "d_model": 64, "layers": 2, "heads": 4, "ctx": 32, "batch": 2,
             "warmup": 2, "steps": 3, "bandwidth_mib": 4}
NAME_WIDTH = 24
OUTCOME_WIDTH = 10
DETAIL_WIDTH = 110
MIB = 1 << 20


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(GPU_SECTIONS),
                        help=f"comma-separated subset of {','.join(GPU_SECTIONS)} (env always "
                             f"runs)")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S,
                        help=f"seconds for the whole run (default {DEADLINE_S:.0f})")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per implementation")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--rtol", type=float, default=0.02,
                        help="parameter tolerance, relative to the update (default 0.02)")
    parser.add_argument("--bandwidth-mib", type=int, default=256,
                        help="all_reduce size of the bandwidth row (default 256)")
    parser.add_argument("--drill-timeout", type=float, default=1.0,
                        help="timeout of the drill's group, seconds (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rehearse", action="store_true",
                        help="run the sections on CPU with a tiny model, to check this script")
    # Internal: one section's process, started by launch_section.
    parser.add_argument("--section", choices=GPU_SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rehearse:
        parser.set_defaults(**REHEARSAL)        # explicit options still win
        args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for section in args.sections:
        if section not in GPU_SECTIONS:
            parser.error(f"--sections: unknown {section!r}; choose from {','.join(GPU_SECTIONS)}")
    return args


# ---------------------------------------------------------------------------------------------
# Rows

def make_row(section, name, outcome, detail="", **numbers):
    return {"section": section, "name": name, "outcome": outcome, "detail": detail,
            "numbers": numbers}


def first_line(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def is_not_built(error):
    return isinstance(error, NotImplementedError) or any(
        marker in str(error) for marker in NOT_BUILT_MARKERS)


def error_row(section, name, error):
    row = make_row(section, name, "NOT BUILT" if is_not_built(error) else "FAIL",
                   first_line(error))
    row["traceback"] = "".join(traceback.format_exception(error))[-3000:]
    return row


class Rows:
    """The rows of one process, in order.  With a path, every row and every "running" marker
    is also appended to a JSON-lines file as it happens, so that the launcher keeps them when
    it has to kill this process; with echo, each row is printed as it comes."""

    def __init__(self, path=None, echo=False):
        self.rows = []
        self.current = None           # what is running: named in a FAIL row if it never ends
        self.started = time.monotonic()
        self._echo = echo
        self._file = open(path, "a") if path else None

    def _write(self, record):
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def running(self, name):
        self.current = name
        self._write({"running": name})

    def add(self, row):
        self.rows.append(row)
        self.current = None
        self._write({"row": row})
        if self._echo:
            print(f"[{time.monotonic() - self.started:6.1f} s] {row['name']}: {row['outcome']} "
                  f"{shorten(row['detail'], DETAIL_WIDTH)}", flush=True)

    def note(self, **fields):
        self._write(fields)


def attempt(rows, section, name, work):
    """work() (never None), or None with a NOT BUILT or FAIL row for name when it raises."""
    rows.running(name)
    try:
        return work()
    except Exception as error:  # noqa: BLE001 - every failure becomes a row
        rows.add(error_row(section, name, error))
        return None


def shorten(text, width):
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


# ---------------------------------------------------------------------------------------------
# The device as the sections use it

class Device:
    """The accelerator.  With cuda=False (--rehearse) each call does its CPU counterpart, so
    the sections' own logic runs on a machine without a GPU."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.type = "cuda" if cuda else "cpu"
        self.torch_device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.backend = "nccl" if cuda else "gloo"
        self.device_ids = [0] if cuda else None
        self._cycles_per_s = None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        """Frees what earlier runs left and starts a new peak from what is alive now."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self):
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def sleep(self, seconds):
        """Holds the current stream for about `seconds` of GPU time (nothing on CPU)."""
        if self.cuda:
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_second())))

    def cycles_per_second(self):
        # torch.cuda._sleep counts clock cycles; measure how many make a second on this GPU.
        if self._cycles_per_s is None:
            cycles = 100_000_000
            torch.cuda._sleep(1000)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_s = cycles / (start.elapsed_time(end) / 1e3)
        return self._cycles_per_s

    def streams(self):
        """(label, context factory): the default stream and, on CUDA, a side stream made
        current, where a collective must follow torch.cuda.current_stream() too."""
        pairs = [("default", contextlib.nullcontext)]
        if self.cuda:
            side = torch.cuda.Stream()
            pairs.append(("side", lambda: torch.cuda.stream(side)))
        return pairs


def init_torch_group(device):
    """torch.distributed's default group on the device's backend (NCCL on a GPU), made before
    dptc's, which then reuses its store (dptc/group.py)."""
    if device.cuda:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        extra = {"device_id": device.torch_device} if device.cuda else {}
        dist.init_process_group(device.backend, timeout=timedelta(seconds=60), **extra)


def seconds_per_call(call, device, iterations=10, warmup=3):
    for _ in range(warmup):
        call()
    device.sync()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    device.sync()
    return (time.perf_counter() - start) / iterations


# ---------------------------------------------------------------------------------------------
# Section 1: environment

def no_cuda_reason():
    """Why the GPU sections cannot run here, or None when they can."""
    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        return f"no CUDA device: torch.cuda.is_available() is False{where}"
    return None


def torch_nccl_version():
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def gpu_numbers():
    if no_cuda_reason() is not None:
        return {"devices": 0, "gpu": None, "gpu_memory_gib": None}
    properties = torch.cuda.get_device_properties(0)
    return {"devices": torch.cuda.device_count(), "gpu": properties.name,
            "gpu_memory_gib": round(properties.total_memory / (1 << 30), 1)}


def dptc_info(timeout):
    """`python -m dptc.info --json`, run apart and outside any torchrun environment (there it
    would join the job): (report, None), or (None, why not)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC")}
    cwd = tempfile.gettempdir()
    if extension_built():
        # This checkout's dptc, as put_checkout_on_path chose; otherwise the installed one.
        cwd = ROOT
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "dptc.info", "--json"]
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"python -m dptc.info --json did not finish in {timeout:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"python -m dptc.info --json exited with status {done.returncode}: {last}"
    try:
        return json.loads(done.stdout), None
    except ValueError:
        return None, f"python -m dptc.info --json printed no JSON: {shorten(done.stdout, 200)}"


def environment_row(timeout):
    numbers = {"python": platform.python_version(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "nccl": torch_nccl_version(), **gpu_numbers()}
    info, problem = dptc_info(timeout)
    text = (f"torch {numbers['torch']}, CUDA {numbers['cuda'] or '-'}, NCCL "
            f"{numbers['nccl'] or '-'}, GPU {numbers['gpu'] or '-'}")
    if info is None:
        row = make_row("env", "environment", "FAIL", f"{problem}; {text}", **numbers)
    else:
        nccl = info.get("nccl", {})
        numbers.update(dptc=info.get("dptc", {}).get("version"),
                       dptc_transports=info.get("transports"),
                       dptc_nccl_transport=info.get("nccl_transport"),
                       dptc_nccl_library=nccl.get("version_text") or nccl.get("state"))
        text += (f"; dptc {numbers['dptc']}: transports {','.join(numbers['dptc_transports'])}, "
                 f"NCCL transport {numbers['dptc_nccl_transport']}, NCCL library "
                 f"{numbers['dptc_nccl_library']}")
        row = make_row("env", "environment", "ok", text, **numbers)
    row["dptc_info"] = info
    return row


def skip_row(section, reason):
    return make_row(section, section, "SKIP", reason)


# ---------------------------------------------------------------------------------------------
# Section 2: collectives on CUDA tensors

def sample(dtype, count, device):
    """Values that exercise the dtype: signs and fractions where it has them."""
    generator = torch.Generator().manual_seed(count)
    if dtype == torch.bool:
        values = torch.randint(2, (count,), generator=generator).bool()
    elif dtype in FLOATING:
        values = (torch.randn(count, generator=generator, dtype=torch.float64) * 10).to(dtype)
    elif dtype == torch.uint8:
        values = torch.randint(256, (count,), generator=generator).to(dtype)
    else:
        values = torch.randint(-100, 100, (count,), generator=generator).to(dtype)
    return values.to(device.torch_device)


def poisoned(like):
    """A tensor shaped like `like` that differs from it in every element (NaN when floating)."""
    if like.dtype == torch.bool:
        return ~like
    if like.is_floating_point():
        return torch.full_like(like, float("nan"))
    return like + 1        # wraps at the top of uint8 and int8, still different


def written_late(source, device):
    """A copy of source, written on the current stream behind a short GPU sleep: a collective
    that does not wait for the current stream reads the poison instead."""
    tensor = poisoned(source)
    device.sleep(LATE_WRITE_S)
    tensor.copy_(source)
    return tensor


def cases(dtype):
    """(collective, reduce op name or None) pairs valid for dtype: AVG needs a floating type."""
    ops = [op for op in REDUCE_OPS if op != "AVG" or dtype in FLOATING]
    return ([("all_reduce", op) for op in ops]
            + [("broadcast", None), ("all_gather_into_tensor", None)]
            + [("reduce_scatter_tensor", op) for op in ops]
            + [("all_gather_into_tensors", None)])


def issue(dptc, kind, op, source, async_op, device):
    """Issues one collective on a late-written copy of source: (work, [(output, expected)]).

    Inputs that are not outputs are referenced only by the call, so their memory goes back to
    the caching allocator as soon as it returns (see run_case)."""
    reduce_op = None if op is None else getattr(dptc.ReduceOp, op)
    if kind == "all_reduce":
        tensor = written_late(source, device)
        return dptc.all_reduce(tensor, op=reduce_op, async_op=async_op), [(tensor, source)]
    if kind == "broadcast":
        tensor = written_late(source, device)
        return dptc.broadcast(tensor, src=0, async_op=async_op), [(tensor, source)]
    if kind == "all_gather_into_tensor":
        output = poisoned(source)
        work = dptc.all_gather_into_tensor(output, written_late(source, device),
                                           async_op=async_op)
        return work, [(output, source)]
    if kind == "reduce_scatter_tensor":
        output = poisoned(source)
        work = dptc.reduce_scatter_tensor(output, written_late(source, device), op=reduce_op,
                                          async_op=async_op)
        return work, [(output, source)]
    # all_gather_into_tensors: at world size 1 output j receives piece j of the input.
    count = source.numel()
    pieces = list(source.split([count // 2, 1, count - count // 2 - 1]))
    outputs = [poisoned(piece) for piece in pieces]
    work = dptc.all_gather_into_tensors(outputs, written_late(source, device), async_op=async_op)
    return work, list(zip(outputs, pieces))


def run_case(dptc, kind, op, source, async_op, device):
    """One checked collective; returns how many output elements differ from the expected."""
    work, pairs = issue(dptc, kind, op, source, async_op, device)
    # The input's freed block is the first the allocator hands out again on this stream:
    # writing over it now corrupts the result if the collective has not read it yet.
    poisoned(source)
    if async_op:
        if work is None:
            raise TypeError("async_op=True returned None instead of a work handle")
        work.wait()
    elif work is not None:
        raise TypeError(f"a blocking call returned {work!r}; torch's return None")
    bad = sum(int((output != expected).sum()) for output, expected in pairs)
    if async_op:
        device.sync()
        if not work.is_completed():
            raise RuntimeError("work.is_completed() is False after torch.cuda.synchronize()")
    return bad


class Tally:
    """Outcomes of one dtype's checked calls, and the row they make."""

    def __init__(self):
        self.total = 0
        self.passed = 0
        self.failures = []        # mismatches and unexpected exceptions
        self.not_built = []

    def add(self, label, run):
        self.total += 1
        try:
            bad = run()
        except Exception as error:  # noqa: BLE001 - counted and reported in the row
            (self.not_built if is_not_built(error) else self.failures).append(
                f"{label}: {first_line(error)}")
            return
        if bad:
            self.failures.append(f"{label}: {bad} elements differ")
        else:
            self.passed += 1

    def row(self, name):
        if self.failures:
            return make_row("collectives", name, "FAIL",
                            f"{self.passed}/{self.total} exact; " + "; ".join(self.failures[:3]),
                            passed=self.passed, total=self.total, failures=self.failures[:20])
        if self.not_built:
            return make_row("collectives", name, "NOT BUILT",
                            f"{len(self.not_built)}/{self.total} calls; {self.not_built[0]}",
                            passed=self.passed, total=self.total)
        return make_row("collectives", name, "ok", f"{self.total}/{self.total} exact",
                        passed=self.passed, total=self.total)


def dtype_row_name(dtype):
    return f"coll {str(dtype).replace('torch.', '')}"


def check_dtype(dptc, dtype, device):
    tally = Tally()
    for count in COUNTS:
        source = sample(dtype, count, device)
        device.sync()            # the side stream reads it too
        for stream_label, stream in device.streams():
            for async_op in (False, True):
                for kind, op in cases(dtype):
                    label = (f"{kind}{'' if op is None else ' ' + op}"
                             f"{' async' if async_op else ''} ({stream_label} stream, n={count})")

                    def run(kind=kind, op=op, async_op=async_op, stream=stream):
                        with stream():
                            return run_case(dptc, kind, op, source, async_op, device)
                    tally.add(label, run)
    return tally.row(dtype_row_name(dtype))


def check_barrier(dptc, device):
    for _, stream in device.streams():
        with stream():
            if dptc.barrier(device_ids=device.device_ids) is not None:
                raise TypeError("a blocking barrier returned a work handle")
            dptc.barrier(async_op=True, device_ids=device.device_ids).wait()
    return make_row("collectives", "coll barrier", "ok", "blocking and async_op, each stream")


def bandwidth_row(args, device):
    """A large all_reduce with torch's backend, then dptc's; information, no target."""
    name = f"coll all_reduce {args.bandwidth_mib} MiB"
    nbytes = args.bandwidth_mib * MIB
    tensor = torch.zeros(nbytes // 4, device=device.torch_device)
    torch_s = seconds_per_call(lambda: dist.all_reduce(tensor), device)
    numbers = {"bytes": nbytes, "torch_ms": torch_s * 1e3,
               "torch_algbw_gbps": nbytes / torch_s / 1e9}
    torch_text = f"torch {device.backend} {numbers['torch_algbw_gbps']:.0f} GB/s"
    try:
        import dptc
        dptc_s = seconds_per_call(lambda: dptc.all_reduce(tensor), device)
    except Exception as error:  # noqa: BLE001 - torch's figure still goes in the row
        row = error_row("collectives", name, error)
        row["detail"] += f" ({torch_text})"
        row["numbers"].update(numbers)
        return row
    numbers.update(dptc_ms=dptc_s * 1e3, dptc_algbw_gbps=nbytes / dptc_s / 1e9,
                   dptc_vs_torch=torch_s / dptc_s)
    return make_row("collectives", name, "ok",
                    f"algbw dptc {numbers['dptc_algbw_gbps']:.0f} GB/s, {torch_text} "
                    f"(x{numbers['dptc_vs_torch']:.2f}); world size 1: busbw is 0 by "
                    f"definition, algbw times the local path", **numbers)


def section_collectives(args, device, rows):
    init_torch_group(device)
    dptc = attempt(rows, "collectives", "coll import dptc", lambda: __import__("dptc"))
    if dptc is not None:
        for dtype in DTYPES:
            rows.running(dtype_row_name(dtype))
            rows.add(check_dtype(dptc, dtype, device))
        row = attempt(rows, "collectives", "coll barrier", lambda: check_barrier(dptc, device))
        if row is not None:
            rows.add(row)
    rows.running(f"coll all_reduce {args.bandwidth_mib} MiB")
    rows.add(bandwidth_row(args, device))


# ---------------------------------------------------------------------------------------------
# Sections 3 and 4: training steps

class Run:
    """One implementation's steps: times, peak memory, losses and final parameters."""

    def __init__(self, step_s, peak_bytes, losses, params):
        self.step_s = step_s
        self.peak_bytes = peak_bytes
        self.losses = losses
        self.params = params

    @property
    def step_ms(self):
        return statistics.median(self.step_s) * 1e3

    def numbers(self):
        peak = None if self.peak_bytes is None else self.peak_bytes / MIB
        return {"step_ms": self.step_ms, "steps_ms": [s * 1e3 for s in self.step_s],
                "peak_mib": peak, "first_loss": self.losses[0], "last_loss": self.losses[-1]}

    def text(self):
        text = f"step {self.step_ms:.2f} ms"
        if self.peak_bytes is not None:
            text += f", peak {self.peak_bytes / (1 << 30):.2f} GiB"
        return text


def model_and_batches(args, device):
    """The initial model (CPU, float32) and every step's batch, on the device."""
    torch.manual_seed(args.seed)
    initial = build_gpt(vocab=args.vocab, d_model=args.d_model, n_layer=args.layers,
                        n_head=args.heads, ctx=args.ctx)
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(args.vocab, (args.warmup + args.steps, args.batch, args.ctx + 1),
                           generator=generator)
    batches = [(t[:, :-1].contiguous().to(device.torch_device),
                t[:, 1:].contiguous().to(device.torch_device)) for t in tokens]
    return initial, batches


def full_params(model):
    """name -> float32 CPU copy of each parameter, whole (DDP's "module." prefix dropped)."""
    params = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):            # a DTensor shard of fully_shard
            local = tensor.to_local()
            tensor = local if local.shape == tensor.shape else tensor.full_tensor()
        params[name.removeprefix("module.")] = tensor.float().cpu()
    return params


def train_step(model, optimizer, batch, device, autocast):
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(inputs)
    loss = GPT.loss(logits.float(), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_step_side_stream(model, optimizer, batch, device, autocast):
    """train_step with forward on the current stream and backward and the optimizer step on a
    side stream made current, as torch's CUDA semantics notes allow: the gradients and what
    the wrapper reduced must be waited for by the side stream."""
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(inputs)
    loss = GPT.loss(logits.float(), targets)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loss.backward()
        optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    return loss.detach()


def measure(build, batches, args, device, autocast, step=train_step):
    """Builds one implementation's model alone on the device and trains it on every batch."""
    device.reset_peak()
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    step_s, losses = [], []
    for index, batch in enumerate(batches):
        device.sync()
        start = time.perf_counter()
        losses.append(step(model, optimizer, batch, device, autocast))
        device.sync()
        if index >= args.warmup:
            step_s.append(time.perf_counter() - start)
    peak = device.peak_bytes()
    return Run(step_s, peak, [float(loss) for loss in losses], full_params(model))


def warm_up(initial, batches, args, device):
    """Untimed steps of the unwrapped model before any implementation is measured, so that the
    first one does not pay for the GPU's and the libraries' first use (clocks, cuBLAS handles,
    kernel choices): measured first, the reference would look slower and flatter dptc."""
    model = to_device(initial, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for batch in batches[:args.warmup]:
        train_step(model, optimizer, batch, device, autocast=True)
    device.sync()
    return True


def param_difference(params, reference, initial):
    """max |p - r| and ||p - r|| / ||r - p0|| over every parameter (see the module's doc)."""
    if params.keys() != reference.keys():
        differ = sorted(params.keys() ^ reference.keys())
        raise ValueError(f"the parameter names differ: {differ[:5]}")
    max_abs, diff_sq, update_sq = 0.0, 0.0, 0.0
    for name, value in params.items():
        delta = value - reference[name]
        max_abs = max(max_abs, delta.abs().max().item())
        diff_sq += torch.linalg.vector_norm(delta, dtype=torch.float64).item() ** 2
        update = reference[name] - initial[name]
        update_sq += torch.linalg.vector_norm(update, dtype=torch.float64).item() ** 2
    if update_sq == 0:
        relative = 0.0 if diff_sq == 0 else math.inf
    else:
        relative = math.sqrt(diff_sq / update_sq)
    return {"max_abs_diff": max_abs, "update_rel_diff": relative}


def result_row(section, name, run, args, initial=None, reference=None, peers=(), targets=()):
    """The row of one implementation: its numbers; parameters against `reference`
    ((label, Run) or None); step ratios against `peers` ((label, Run or None) pairs); targets
    ((quantity "step" or "peak", peer label, highest ratio)) missed make it MISS."""
    numbers, notes, misses = run.numbers(), [run.text()], []
    outcome = "ok"
    if reference is not None and reference[1] is not None:
        label, ref_run = reference
        diff = param_difference(run.params, ref_run.params, initial)
        numbers.update({f"{k}_vs_{label}": v for k, v in diff.items()})
        notes.append(f"params vs {label}: rel {diff['update_rel_diff']:.1e}, "
                     f"max {diff['max_abs_diff']:.1e}")
        if not diff["update_rel_diff"] <= args.rtol:
            outcome = "FAIL"
            notes.append(f"over --rtol {args.rtol:g}")
    for label, peer in peers:
        if peer is None:
            continue
        ratios = {"step": run.step_ms / peer.step_ms}
        if run.peak_bytes and peer.peak_bytes:
            ratios["peak"] = run.peak_bytes / peer.peak_bytes
        for quantity, ratio in ratios.items():
            numbers[f"{quantity}_vs_{label}"] = ratio
        notes.append(f"x{ratios['step']:.3f} step"
                     + (f", x{ratios['peak']:.3f} peak" if "peak" in ratios else "")
                     + f" vs {label}")
        for quantity, peer_label, limit in targets:
            if peer_label == label and quantity in ratios and ratios[quantity] > limit:
                misses.append(f"{quantity} x{ratios[quantity]:.3f} {label} > {limit:g}")
    if misses and outcome == "ok":
        outcome = "MISS"
        notes.append("target missed: " + ", ".join(misses))
    numbers["targets_missed"] = misses
    return make_row(section, name, outcome, "; ".join(notes), **numbers)


def to_device(initial, device):
    return copy.deepcopy(initial).to(device.torch_device)


def torch_ddp(initial, device):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(to_device(initial, device), device_ids=device.device_ids)


def dptc_ddp(initial, device, **options):
    import dptc
    return dptc.DistributedDataParallel(to_device(initial, device), device_ids=device.device_ids,
                                        **options)


def section_ddp(args, device, rows):
    init_torch_group(device)
    initial, batches = model_and_batches(args, device)
    start = {name: p.detach().clone() for name, p in initial.named_parameters()}

    def train(build):
        return lambda: measure(build, batches, args, device, autocast=True)

    attempt(rows, "ddp", "ddp warm-up", lambda: warm_up(initial, batches, args, device))
    unwrapped = attempt(rows, "ddp", "ddp unwrapped", train(lambda: to_device(initial, device)))
    if unwrapped is not None:
        rows.add(result_row("ddp", "ddp unwrapped", unwrapped, args))
    reference = ("unwrapped", unwrapped)
    torch_run = attempt(rows, "ddp", "ddp torch", train(lambda: torch_ddp(initial, device)))
    if torch_run is not None:
        rows.add(result_row("ddp", "ddp torch", torch_run, args, start, reference,
                            peers=[reference]))
    dptc_run = attempt(rows, "ddp", "ddp dptc", train(lambda: dptc_ddp(initial, device)))
    if dptc_run is not None:
        rows.add(result_row("ddp", "ddp dptc", dptc_run, args, start, reference,
                            peers=[reference, ("torch", torch_run)],
                            targets=[("step", "unwrapped", 1.02), ("step", "torch", 1.00)]))
    # find_unused_parameters: the used map is all-reduced on the device; every parameter is
    # used, so the host never waits for it ([Note: unused parameters on a device]).
    unused_run = attempt(rows, "ddp", "ddp dptc find_unused",
                         train(lambda: dptc_ddp(initial, device, find_unused_parameters=True)))
    if unused_run is not None:
        rows.add(result_row("ddp", "ddp dptc find_unused", unused_run, args, start, reference,
                            peers=[reference, ("torch", torch_run)]))


def sharded(initial, device, fully_shard, policy):
    model = to_device(initial, device)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def torch_fsdp(initial, device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    return sharded(initial, device, fully_shard, MixedPrecisionPolicy(**MIXED_PRECISION))


def dptc_fsdp(initial, device):
    import dptc
    return sharded(initial, device, dptc.fully_shard, dptc.MixedPrecisionPolicy(**MIXED_PRECISION))


def section_fsdp(args, device, rows):
    init_torch_group(device)
    initial, batches = model_and_batches(args, device)
    start = {name: p.detach().clone() for name, p in initial.named_parameters()}

    def train(build, step=train_step):
        # The policy casts: no autocast.
        return lambda: measure(build, batches, args, device, autocast=False, step=step)

    attempt(rows, "fsdp", "fsdp warm-up", lambda: warm_up(initial, batches, args, device))
    torch_run = attempt(rows, "fsdp", "fsdp torch", train(lambda: torch_fsdp(initial, device)))
    if torch_run is not None:
        rows.add(result_row("fsdp", "fsdp torch", torch_run, args))
    reference = ("torch", torch_run)
    dptc_run = attempt(rows, "fsdp", "fsdp dptc", train(lambda: dptc_fsdp(initial, device)))
    if dptc_run is not None:
        rows.add(result_row("fsdp", "fsdp dptc", dptc_run, args, start, reference,
                            peers=[reference],
                            targets=[("step", "torch", 1.00), ("peak", "torch", 1.00)]))
    # Backward and the optimizer step on a side stream: the end-of-backward reduction's waits
    # and the optimizer must follow dptc's reduce-scatters there too.
    name = "fsdp dptc side stream"
    if not device.cuda:
        rows.add(make_row("fsdp", name, "SKIP", "CUDA streams only"))
        return
    side_run = attempt(rows, "fsdp", name, train(lambda: dptc_fsdp(initial, device),
                                                 step=train_step_side_stream))
    if side_run is not None:
        rows.add(result_row("fsdp", name, side_run, args, start, reference, peers=[reference]))


# ---------------------------------------------------------------------------------------------
# Section 5: the async-error drill

def first_raise(dptc, tensor, group, timeout):
    """Issues a collective behind the stall and looks for the error everywhere it may surface,
    in order.  Returns (what raised or None, the exception or None, seconds after the issue,
    seconds after which work.is_completed() first said True, or None); nothing raised means
    nothing did before timeout + DRILL_SLACK_S."""
    start = time.monotonic()
    work, completed_after = None, None

    def issue():
        nonlocal work
        work = dptc.all_reduce(tensor, group=group, async_op=True)

    def poll(until):
        nonlocal completed_after
        while time.monotonic() - start < until:
            if work.is_completed():
                # Before the stall ends this is a bug of its own: the work did not wait.
                completed_after = completed_after or time.monotonic() - start
                return
            time.sleep(POLL_S)

    checks = [
        ("all_reduce(async_op=True)", issue),
        ("work.is_completed()", lambda: poll(timeout + 1.0)),
        # A timed-out group is failed: its next collective raises.
        ("the group's next all_reduce", lambda: dptc.all_reduce(tensor, group=group)),
        ("work.is_completed()", lambda: poll(timeout + DRILL_SLACK_S)),
        ("work.wait()", lambda: work.wait()),
        ("the group's barrier", lambda: dptc.barrier(group=group)),
    ]
    for what, check in checks:
        try:
            check()
        except Exception as error:  # noqa: BLE001 - the drill wants this
            return what, error, time.monotonic() - start, completed_after
    return None, None, time.monotonic() - start, completed_after


def timeout_drill(args, device):
    """A collective stuck behind a GPU stall past its group's timeout must raise, in time."""
    import dptc
    dptc.init_process_group()
    group = dptc.new_group([0], timeout=args.drill_timeout)
    tensor = torch.ones(1 << 20, device=device.torch_device)
    # The first collective sets the communicator up: outside the stalled part.
    dptc.all_reduce(tensor, group=group)
    device.sync()
    bound = args.drill_timeout + DRILL_SLACK_S
    stall = max(DRILL_STALL_S, 2 * bound)
    device.sleep(stall)
    what, error, seconds, completed_after = first_raise(dptc, tensor, group, args.drill_timeout)
    numbers = {"timeout_s": args.drill_timeout, "stall_s": stall, "bound_s": bound,
               "raised_after_s": seconds if error is not None else None, "raised_by": what,
               "completed_after_s": completed_after}
    setting = f"timeout {args.drill_timeout:g} s, GPU stalled {stall:g} s"
    if completed_after is not None:
        setting += f"; work.is_completed() was True after {completed_after:.2f} s"
    if error is None:
        return make_row("drill", "drill timeout", "FAIL",
                        f"nothing raised within {seconds:.1f} s ({setting}): the timeout is "
                        f"not enforced", **numbers)
    if not isinstance(error, dptc.DistError):
        row = error_row("drill", "drill timeout", error)
        row["detail"] += (f" (raised by {what} after {seconds:.1f} s; expected a "
                          f"dptc.DistError; {setting})")
        row["numbers"].update(numbers)
        return row
    late = seconds > bound
    return make_row("drill", "drill timeout", "FAIL" if late else "ok",
                    f"{first_line(error)}; raised by {what} after {seconds:.2f} s"
                    f"{f', past the bound of {bound:g} s' if late else ''} ({setting})",
                    **numbers)


def section_drill(args, device, rows):
    if not device.cuda:
        rows.add(make_row("drill", "drill timeout", "SKIP",
                          "--rehearse: the drill needs a GPU stream to stall"))
        return
    row = attempt(rows, "drill", "drill timeout", lambda: timeout_drill(args, device))
    if row is not None:
        rows.add(row)


SECTIONS = {"collectives": section_collectives, "ddp": section_ddp, "fsdp": section_fsdp,
            "drill": section_drill}


def run_section(section, args, device, rows):
    """One section; an exception outside its own rows (setting up NCCL, building the model)
    becomes a FAIL row named for what was running."""
    rows.running(section)
    try:
        SECTIONS[section](args, device, rows)
    except Exception as error:  # noqa: BLE001 - every failure becomes a row
        rows.add(error_row(section, rows.current or section, error))


# ---------------------------------------------------------------------------------------------
# Output

def format_table(rows, seconds):
    rule = "-" * (NAME_WIDTH + OUTCOME_WIDTH + DETAIL_WIDTH + 2)
    lines = ["", f"gpu_check: {len(rows)} rows in {seconds:.0f} s", rule,
             f"{'check':<{NAME_WIDTH}} {'outcome':<{OUTCOME_WIDTH}} detail", rule]
    for row in rows:
        lines.append(f"{row['name']:<{NAME_WIDTH}} {row['outcome']:<{OUTCOME_WIDTH}} "
                     f"{shorten(row['detail'], DETAIL_WIDTH)}")
    counts = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    lines += [rule, "  ".join(f"{outcome} {n}" for outcome, n in counts.items())]
    return "\n".join(lines)


def output_paths():
    """(JSON file, folder for the sections' logs or None): under $OUT when set (the device tool
    brings back what is there), else the JSON in the current folder (see log_folder)."""
    out = os.environ.get("OUT")
    if out:
        return os.path.join(out, "gpu_check.json"), os.path.join(out, "gpu_check_logs")
    return os.path.abspath("gpu_check.json"), None


def write_json(path, rows, args, started, sections):
    report = {"script": "benchmarks/gpu_check.py", "argv": sys.argv[1:],
              "rehearse": args.rehearse, "deadline_s": args.deadline,
              "seconds": time.monotonic() - started,
              "model": {k: getattr(args, k) for k in ("vocab", "d_model", "layers", "heads",
                                                      "ctx", "batch", "warmup", "steps")},
              "rtol": args.rtol, "sections": sections, "rows": rows}
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def finish(rows, args, started, sections):
    """Writes the JSON, then prints the table last; returns the exit status."""
    json_path, _ = output_paths()
    write_json(json_path, rows, args, started, sections)
    print(f"rows written to {json_path}", flush=True)
    print(format_table(rows, time.monotonic() - started), flush=True)
    return 1 if any(row["outcome"] == "FAIL" for row in rows) else 0


# ---------------------------------------------------------------------------------------------
# The launcher: each section in its own process

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_tree(process, worker_pids):
    """SIGTERM, then SIGKILL, to torchrun's process group and to each worker's: torchrun starts
    its workers in sessions of their own, so its group alone would leave them running."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in (process.pid, *worker_pids):
            for send in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    send(pid, sig)
        limit = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < limit:
            if process.poll() is not None and not any(alive(p) for p in worker_pids):
                return
            time.sleep(0.1)


def read_records(path):
    records = []
    with contextlib.suppress(OSError):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
    return records


def read_log(path):
    with contextlib.suppress(OSError):
        with open(path, errors="replace") as f:
            return f.read()
    return ""


def worker_last_line(log):
    """The worker's last line before torchrun's own report of its failure (which starts at
    "failed (exitcode: N)" and ends in a banner)."""
    lines = [line for line in log.splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if "failed (exitcode" in line and index > 0:
            lines = lines[:index]
            break
    return lines[-1].strip() if lines else "no output"


def section_rows(section, records, status, budget, log_path):
    """The rows a section wrote, plus a FAIL row naming what was running when it did not end
    on its own."""
    rows, running, done = [], None, False
    for record in records:
        if "row" in record:
            rows.append(record["row"])
            running = None
        running = record.get("running", running)
        done = done or record.get("done", False)
    if done:
        return rows
    what = running or section
    if status == "killed":
        why = (f"killed at the section's budget of {budget:.0f} s while running {what!r} "
               f"(hung? every thread's stack is in {log_path})")
    else:
        why = (f"its process exited with status {status} while running {what!r}: "
               f"{worker_last_line(read_log(log_path))}")
    row = make_row(section, what, "FAIL", why)
    row["log_tail"] = read_log(log_path)[-LOG_TAIL_CHARS:]
    return rows + [row]


def section_env():
    env = dict(os.environ)
    env.setdefault("DPTC_TIMEOUT", SECTION_DPTC_TIMEOUT_S)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def launch_section(section, argv, budget, log_dir, rows_dir):
    """Runs one section under torch.distributed.run with one process; returns (its rows,
    a summary for the JSON)."""
    rows_path = os.path.join(rows_dir, f"{section}.rows.jsonl")
    log_path = os.path.join(log_dir, f"{section}.log")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=1", os.path.abspath(__file__), *argv, "--section", section,
               "--rows", rows_path, "--budget", f"{budget:.0f}"]
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=section_env(), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = process.wait(timeout=budget)
        except BaseException as error:
            pids = [r["pid"] for r in read_records(rows_path) if "pid" in r]
            stop_tree(process, pids)
            if not isinstance(error, subprocess.TimeoutExpired):
                raise
            status = "killed"
    summary = {"status": status, "seconds": round(time.monotonic() - started, 1),
               "budget_s": budget, "log": log_path}
    return section_rows(section, read_records(rows_path), status, budget, log_path), summary


@functools.cache
def log_folder():
    """Where the sections' logs go: $OUT/gpu_check_logs, else a new temporary folder."""
    folder = output_paths()[1] or tempfile.mkdtemp(prefix="gpu_check_logs-")
    os.makedirs(folder, exist_ok=True)
    return folder


def launch_or_skip(section, args, argv, reason, started, rows_dir):
    """(rows, summary or None) of one section: launched, or skipped for want of CUDA or of
    time before the deadline."""
    if reason is not None:
        return [skip_row(section, reason)], None
    left = started + args.deadline - time.monotonic() - RESERVE_S
    if left < MIN_SECTION_S:
        return [skip_row(section, f"not started: {max(left, 0):.0f} s left of the "
                                  f"{args.deadline:.0f} s deadline")], None
    budget = min(BUDGETS_S[section], left)
    print(f"[{time.monotonic() - started:6.1f} s] {section}: started, budget {budget:.0f} s, "
          f"log {log_folder()}/{section}.log", flush=True)
    return launch_section(section, argv, budget, log_folder(), rows_dir)


def launch(args, argv):
    """The launcher: the environment here, then each section in a process of its own."""
    started = time.monotonic()
    rows, sections = Rows(echo=True), {}
    try:
        rows.add(environment_row(min(INFO_TIMEOUT_S, args.deadline / 4)))
        reason = None if args.rehearse else no_cuda_reason()
        with tempfile.TemporaryDirectory(prefix="gpu_check_rows-") as rows_dir:
            for section in args.sections:
                launched, summary = launch_or_skip(section, args, argv, reason, started,
                                                   rows_dir)
                for row in launched:
                    rows.add(row)
                if summary is not None:
                    sections[section] = summary
                # Written after every section: a launcher killed from outside leaves them.
                write_json(output_paths()[0], rows.rows, args, started, sections)
    finally:
        status = finish(rows.rows, args, started, sections)
    return status


# ---------------------------------------------------------------------------------------------
# Inside torchrun

def world_size_problem():
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size != 1:
        return (f"gpu_check runs at world size 1 (one GPU), got WORLD_SIZE={size}; launch with "
                f"--nproc_per_node=1, or without torchrun")
    return None


def section_process(args):
    """One section, started by launch_section: its rows go to --rows as they come."""
    rows = Rows(args.rows)
    rows.note(pid=os.getpid())
    # A hang leaves every thread's stack in the log before the launcher kills this process.
    faulthandler.dump_traceback_later(max(5.0, args.budget - DUMP_BEFORE_S))
    problem = world_size_problem()
    if problem is not None:
        rows.add(make_row(args.section, args.section, "FAIL", problem))
    else:
        run_section(args.section, args, Device(cuda=not args.rehearse), rows)
    rows.note(done=True)
    # Teardown is not under test; exiting at once keeps a wedged communicator (the drill's)
    # from holding the section past its budget.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def overrun_guard(section, budget, rows, args, started, sections):
    """A timer that ends the run with the table when a section outlives its budget."""
    def overrun():
        faulthandler.dump_traceback(all_threads=True)
        rows.add(make_row(section, rows.current or section, "FAIL",
                          f"still running at the section's budget of {budget:.0f} s (hung? "
                          f"stacks above); run without torchrun to isolate the sections"))
        status = finish(rows.rows, args, started, sections)
        os._exit(status)
    timer = threading.Timer(budget, overrun)
    timer.daemon = True
    return timer


def in_this_process(args):
    """Under torchrun: every section in this process, in order."""
    problem = world_size_problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    started = time.monotonic()
    rows = Rows(echo=True)
    sections = {}
    rows.add(environment_row(INFO_TIMEOUT_S))
    reason = None if args.rehearse else no_cuda_reason()
    device = Device(cuda=reason is None and not args.rehearse)
    for section in args.sections:
        if reason is not None:
            rows.add(skip_row(section, reason))
            continue
        timer = overrun_guard(section, BUDGETS_S[section], rows, args, started, sections)
        timer.start()
        begun = time.monotonic()
        run_section(section, args, device, rows)
        timer.cancel()
        sections[section] = {"status": "in process", "seconds": round(time.monotonic() - begun, 1)}
    return finish(rows.rows, args, started, sections)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.section is not None:
        return section_process(args)
    if "RANK" in os.environ:
        return in_this_process(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
