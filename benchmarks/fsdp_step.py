"""Training step time and memory of dptc's fully_shard against torch's (gloo), and dptc's DDP.

    python benchmarks/fsdp_step.py                     # starts its own ranks (4 launches)
    python benchmarks/fsdp_step.py --mp bf16           # MixedPrecisionPolicy(bf16, fp32) on both
    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp_step.py   # timing launch only

The model is examples/gpt.py's GPT.  A step is zero_grad, forward, cross-entropy, backward and
AdamW on a fixed per-rank batch.  The implementations:

    dptc fully_shard   dptc.fully_shard on each block, then on the root
    torch fully_shard  torch.distributed.fsdp.fully_shard on gloo, the same way
    dptc DDP           dptc.DistributedDataParallel (no mixed precision: it has no policy)
    compute            the unwrapped model, no communication (timing launch only; a baseline)

Without the torchrun environment the script starts its ranks itself, one launch after another
(torch.distributed.run --standalone, OMP_NUM_THREADS=1), each with a share of --deadline:

1. Timing launch: every implementation's model lives in the same rank processes and the phases
   take turns step by step (A B C D, then D C B A, ...), so the machine's noise falls on all of
   them alike.  A phase's step time is the median over its timed steps of the slowest rank's
   step; forward (with zero_grad and the loss), backward and optimizer step are timed apart the
   same way.  No memory sampling runs here.  At the end the full parameters of the copies,
   which started equal and took the same steps, are compared.
2. Memory launches, one per implementation, with only that model in the processes (ru_maxrss and
   PSS are per process, so they cannot be split within one).  Each rank records its baseline
   RSS and PSS once gloo is initialised and every module is imported, before dptc's group or
   the model exists; then come warm-up steps, steps timed alone, and steps timed while a
   background thread samples /proc/self/statm (RSS) every --sample-ms and reads /proc/self/smaps_rollup's Pss whenever RSS sets a new high by 1 MiB or
   more, and every 0.5 s (reading smaps_rollup costs milliseconds here, statm microseconds).
   Reported: ru_maxrss (the process's lifetime peak RSS), the sampled peak PSS and peak PSS
   minus the baseline, the bytes of all live tensors between steps (gc, every distinct storage,
   DTensors by their local tensor), and the peak of live tensor bytes inside a step, from two
   steps under torch.profiler(profile_memory=True): between-step bytes plus the highest
   "Total Allocated" in the second step over its value when that step began, plus, for dptc's
   fully_shard, its shared reduce ring, which holds the reductions' inputs outside torch's
   allocator (reduce_ring_bytes; before 2026-12-04 it was left out).  The step times
   of these launches, the median of --memory-steps steps before the sampler starts ("alone")
   and while it runs ("sampled"), are for reference: not interleaved, so noise is not shared.

Theoretical per-rank model state, fp32 master parameters:
    sharded   (params + grads + AdamW exp_avg + exp_avg_sq) / N, dim 0 padded to a multiple of
              N as fully_shard pads it, plus AdamW's 4-byte step counters: what a rank holds
              between steps
    peak      sharded + the largest unit's unsharded parameters and gradients (param_dtype)
For DDP the state is not sharded: 4 x params + step counters, plus one gradient-sized set of
buckets (torch's DDP and dptc's both keep one; 5 x params in all).  The check compares the live
tensor bytes between steps with "sharded" (within 10%?).

torch's reference ranks may abort at exit under gloo ("terminate called without an active
exception"); every rank writes its results before it exits, and the table is built from them.
"""

import argparse
import copy
import gc
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _checkout import put_checkout_on_path

put_checkout_on_path()

from examples.gpt import build_gpt  # noqa: E402

MB = 1 << 20
IMPLS = ("dptc-fsdp", "torch-fsdp", "dptc-ddp")
LABELS = {"dptc-fsdp": "dptc fully_shard", "torch-fsdp": "torch fully_shard",
          "dptc-ddp": "dptc DDP", "compute": "compute (no wrapper)"}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", "--nproc", dest="ranks", type=int, default=2,
                        help="ranks to start when not already under torchrun (default 2)")
    parser.add_argument("--impls", default=None,
                        help=f"comma-separated subset of {','.join(IMPLS)} (default: all, "
                             f"without dptc-ddp under --tp)")
    parser.add_argument("--mp", default="none", choices=("none", "bf16"),
                        help="bf16: MixedPrecisionPolicy(param_dtype=bfloat16, "
                             "reduce_dtype=float32) on both fully_shards (DDP stays fp32)")
    parser.add_argument("--shard-last", action="store_true",
                        help="shard_placement_fn: matrices on Shard(-1), their last dim, on "
                             "both fully_shards (the default is Shard(0) for every parameter)")
    parser.add_argument("--freeze-embeddings", action="store_true",
                        help="the token and position embeddings frozen (requires_grad_(False)), "
                             "as in a fine-tune: they share the root's unit with the trainable "
                             "final norm and head")
    parser.add_argument("--reshard-after-forward", type=int, default=None, metavar="K",
                        help="reshard_after_forward=K on every block on both fully_shards "
                             "(K a divisor of --ranks: after forward a rank keeps 1/K of a "
                             "block, and backward gathers over blocks of K ranks); default: "
                             "fully_shard's default, True for the blocks")
    parser.add_argument("--tp", type=int, default=1, metavar="T",
                        help="tensor parallelism of degree T inside each block's MLP on both "
                             "fully_shards (a (ranks/T, T) mesh; the MLP's linears "
                             "ColwiseParallel and RowwiseParallel on mesh['tp'], torch's own, "
                             "then fully_shard on mesh['dp']); timing only, without dptc DDP")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", "--n-layer", dest="layers", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per phase")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per phase")
    parser.add_argument("--memory-steps", type=int, default=10,
                        help="sampled steps in each memory launch (default 10)")
    parser.add_argument("--sample-ms", type=float, default=2.0,
                        help="RSS sampling interval of the memory launches (default 2 ms)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory launches")
    parser.add_argument("--deadline", type=float, default=170.0,
                        help="seconds for all launches together; a launch past its share is "
                             "killed (default 170)")
    parser.add_argument("--compile", action="store_true",
                        help="compile every block (block.compile()) before wrapping, in every "
                             "phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the launches' logs and result files (kept anyway when a "
                             "launch leaves no results)")
    # Internal: what one launch does and where its ranks write.
    parser.add_argument("--role", default="time", choices=("time", "memory"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.impls is None:
        args.impls = ",".join(i for i in IMPLS if args.tp == 1 or i != "dptc-ddp")
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for impl in args.impls:
        if impl not in IMPLS:
            parser.error(f"--impls: unknown {impl!r}; choose from {','.join(IMPLS)}")
    for name in ("ranks", "steps", "batch", "memory_steps", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    ranks = int(os.environ.get("WORLD_SIZE", args.ranks))   # under torchrun: its ranks
    if args.tp < 1 or ranks % args.tp:
        parser.error(f"--tp must be >= 1 and divide the {ranks} ranks, got {args.tp}")
    if args.tp > 1:
        if "dptc-ddp" in args.impls:
            parser.error("--tp runs the fully_shards only: pass --impls dptc-fsdp,torch-fsdp")
        args.no_memory = True     # the memory theory shards over every rank
    return args


# ---------------------------------------------------------------------------------------------
# Models

def mp_policies(args):
    """(dptc policy, torch policy) or (None, None)."""
    if args.mp == "none":
        return None, None
    import dptc
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    kwargs = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return dptc.MixedPrecisionPolicy(**kwargs), TorchMP(**kwargs)


def wrap(impl, model, args):
    """The model wrapped by impl ('compute': unwrapped); with --compile each block is compiled
    first (``block.compile()``), whatever the wrapper."""
    if args.compile:
        for block in model.blocks:
            block.compile()
    if impl == "compute":
        return model
    if impl == "dptc-ddp":
        import dptc
        return dptc.DistributedDataParallel(model)
    if impl == "dptc-fsdp":
        import dptc
        shard, policy = dptc.fully_shard, mp_policies(args)[0]
    else:
        from torch.distributed.fsdp import fully_shard as shard
        policy = mp_policies(args)[1]
    kwargs = {} if policy is None else {"mp_policy": policy}
    if args.shard_last:
        kwargs["shard_placement_fn"] = shard_last
    if args.tp > 1:
        mesh = tp_mesh(args)
        kwargs["mesh"] = mesh["dp"]
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(),
                                                       "2": RowwiseParallel()})
    block_kwargs = dict(kwargs)
    if args.reshard_after_forward is not None:
        block_kwargs["reshard_after_forward"] = args.reshard_after_forward
    for block in model.blocks:
        shard(block, **block_kwargs)
    shard(model, **kwargs)
    return model


_tp_mesh = []


def tp_mesh(args):
    """--tp: the (dp, tp) mesh, made once (a collective)."""
    if not _tp_mesh:
        from torch.distributed.device_mesh import init_device_mesh
        _tp_mesh.append(init_device_mesh("cpu", (dist.get_world_size() // args.tp, args.tp),
                                         mesh_dim_names=("dp", "tp")))
    return _tp_mesh[0]


def shard_last(param):
    from torch.distributed.tensor import Shard
    return Shard(-1) if param.dim() > 1 else None


def build(args):
    torch.manual_seed(args.seed)
    model = build_gpt(vocab=args.vocab, d_model=args.d_model, n_layer=args.layers,
                      n_head=args.n_head, ctx=args.ctx)
    if args.freeze_embeddings:
        model.tok_emb.requires_grad_(False)
        model.pos_emb.requires_grad_(False)
    return model


def theory(model, nranks, args):
    """Theoretical per-rank model-state bytes (see the module docstring)."""
    params = list(model.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    padded = sum(-(-p.shape[0] // nranks) * (p.numel() // p.shape[0]) * p.element_size()
                 for p in params)
    steps = 4 * len(params)                       # AdamW's 0-dim float32 step counters
    compute_size = 2 if args.mp == "bf16" else 4
    block_params = {id(p) for block in model.blocks for p in block.parameters()}
    units = [list(block.parameters()) for block in model.blocks]
    units.append([p for p in params if id(p) not in block_params])
    largest = max(sum(nranks * -(-p.shape[0] // nranks) * (p.numel() // p.shape[0])
                      for p in unit) for unit in units)
    return {"params": sum(p.numel() for p in params), "full_bytes": full,
            "padded_share_bytes": padded, "step_bytes": steps,
            "sharded_state": 4 * padded + steps,
            "largest_unit_unsharded": 2 * largest * compute_size,
            "peak_state": 4 * padded + steps + 2 * largest * compute_size,
            "ddp_state": 5 * full + steps}


def batch(args, rank):
    """This rank's batch; with --tp the ranks of one tp group share theirs."""
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank // args.tp)
    inputs = torch.randint(args.vocab, (args.batch, args.ctx), generator=generator)
    targets = torch.randint(args.vocab, (args.batch, args.ctx), generator=generator)
    return inputs, targets


def train_step(model, optimizer, inputs, targets, times=None):
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    t3 = time.perf_counter()
    if times is not None:
        times["fwd"].append(t1 - t0)
        times["bwd"].append(t2 - t1)
        times["opt"].append(t3 - t2)
        times["step"].append(t3 - t0)


def full_parameters(model):
    out = []
    for p in model.parameters():
        p = p.detach()
        if hasattr(p, "full_tensor"):
            p = p.full_tensor()
        out.append(p.float())
    return out


# ---------------------------------------------------------------------------------------------
# Memory

PAGE = os.sysconf("SC_PAGE_SIZE")


def read_pss():
    with open("/proc/self/smaps_rollup", "rb") as f:
        for line in f:
            if line.startswith(b"Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def read_rss():
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


class MemorySampler(threading.Thread):
    """Samples RSS every interval; reads PSS on every new RSS high (+1 MiB) and every 0.5 s."""

    def __init__(self, interval_s):
        super().__init__(daemon=True)
        self.interval = interval_s
        self.done = threading.Event()
        self.peak_rss = self.peak_pss = 0
        self.samples = self.pss_reads = 0

    def run(self):
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        rss_at_pss, last_pss = -1, 0.0
        try:
            while True:
                rss = int(os.pread(fd, 256, 0).split()[1]) * PAGE
                self.samples += 1
                self.peak_rss = max(self.peak_rss, rss)
                now = time.monotonic()
                if rss >= rss_at_pss + MB or now - last_pss > 0.5:
                    self.peak_pss = max(self.peak_pss, read_pss())
                    self.pss_reads += 1
                    rss_at_pss, last_pss = max(rss_at_pss, rss), now
                if self.done.wait(self.interval):
                    break
        finally:
            os.close(fd)

    def stop(self):
        self.done.set()
        self.join()


def tensor_bytes():
    """Bytes of CPU memory that live tensors' storages cover (DTensors by their local tensor).

    Storages are merged by address range, not counted by identity: a tensor made over another
    storage's memory (torch.from_numpy of a view, as a shard's local tensor may be) would
    otherwise count those bytes twice."""
    seen = {}
    with warnings.catch_warnings():
        # isinstance() on torch.distributed's deprecated reduce_op object warns.
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [obj for obj in objects if isinstance(obj, torch.Tensor)]
    del objects
    for obj in tensors:
        try:
            local = obj._local_tensor if hasattr(obj, "_local_tensor") else obj
            storage = local.untyped_storage()
        except Exception:  # noqa: BLE001 - meta tensors, exotic subclasses
            continue
        if storage.device.type == "cpu" and storage.nbytes():
            ptr = storage.data_ptr()
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
    total, covered_to = 0, 0
    for ptr, nbytes in sorted(seen.items()):
        end = ptr + nbytes
        if end > covered_to:
            total += end - max(ptr, covered_to)
            covered_to = end
    return total


def step_peak_allocated(step, trace_path):
    """Peak rise of torch's CPU allocator total within the second of two profiled steps."""
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("fsdp_step.1"):
            step()
        with record_function("fsdp_step.2"):
            step()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(trace_path)
    span = next(e for e in events if e.get("name") == "fsdp_step.2" and e.get("ph") == "X")
    begin, end = span["ts"], span["ts"] + span["dur"]
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                    if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    before = [total for ts, total in memory if ts < begin]
    inside = [total for ts, total in memory if begin <= ts <= end]
    start = before[-1] if before else 0
    return max([start] + inside) - start


def reduce_ring_bytes(model):
    """Bytes of dptc fully_shard's shared reduce ring (two buffers per shard group and reduce
    dtype, see [Note: reduce inputs in shared memory] in dptc/fsdp/_unit.py): the reductions'
    inputs lie there, outside torch's allocator, so neither the profiler nor tensor_bytes()
    sees them.  The ring keeps its pages from step to step, so all of it is counted as live
    throughout a step (an upper bound: a buffer holds a reduction's input from its layout to
    its end)."""
    state = model.__dict__.get("_dptc_fsdp_state")
    if state is None:
        return 0
    return sum(memoryview(buffer).nbytes for ring in state.root.rings.values()
               for buffer in ring.buffers)


# ---------------------------------------------------------------------------------------------
# Rank side

def init_ranks(args, impls):
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=max(60, args.deadline)))
    if any(i.startswith("dptc") for i in impls):
        import dptc
        dptc.init_process_group()


def finish(impls):
    dist.barrier()
    if any(i.startswith("dptc") for i in impls):
        import dptc
        dptc.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


def time_role(args):
    init_ranks(args, args.impls)
    rank, nranks = dist.get_rank(), dist.get_world_size()
    base = build(args)
    th = theory(base, nranks, args)
    phases = ["compute"] + list(args.impls)
    models = {name: wrap(name, copy.deepcopy(base), args) for name in phases}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    inputs, targets = batch(args, rank)
    times = {name: {k: [] for k in ("fwd", "bwd", "opt", "step")} for name in phases}
    for name in phases:
        for _ in range(args.warmup):
            train_step(models[name], optimizers[name], inputs, targets)
    for i in range(args.steps):
        for name in (phases if i % 2 == 0 else phases[::-1]):
            dist.barrier()
            train_step(models[name], optimizers[name], inputs, targets, times[name])
    # Slowest rank per step, then the median over steps.
    medians = {}
    for name in phases:
        medians[name] = {}
        for key, values in times[name].items():
            tensor = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            medians[name][key] = statistics.median(tensor.tolist())
    # The wrapped copies started equal and took the same steps (compute: on rank 0's batch only).
    full = {name: full_parameters(models[name]) for name in args.impls}
    initial = full_parameters(base)
    diffs = {f"{a} vs initial": max((x - y).abs().max().item()
                                    for x, y in zip(full[a], initial)) for a in args.impls}
    for a in args.impls:
        for b in args.impls:
            if a < b:
                diffs[f"{a} vs {b}"] = max((x - y).abs().max().item()
                                           for x, y in zip(full[a], full[b]))
    result = {"rank": rank, "nranks": nranks, "medians": medians, "param_diff": diffs,
              "theory": th, "torch": torch.__version__,
              "dptc": os.path.dirname(sys.modules["dptc"].__file__) if "dptc" in sys.modules
              else None, "omp": os.environ.get("OMP_NUM_THREADS")}
    write_result(args, "time", result, rank)
    if args.out is None and rank == 0:
        print_time_table(result, args)
    finish(args.impls)


def memory_role(args):
    impl = args.impls[0]
    # The baseline: torch and its gloo group up, the same modules imported in every memory
    # launch (dptc's package, torch's fully_shard and DTensor), no dptc group, no model.
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=max(60, args.deadline)))
    import dptc.ddp  # noqa: F401
    import dptc.fsdp  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    rank, nranks = dist.get_rank(), dist.get_world_size()
    inputs, targets = batch(args, rank)
    gc.collect()
    base_rss, base_pss = read_rss(), read_pss()
    base_tensors = tensor_bytes()
    init_ranks(args, [impl])
    model = build(args)
    th = theory(model, nranks, args)
    model = wrap(impl, model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(times=None):
        train_step(model, optimizer, inputs, targets, times)

    for _ in range(args.warmup):
        step()
    # Step time alone in the process (no sampler), then the sampled steps.
    dist.barrier()
    alone = {k: [] for k in ("fwd", "bwd", "opt", "step")}
    for _ in range(args.memory_steps):
        step(alone)
    dist.barrier()
    sampler = MemorySampler(args.sample_ms / 1e3)
    if args.sample_ms > 0:
        sampler.start()
    times = {k: [] for k in ("fwd", "bwd", "opt", "step")}
    try:
        for _ in range(args.memory_steps):
            step(times)
    finally:
        if args.sample_ms > 0:
            sampler.stop()
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gc.collect()
    held = tensor_bytes() - base_tensors
    dist.barrier()
    trace = os.path.join(args.out or tempfile.gettempdir(), f"trace-{impl}-{rank}.json")
    peak_extra = step_peak_allocated(step, trace)
    ring = reduce_ring_bytes(model) if impl == "dptc-fsdp" else 0
    result = {"rank": rank, "impl": impl, "theory": th, "ring": ring,
              "base_rss": base_rss, "base_pss": base_pss,
              "peak_rss": sampler.peak_rss, "peak_pss": sampler.peak_pss,
              "ru_maxrss": ru_maxrss,
              "samples": sampler.samples, "pss_reads": sampler.pss_reads,
              "held": held, "peak_live": held + peak_extra + ring,
              "step_alone": statistics.median(alone["step"]),
              "step": statistics.median(times["step"])}
    write_result(args, f"memory-{impl}", result, rank)
    finish([impl])


def write_result(args, name, result, rank):
    if args.out is None:
        return
    path = os.path.join(args.out, f"{name}.rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------
# Launcher side

def launch(args, argv, role, impls, out, log, timeout):
    """One torchrun launch of this script; returns (exit status or 'killed', seconds)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    # No checkout on PYTHONPATH: each rank runs this script, whose put_checkout_on_path picks
    # this checkout's dptc or the installed one as the launcher did (after a plain pip install
    # the unbuilt source tree would shadow the installed dptc).
    env.setdefault("DPTC_TIMEOUT", str(int(max(30, timeout))))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.ranks}", os.path.abspath(__file__), *argv,
               "--role", role, "--impls", ",".join(impls), "--out", out]
    start = time.monotonic()
    with open(log, "w") as logfile:
        process = subprocess.Popen(command, env=env, stdout=logfile, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            status = process.wait(timeout=timeout)
        except BaseException:
            # torchrun forwards SIGTERM to its workers; then make sure nothing is left.
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            if sys.exc_info()[0] is not subprocess.TimeoutExpired:
                raise
            status = "killed"
    return status, time.monotonic() - start


def read_results(out, name, nranks):
    results = []
    for rank in range(nranks):
        path = os.path.join(out, f"{name}.rank{rank}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            results.append(json.load(f))
    return results


def tail(path, lines=15):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def strip_launcher_args(argv):
    """argv less the options only the launcher reads."""
    kept, skip = [], False
    takes_value = {"--ranks", "--nproc", "--json", "--deadline", "--impls"}
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in takes_value or name in ("--no-memory", "--keep-logs"):
            skip = "=" not in arg and name in takes_value
            continue
        kept.append(arg)
    return kept


def launcher(args, argv):
    import dptc  # noqa: F401 - fail here, not in every rank, when dptc is not importable
    start = time.monotonic()
    out = tempfile.mkdtemp(prefix="fsdp_step.")
    child_argv = strip_launcher_args(argv) + ["--deadline", str(args.deadline)]
    plan = [("time", list(args.impls))]
    if not args.no_memory:
        plan += [("memory", [impl]) for impl in args.impls]
    statuses = {}
    for index, (role, impls) in enumerate(plan):
        left = args.deadline - (time.monotonic() - start)
        # The timing launch may take all but 25 s per memory launch (at least half of the
        # time); the memory launches share what is left.
        share = left / (len(plan) - index)
        if index == 0:
            share = max(left / 2, left - 25 * (len(plan) - 1))
        if share < 10:
            print(f"# skipped {role} {','.join(impls)}: deadline reached", flush=True)
            if index == 0:
                break
            continue
        name = role if role == "time" else f"memory-{impls[0]}"
        log = os.path.join(out, f"{name}.log")
        status, seconds = launch(args, child_argv, role, impls, out, log, share)
        statuses[name] = status
        got = read_results(out, name, args.ranks) is not None
        print(f"# launch {name}: {seconds:.1f} s, exit {status}, "
              f"results {'complete' if got else 'MISSING, log ' + log}", flush=True)
        if not got or (status not in (0, "killed") and "terminate called" not in tail(log)):
            print(tail(log), end="", flush=True)
    timing = read_results(out, "time", args.ranks)
    memory = {impl: read_results(out, f"memory-{impl}", args.ranks) for impl in args.impls}
    report(args, timing, memory)
    complete = timing is not None and (args.no_memory or
                                       all(r is not None for r in memory.values()))
    if complete and not args.keep_logs:
        shutil.rmtree(out, ignore_errors=True)
        print(f"# total {time.monotonic() - start:.1f} s")
    else:
        print(f"# total {time.monotonic() - start:.1f} s; logs in {out}")
    return 0 if timing is not None else 1


# ---------------------------------------------------------------------------------------------
# Reporting

def mib(n):
    return f"{n / MB:.1f}"


def header(args, th, nranks, torch_version, omp):
    reshard = args.reshard_after_forward
    print(f"# fsdp_step: {nranks} ranks, torch {torch_version}, OMP_NUM_THREADS={omp}, "
          f"mp {args.mp}{', matrices on Shard(-1)' if args.shard_last else ''}"
          f"{', embeddings frozen' if args.freeze_embeddings else ''}"
          f"{f', blocks reshard_after_forward={reshard}' if reshard is not None else ''}"
          f"{f', tensor-parallel MLPs (tp={args.tp})' if args.tp > 1 else ''}"
          f"{', every block compiled' if args.compile else ''}")
    print(f"# model: examples/gpt.py build_gpt(vocab={args.vocab}, d_model={args.d_model}, "
          f"n_layer={args.layers}, n_head={args.n_head}, ctx={args.ctx}), "
          f"{th['params'] / 1e6:.2f} M parameters ({mib(th['full_bytes'])} MiB fp32); "
          f"batch {args.batch}x{args.ctx} per rank; AdamW")


def print_time_table(result, args):
    header(args, result["theory"], result["nranks"], result["torch"], result["omp"])
    print(f"# timing: all phases in the same processes, interleaved step by step; "
          f"{args.warmup} warm-up + {args.steps} timed steps each; median over steps of the "
          f"slowest rank")
    print(f"{'phase':>22} {'step ms':>9} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8}")
    for name, m in result["medians"].items():
        print(f"{LABELS[name]:>22} {m['step'] * 1e3:9.1f} {m['fwd'] * 1e3:8.1f} "
              f"{m['bwd'] * 1e3:8.1f} {m['opt'] * 1e3:8.1f}")
    for pair, diff in result["param_diff"].items():
        print(f"# max |full parameter difference| {pair} after {args.warmup + args.steps} "
              f"steps: {diff:.3g}")


def report(args, timing, memory):
    print()
    th = None
    if timing is not None:
        t0 = timing[0]
        th = t0["theory"]
        print_time_table(t0, args)
    else:
        print("# timing launch: no results")
    rows = {impl: res for impl, res in memory.items() if res is not None}
    if rows:
        th = th or next(iter(rows.values()))[0]["theory"]
        print(f"# memory: one launch per implementation; max over ranks; baseline = after "
              f"imports and gloo init, before dptc's group and the model; peak PSS sampled "
              f"(statm every {args.sample_ms:g} ms, Pss on each new RSS high); held = live "
              f"tensor bytes between steps; ring = dptc's shared reduce ring, outside the "
              f"allocator; peak live = held + allocator peak inside a step (profiler) + ring")
        print(f"{'impl':>18} {'alone ms':>8} {'smpl ms':>8} {'maxrss':>7} {'peakPSS':>8} "
              f"{'basePSS':>8} {'PSS-base':>8} {'held':>7} {'theory':>7} {'held/th':>7} "
              f"{'ring':>5} {'peakLive':>8} "
              f"{'thPeak':>7}   (MiB)")
        for impl, res in rows.items():
            m = {k: max(r[k] for r in res) for k in ("ru_maxrss", "peak_pss", "base_pss",
                                                     "held", "peak_live", "step",
                                                     "step_alone", "ring")}
            m["pss_delta"] = max(r["peak_pss"] - r["base_pss"] for r in res)
            state = th["ddp_state"] if impl == "dptc-ddp" else th["sharded_state"]
            peak = th["ddp_state"] if impl == "dptc-ddp" else th["peak_state"]
            print(f"{LABELS[impl]:>18} {m['step_alone'] * 1e3:8.1f} {m['step'] * 1e3:8.1f} "
                  f"{mib(m['ru_maxrss']):>7} "
                  f"{mib(m['peak_pss']):>8} {mib(m['base_pss']):>8} {mib(m['pss_delta']):>8} "
                  f"{mib(m['held']):>7} {mib(state):>7} {m['held'] / state:7.3f} "
                  f"{mib(m['ring']):>5} "
                  f"{mib(m['peak_live']):>8} {mib(peak):>7}")
            rows[impl] = m
        print(f"# theory: sharded state = 4 x {mib(th['padded_share_bytes'])} MiB padded share "
              f"+ step counters = {mib(th['sharded_state'])} MiB; peak = that + largest unit's "
              f"unsharded params + grads {mib(th['largest_unit_unsharded'])} MiB = "
              f"{mib(th['peak_state'])} MiB; DDP: 5 x {mib(th['full_bytes'])} MiB (4 + buckets) "
              f"+ counters = {mib(th['ddp_state'])} MiB")
    # The summary, last.
    print()
    print(f"== summary against torch fully_shard ({args.ranks} ranks, mp {args.mp}) ==")
    print(f"{'impl':>18} {'step ms':>8} {'step/torch':>10} {'peakPSS':>8} {'PSS/torch':>9} "
          f"{'(PSS-base)/torch':>16} {'held/theory':>16}")
    tmed = timing[0]["medians"] if timing is not None else {}
    torch_mem = rows.get("torch-fsdp")
    for impl in args.impls:
        step = tmed.get(impl, {}).get("step")
        tstep = tmed.get("torch-fsdp", {}).get("step")
        m = rows.get(impl)
        cells = [f"{step * 1e3:8.1f}" if step else f"{'-':>8}",
                 f"{step / tstep:10.2f}" if step and tstep else f"{'-':>10}"]
        if m:
            state = th["ddp_state"] if impl == "dptc-ddp" else th["sharded_state"]
            ratio = m["held"] / state
            ok = "ok" if abs(ratio - 1) <= 0.10 else "OFF"
            cells += [f"{mib(m['peak_pss']):>8}",
                      f"{m['peak_pss'] / torch_mem['peak_pss']:9.2f}" if torch_mem else
                      f"{'-':>9}",
                      f"{m['pss_delta'] / torch_mem['pss_delta']:16.2f}" if torch_mem else
                      f"{'-':>16}",
                      f"{ratio:8.3f} {'(' + ok + ')':>7}"]
        else:
            cells += [f"{'-':>8}", f"{'-':>9}", f"{'-':>16}", f"{'-':>16}"]
        print(f"{LABELS[impl]:>18} " + " ".join(cells))
    print("# held/theory: live tensor bytes between steps over the sharded state (DDP: the full "
          "state); ok = within 10%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "timing": timing,
                       "memory": memory}, f, indent=1)


# ---------------------------------------------------------------------------------------------
# Entry point

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return launcher(args, argv)
    if args.role == "time":
        time_role(args)
    else:
        memory_role(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
