"""Training step time of dptc's DistributedDataParallel against torch's (gloo), same run.

    python benchmarks/ddp_step.py                 # starts 2 ranks itself
    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_step.py
    python benchmarks/ddp_step.py --impl torch    # torch DDP on both sides: ratios near 1.0

One GPT-style model (examples/gpt.py) is copied three times on every rank: one copy runs with no
wrapper (the compute-only step), one inside torch's DDP, one inside dptc's DDP.  A step is
zero_grad, forward, cross-entropy, backward and AdamW on the same fixed batch.  Six phases are
timed, taking turns step by step (A B C ..., then ... C B A, ...; --block for longer turns) so
that the machine's noise falls on all of them alike:

    compute     the unwrapped model
    torch DDP   torch.nn.parallel.DistributedDataParallel on gloo
    dptc DDP    dptc.DistributedDataParallel
    torch comm  torch.distributed.all_reduce of the gradient bytes, in bucket_cap_mb pieces
    dptc comm   dptc.all_reduce of the same, where dptc's DDP reduces them: in place in
                private memory (the gradients autograd made), or on a shared buffer with
                --bucket-view (the buckets the gradients are views of)
    copy        a plain copy of the gradient bytes, private memory to private memory

Before every comm step each rank writes fresh values into its gradient pieces (untimed), as
backward does before DDP's all-reduce: repeated on data nobody rewrote, the in-place all-reduce
of 27.5 MiB at 2 ranks took 2.4 ms on the development machine (its vCPUs on separate cores),
against 3.5 ms on freshly written data.  The copy phase tells how the machine ran.  Its 2 vCPUs
sometimes behave as two threads of one physical core: a cache line goes from one to the other
and back in 0.1 us, and the copy of 27.5 MiB takes about 2.4 ms.  At other times as separate
cores: 0.5 us, the copy about 1.2 ms, and data one rank has just written reaches the other at
about 8 GB/s.  The all-reduce's cost, and with it DDP's efficiency, follows.

Each phase's time is the median over its timed steps of the slowest rank's step.  The ranks
meet before each turn at dptc's barrier, which lets them go within microseconds of each other
(with --impl torch, at gloo's); --sync gloo meets at torch.distributed's barrier on gloo
instead, after which a step that synchronises the ranks (either DDP) measured about 1 to 1.5 ms
slower, as gloo's ranks leave its barrier further apart.  The share of the communication
hidden behind backward is

    hidden = 1 - (ddp_step - compute_step) / comm_time, clipped to [0, 1]

(1: the wrapper costs nothing over compute; 0: it costs the whole all-reduce or more).  The
scaling efficiency, compute / dptc DDP, is printed from the two medians and as the median over
turns of each turn's ratio: a turn's two steps run next to each other, so when the machine
speeds up or slows down during the run (the compute step moved between 60 and 78 ms from one
run to the next on the development machine) the change cancels within a turn.  Next to it,
compute / (compute + dptc comm): the efficiency of a step that added its all-reduce and
nothing else, which is what a rank with no core to spare for communication can reach.
"""

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _checkout import put_checkout_on_path

put_checkout_on_path()

from dptc.bench import import_dptc, run_under_torchrun, staging_line  # noqa: E402
from examples.gpt import build_gpt  # noqa: E402

MB = 1 << 20


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to start when not already under torchrun (default 2)")
    parser.add_argument("--impl", default="dptc", choices=("dptc", "torch"),
                        help="what runs on dptc's side: dptc, or torch DDP and gloo on a group "
                             "of their own, to check the benchmark (ratios near 1.0)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank (default 1)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP bucket size for both wrappers, and the piece size of the "
                             "comm-only phases (default 25, torch's default)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per phase")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per phase")
    parser.add_argument("--block", type=int, default=1,
                        help="consecutive steps of one phase before the next phase runs "
                             "(default 1: the phases take turns every step)")
    parser.add_argument("--bucket-view", action="store_true",
                        help="gradient_as_bucket_view=True on both wrappers")
    parser.add_argument("--sync", choices=("dptc", "gloo"),
                        help="the barrier the ranks meet at before each turn (default: dptc's; "
                             "gloo's with --impl torch)")
    parser.add_argument("--hook", choices=("none", "python"), default="none",
                        help="python: both wrappers run a Python comm hook (torch's "
                             "allreduce_hook under another name, all-reducing over gloo); the "
                             "comm phases still time the collectives DDP runs without one")
    parser.add_argument("--join", action="store_true",
                        help="every wrapped step runs inside its wrapper's join() (even "
                             "inputs: what join()'s own collectives cost per step)")
    parser.add_argument("--compile", choices=("none", "inner", "outer"), default="none",
                        help="torch.compile every model: inner compiles the module each "
                             "wrapper wraps (DDP(torch.compile(m)), as nanoGPT's train.py), "
                             "outer the wrapper (torch.compile(DDP(m))); the unwrapped model "
                             "is compiled either way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--timeout", type=float, default=600,
                        help="torch.distributed init timeout in seconds (default 600)")
    args = parser.parse_args(argv)
    if args.sync is None:
        args.sync = "dptc" if args.impl == "dptc" else "gloo"
    for name in ("steps", "block", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.bucket_cap_mb <= 0:
        parser.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    return args


# ---------------------------------------------------------------------------------------------
# The two sides

def wrap_test_side(impl, model, bucket_cap_mb, bucket_view=False):
    """(label, wrapped model, all_reduce) for dptc's side of the comparison."""
    if impl == "dptc":
        dptc = import_dptc()
        dptc.init_process_group()
        wrapped = dptc.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                               gradient_as_bucket_view=bucket_view)
        return "dptc", wrapped, dptc.all_reduce
    group = dist.new_group(backend="gloo")
    wrapped = TorchDDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb,
                       gradient_as_bucket_view=bucket_view)
    return "torch*", wrapped, lambda tensor: dist.all_reduce(tensor, group=group)


def python_allreduce_hook(state, bucket):
    """torch's allreduce_hook under another name, so that neither wrapper recognises it: each
    bucket goes through Python and torch.distributed's all-reduce (gloo)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.allreduce_hook(state, bucket)


def train_step(model, optimizer, inputs, targets):
    optimizer.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()


def comm_step(all_reduce, pieces):
    for piece in pieces:
        all_reduce(piece)


def refresh(buffer, source):
    """Writes fresh gradient values into buffer, untimed, before a comm step."""
    return lambda: buffer.copy_(source)


def gradient_pieces(model, bucket_cap_mb, allocate=None):
    """A zeroed buffer as large as the gradients, cut into bucket_cap_mb views.

    allocate(numel, dtype) makes the buffer (torch.zeros by default); dptc's side uses its
    shared buffers, where its DDP keeps its buckets."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"the comm-only phase assumes one parameter dtype, got {dtypes}")
    dtype = dtypes.pop()
    allocate = allocate or (lambda numel, dtype: torch.zeros(numel, dtype=dtype))
    buffer = allocate(sum(p.numel() for p in params), dtype)
    per_piece = max(1, int(bucket_cap_mb * MB) // buffer.element_size())
    return buffer, list(buffer.split(per_piece))


# ---------------------------------------------------------------------------------------------
# Timing

# Read before every turn, untimed: more than the caches hold.
SETTLE_BYTES = 64 * MB


def run_phases(phases, args, barrier, prepare=None):
    """Warms every phase up, then times them interleaved, the ranks meeting at `barrier` before
    each turn; prepare[name], where given, runs untimed before each of that phase's steps.
    Before each turn every rank reads SETTLE_BYTES of scratch memory, so that what the previous
    phase left in the caches (dirty lines to write back) does not fall on the next one.
    Returns {name: [seconds per step]}."""
    prepare = prepare or {}
    scratch = torch.ones(SETTLE_BYTES // 4)
    nothing = lambda: None  # noqa: E731
    for name, step in phases.items():
        for _ in range(args.warmup):
            prepare.get(name, nothing)()
            step()
    samples = {name: [] for name in phases}
    names = list(phases)
    block_index = 0
    while min(len(s) for s in samples.values()) < args.steps:
        order = names if block_index % 2 == 0 else names[::-1]
        for name in order:
            count = min(args.block, args.steps - len(samples[name]))
            for k in range(count):
                prepare.get(name, nothing)()
                if k == 0:
                    scratch.sum()
                    barrier()
                start = time.perf_counter()
                phases[name]()
                samples[name].append(time.perf_counter() - start)
        block_index += 1
    return samples


def slowest_rank(seconds):
    """Per step, the largest time any rank took for it."""
    tensor = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def slowest_rank_median(seconds):
    """Median over steps of the largest time any rank took for that step."""
    return statistics.median(slowest_rank(seconds))


def paired_efficiency(compute, wrapped):
    """Median over turns of compute / wrapped, each turn's two steps (slowest rank) taken
    next to each other: a drift of the machine's speed during the run, which moves both
    phases' medians but not in step, cancels within a turn."""
    return statistics.median(c / w for c, w in zip(compute, wrapped))


def hidden_share(step, compute, comm):
    if comm <= 0:
        return float("nan")
    return min(1.0, max(0.0, 1.0 - (step - compute) / comm))


def max_parameter_difference(a, b):
    return max((x.detach() - y.detach()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


# ---------------------------------------------------------------------------------------------
# Entry point

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        if args.impl == "dptc":
            import_dptc()
        return run_under_torchrun([os.path.abspath(__file__)], argv, args.nproc)

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, nranks = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    base = build_gpt(vocab=args.vocab, d_model=args.d_model, n_layer=args.n_layer,
                     n_head=args.n_head, ctx=args.ctx)
    models = {name: copy.deepcopy(base) for name in ("compute", "torch", "test")}
    inner = torch.compile if args.compile == "inner" else (lambda model: model)
    outer = torch.compile if args.compile == "outer" else (lambda model: model)
    torch_ddp = TorchDDP(inner(models["torch"]), bucket_cap_mb=args.bucket_cap_mb,
                         gradient_as_bucket_view=args.bucket_view)
    label, test_ddp, test_all_reduce = wrap_test_side(args.impl, inner(models["test"]),
                                                      args.bucket_cap_mb, args.bucket_view)
    if args.hook == "python":
        for wrapped in (torch_ddp, test_ddp):
            wrapped.register_comm_hook(None, python_allreduce_hook)
    compute_model = models["compute"]
    torch_model, test_model = torch_ddp, test_ddp     # what each phase steps
    if args.compile != "none":
        compute_model = torch.compile(compute_model)
        torch_model, test_model = outer(torch_ddp), outer(test_ddp)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4)
                  for name, model in models.items()}

    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    inputs = torch.randint(args.vocab, (args.batch, args.ctx), generator=generator)
    targets = torch.randint(args.vocab, (args.batch, args.ctx), generator=generator)
    buffer, pieces = gradient_pieces(base, args.bucket_cap_mb)
    test_buffer, test_pieces = buffer, pieces
    if args.impl == "dptc":
        import dptc
        # Where dptc's DDP reduces: the gradients themselves, or its shared buckets.
        shared = dptc.group.default_group().empty_shared if args.bucket_view else None
        test_buffer, test_pieces = gradient_pieces(base, args.bucket_cap_mb, shared)
    source = torch.randn(buffer.numel(), generator=generator).to(buffer.dtype)
    copy_target = torch.empty_like(buffer)

    phases = {
        "compute": lambda: train_step(compute_model, optimizers["compute"], inputs, targets),
        "torch DDP": lambda: train_step(torch_model, optimizers["torch"], inputs, targets),
        f"{label} DDP": lambda: train_step(test_model, optimizers["test"], inputs, targets),
        "torch comm": lambda: comm_step(dist.all_reduce, pieces),
        f"{label} comm": lambda: comm_step(test_all_reduce, test_pieces),
        "copy": lambda: copy_target.copy_(source),
    }
    prepare = {"torch comm": refresh(buffer, source), f"{label} comm": refresh(test_buffer, source)}
    barrier = import_dptc().barrier if args.sync == "dptc" else dist.barrier
    with contextlib.ExitStack() as joins:
        if args.join:
            joins.enter_context(torch_ddp.join())
            joins.enter_context(test_ddp.join())
        samples = run_phases(phases, args, barrier, prepare)
    slowest = {name: slowest_rank(s) for name, s in samples.items()}
    medians = {name: statistics.median(s) for name, s in slowest.items()}
    paired = paired_efficiency(slowest["compute"], slowest[f"{label} DDP"])
    # Both wrapped copies started equal and took the same steps on the same batches.
    drift = torch.tensor([max_parameter_difference(models["torch"], models["test"])],
                         dtype=torch.float64)
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)

    # dptc's reducer times its end-of-backward callback: the buckets it runs on the calling
    # thread (without overlap, see [Note: overlap] in csrc/reducer.c), the ranks' skew there,
    # and its wait for buckets launched earlier; per step, on the rank where it took longest.
    callback_ms = wait_ms = None
    if args.impl == "dptc":
        stats = test_ddp._reducer_stats()
        steps = max(stats["steps"], 1)
        times = torch.tensor([stats["finalize_seconds"] / steps, stats["wait_seconds"] / steps],
                             dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        callback_ms, wait_ms = (t * 1e3 for t in times.tolist())

    compute = medians["compute"]
    hidden = {side: hidden_share(medians[f"{side} DDP"], compute, medians[f"{side} comm"])
              for side in ("torch", label)}
    ratio = medians["torch DDP"] / medians[f"{label} DDP"]
    if rank == 0:
        params = buffer.numel()
        print(f"# ddp_step: {nranks} ranks, torch {torch.__version__}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"# model: examples/gpt.py build_gpt(vocab={args.vocab}, d_model={args.d_model}, "
              f"n_layer={args.n_layer}, n_head={args.n_head}, ctx={args.ctx}), "
              f"{params / 1e6:.2f} M parameters, {buffer.nbytes / MB:.1f} MiB of gradients "
              f"in {len(pieces)} piece(s) of <= {args.bucket_cap_mb:g} MiB"
              f"{', gradient_as_bucket_view=True' if args.bucket_view else ''}"
              f"{', a Python comm hook (gloo) on both wrappers' if args.hook == 'python' else ''}"
              f"{', every step inside join()' if args.join else ''}"
              f"{f', torch.compile ({args.compile})' if args.compile != 'none' else ''}")
        print(f"# step: batch {args.batch}x{args.ctx} per rank, forward + cross-entropy + "
              f"backward + AdamW; {args.warmup} warm-up and {args.steps} timed steps per phase "
              f"in blocks of {args.block}; time = median over steps of the slowest rank")
        if args.impl == "torch":
            print("# torch*: torch DDP and gloo on a group of their own, standing in for dptc "
                  "(--impl torch); ratios should be near 1.0")
        for name, seconds in medians.items():
            print(f"{name:>14}  {seconds * 1e3:9.2f} ms")
        print(f"step time ratio torch DDP / {label} DDP: {ratio:.2f}")
        excess = medians[f"{label} DDP"] - compute
        bound = compute / (compute + medians[f"{label} comm"])
        print(f"{label} DDP over compute: {excess * 1e3:.2f} ms = "
              f"{excess / medians[f'{label} comm']:.2f} x {label} comm")
        print(f"scaling efficiency compute / {label} DDP: "
              f"{compute / medians[f'{label} DDP']:.3f} (of the medians), "
              f"{paired:.3f} (median over turns); {bound:.3f} if the step added only "
              f"{label} comm")
        if callback_ms is not None:
            print(f"dptc end-of-backward callback: {callback_ms:.2f} ms per step, waiting "
                  f"{wait_ms:.2f} ms of it (mean over the DDP phase's steps; the rank where "
                  f"each took longest)")
        print("hidden share = 1 - (ddp_step - compute_step) / comm_time, clipped to [0, 1]")
        for side in ("torch", label):
            step, comm = medians[f"{side} DDP"], medians[f"{side} comm"]
            print(f"  {side:>6}: 1 - ({step * 1e3:.2f} - {compute * 1e3:.2f}) / "
                  f"{comm * 1e3:.2f} ms = {hidden[side]:.2f}")
        if args.impl == "dptc":
            print(staging_line(import_dptc().group.default_group()))
        print(f"# max |parameter difference| torch DDP vs {label} DDP after "
              f"{args.warmup + args.steps} steps: {drift.item():.3g}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"nranks": nranks, "impl": args.impl, "label": label,
                           "parameters": params, "gradient_bytes": buffer.nbytes,
                           "bucket_cap_mb": args.bucket_cap_mb, "median_s": medians,
                           "ratio_torch_over_test": ratio, "hidden_share": hidden,
                           "paired_efficiency": paired,
                           "max_parameter_difference": drift.item(),
                           "args": vars(args)}, f, indent=1)
    dist.barrier()
    if "dptc" in (args.impl, args.sync):
        import_dptc().destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
