"""Rank-side bodies of tests/test_compile.py: dptc's wrappers under torch.compile.

Every rank builds the same GPT (examples/gpt.py, seed 0, float64 so that the comparisons
below see wrong numbers, not rounding), wraps and compiles it the way a scenario says, trains
STEPS steps of AdamW on its rows of a seeded global batch, and beside it trains a plain eager
copy in-process on the whole global batch (the reference).  A scenario's result, per rank:
    params      {name: flat list}, the trained full parameters
    ref_rel     max over parameters of max|p - p_ref| / max|p_ref|
    breaks      {reason: count} of dynamo's graph breaks
    frames      frames dynamo compiled (counters["stats"]["unique_graphs"])
    graphs      graphs AOTAutograd compiled (DDP's compiled forward: one per bucket)
"""

import contextlib
import functools
import gc
import os
import traceback

import torch
import torch.nn.functional as F

from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from examples.gpt import Block, PermutationWalk, build_gpt
from tests._rank import load_impl
from tests._compare import max_rel
from tests.workers_fsdp import _full

__all__ = ["train_cases", "SCENARIOS"]

SEED = 0
STEPS = 2
ROWS_PER_RANK = 2
GPT = dict(vocab=64, d_model=96, n_layer=2, n_head=2, ctx=16)

SMALL_BUCKET_CAP_MB = 0.25
BUCKET_CAP_MB = 1    # DDP buckets of 1 MiB: the float64 GPT's 1.9 MB in 2 buckets

# name: (wrapper, how it is compiled, backend).  Inductor's C++ kernels take most of the time
# with a cold cache (a fresh CI machine: 43 s for one GPT's kernels on 2 cores), so inductor
# compiles nanoGPT's path and the others run aot_eager: the same dynamo frames, graph breaks,
# DDPOptimizer split and AOTAutograd graphs, the ops run eagerly.  Under inductor every
# scenario also gives torch's parameters bit for bit (run by hand with COMPILE_BACKEND=inductor).
SCENARIOS = {
    "ddp_outer": ("ddp", "outer", "aot_eager"),     # torch.compile(DDP(model))
    # DDP(torch.compile(model)), as nanoGPT's train.py
    "ddp_inner": ("ddp", "inner", "inductor"),
    # Buckets under DDPOptimizer's first bucket (1 MiB): torch's compiled DDP raises its
    # AssertionError; dptc's forward compiles whole (dptc only, against the reference).
    "ddp_small_buckets": ("ddp", "outer_small", "aot_eager"),
    # block.compile() then fully_shard(block)
    "fsdp_blocks": ("fsdp", "blocks", "aot_eager"),
    "fsdp_outer": ("fsdp", "outer", "aot_eager"),   # torch.compile of the fully sharded model
    # torch.compile(FullyShardedDataParallel(model)), use_orig_params=True: the same hooks as
    # fully_shard's; run by hand (bit-identical to torch's), not in the suite, for its time.
    "fsdp1_outer": ("fsdp1", "outer", "aot_eager"),
}


def _wrap(impl, model, wrapper, how, backend):
    """(the wrapped and compiled model, a context manager under which ``model``'s parameters
    are full)."""
    compile_fn = functools.partial(torch.compile, backend=backend)
    if impl == "dptc":
        import dptc
        DDP, fully_shard = dptc.DistributedDataParallel, dptc.fully_shard
        FSDP = dptc.FullyShardedDataParallel
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel as DDP
    if wrapper == "fsdp1":
        policy = ModuleWrapPolicy({Block})
        root = FSDP(model, auto_wrap_policy=policy, use_orig_params=True,
                    device_id=torch.device("cpu"))
        return compile_fn(root), functools.partial(FSDP.summon_full_params, root)
    if wrapper == "ddp":
        if how == "inner":
            return DDP(compile_fn(model), bucket_cap_mb=BUCKET_CAP_MB), contextlib.nullcontext
        cap = SMALL_BUCKET_CAP_MB if how == "outer_small" else BUCKET_CAP_MB
        return compile_fn(DDP(model, bucket_cap_mb=cap)), contextlib.nullcontext
    for block in model.blocks:
        if how == "blocks":
            block.compile(backend=backend)
        fully_shard(block)
    fully_shard(model)
    return (compile_fn(model) if how == "outer" else model), contextlib.nullcontext


def _loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _breaks(counters):
    """Dynamo's graph breaks: {first line of the reason and the line naming the function,
    count}."""
    breaks = {}
    for reason, count in counters["graph_break"].items():
        lines = [line.strip() for line in reason.splitlines() if line.strip()]
        key = " | ".join(lines[:1] + [line for line in lines if "context" in line][:1])
        breaks[key[:300]] = breaks.get(key[:300], 0) + count
    return breaks


def _run(impl, name):
    from torch._dynamo.utils import counters
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    wrapper, how, backend = SCENARIOS[name]
    backend = os.environ.get("COMPILE_BACKEND", backend)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(SEED)
    model = build_gpt(**GPT).double()
    ref = build_gpt(**GPT).double()
    ref.load_state_dict(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    wrapped, full_params = _wrap(impl, model, wrapper, how, backend)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    walk = PermutationWalk(GPT["vocab"], GPT["ctx"], seed=SEED + 1)
    losses = []
    for step in range(STEPS):
        x, y = walk.batch(step, ROWS_PER_RANK * world)
        mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        loss = _loss(wrapped, x[mine], y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        _loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with full_params():
        params = [_full(p).detach().clone() for p in model.parameters()]
    worst = max_rel(params, [r.detach() for r in ref.parameters()])
    return {
        "ok": True, "losses": losses, "ref_rel": worst,
        "params": {n: p.flatten().tolist() for n, p in zip(names, params)},
        "breaks": _breaks(counters),
        "frames": counters["stats"].get("unique_graphs", 0),
        "graphs": counters["aot_autograd"].get("total", 0),
    }


def run_cases(run, impl, scenarios):
    """Runs run(impl, name) for each named scenario; returns {name: result}.  One failing
    scenario does not stop the others (its result says why).  Destroys the process group
    at the end."""
    results = {}
    for name in scenarios:
        try:
            results[name] = run(impl, name)
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"ok": False, "error": traceback.format_exc()}
        gc.collect()
    if impl == "dptc":
        import dptc
        dptc.destroy_process_group()
    else:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return results


def train_cases(impl, scenarios):
    """Runs each named scenario; returns {name: result} (see run_cases)."""
    return run_cases(_run, impl, scenarios)
