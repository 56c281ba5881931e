"""Rank-side bodies of tests/test_fsdp_compile.py: fully_shard composed with torch.compile
and activation checkpointing the ways torchtitan and the FSDP2 documentation do it.

Every rank builds the same GPT (examples/gpt.py, seed 0, float64, so that the comparisons
see wrong numbers, not rounding), applies a scenario's transformations with dptc's or torch's
fully_shard (only the import differs), trains STEPS steps of AdamW on its rows of a seeded
global batch, and beside it trains a plain eager copy in-process on the whole batch (the
reference).  A scenario's result, per rank:
    params      {name: flat list}, the trained full parameters (names of the plain model)
    losses      this rank's loss at every step
    ref_rel     max over parameters of max|p - p_ref| / max|p_ref|
    breaks      {reason: count} of dynamo's graph breaks
    frames      graphs dynamo made, after each step (counters["stats"]["unique_graphs"],
                cumulative): one made after the first step is a recompilation
    traced      frames dynamo traced, graph or none, after each step (counters["frames"]
                ["total"], cumulative, recompilations included)
    graphs      graphs AOTAutograd compiled
"""

import os

import torch
import torch.nn.functional as F

from examples.gpt import PermutationWalk, build_gpt
from tests._rank import load_impl
from tests.workers_compile import _breaks, run_cases
from tests._compare import max_rel
from tests.workers_fsdp import _full

__all__ = ["train_cases", "SCENARIOS"]

SEED = 0
STEPS = 3
ROWS_PER_RANK = 2
GPT = dict(vocab=64, d_model=96, n_layer=2, n_head=2, ctx=16)

# name: how the model is built.
#   ac: checkpoint_wrapper on every block first (torchtitan's apply_ac).
#   blocks: "module": torch.compile(block) put back into model.blocks (torchtitan's
#       apply_compile), so fully_shard wraps the OptimizedModule; "method": block.compile()
#       in place, so fully_shard's hooks are inside the compiled call.
#   model: "function": model = torch.compile(model) after fully_shard; "method":
#       model.compile().
#   fullgraph: passed to every torch.compile.
#   step: the training step (forward, loss and backward) is one compiled function, so
#       autograd calls fully_shard's backward hooks inside it.
# Every scenario runs with torch._dynamo.config.error_on_recompile, as a user guarding against
# recompilation sets it: a recompilation raises (torch's fully_shard recompiles nothing here).
#   backend: inductor for torchtitan's order; the others aot_eager: dynamo's frames, graph
#       breaks and AOTAutograd graphs as with inductor, the ops run eagerly (inductor's C++
#       kernels cost tens of seconds a GPT on 2 cores with a cold cache).  Under inductor
#       every scenario also gives torch's numbers bit for bit (COMPILE_BACKEND=inductor).
SCENARIOS = {
    # torchtitan: apply_ac, apply_compile (fullgraph), apply_fsdp
    "ac_compile_blocks": dict(ac=True, blocks="module", fullgraph=True, backend="inductor"),
    "ac_compile_blocks_method": dict(ac=True, blocks="method", fullgraph=True),
    "compile_model": dict(model="function"),
    "ac_compile_model_method": dict(ac=True, model="method"),
    "compile_step": dict(step=True),
}
BACKEND = "aot_eager"


def _apis(impl):
    if impl == "dptc":
        import dptc
        return dptc.fully_shard, dptc.checkpoint_wrapper
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    return fully_shard, checkpoint_wrapper


def _apply(impl, model, scenario):
    """model with the scenario's activation checkpointing, compilation and sharding, in
    torchtitan's order; returns the module to call."""
    ac, blocks, whole = scenario.get("ac"), scenario.get("blocks"), scenario.get("model")
    fullgraph, backend = scenario.get("fullgraph", False), scenario["backend"]
    fully_shard, checkpoint_wrapper = _apis(impl)
    for index, block in enumerate(list(model.blocks)):
        if ac:
            block = checkpoint_wrapper(block)
        if blocks == "module":
            block = torch.compile(block, backend=backend, fullgraph=fullgraph)
        elif blocks == "method":
            block.compile(backend=backend, fullgraph=fullgraph)
        model.blocks[index] = block
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if whole == "function":
        return torch.compile(model, backend=backend, fullgraph=fullgraph)
    if whole == "method":
        model.compile(backend=backend, fullgraph=fullgraph)
    return model


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _run(impl, name):
    from torch._dynamo.utils import counters
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    scenario = dict(SCENARIOS[name])
    scenario["backend"] = os.environ.get("COMPILE_BACKEND", scenario.get("backend", BACKEND))
    torch._dynamo.reset()
    torch._dynamo.config.error_on_recompile = True
    counters.clear()
    torch.manual_seed(SEED)
    model = build_gpt(**GPT).double()
    ref = build_gpt(**GPT).double()
    ref.load_state_dict(model.state_dict())
    names = [n for n, _ in ref.named_parameters()]
    wrapped = _apply(impl, model, scenario)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)

    def train_step(x, y):
        loss = _loss(wrapped, x, y)
        loss.backward()
        return loss
    if scenario.get("step"):
        train_step = torch.compile(train_step, backend=scenario["backend"])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    walk = PermutationWalk(GPT["vocab"], GPT["ctx"], seed=SEED + 1)
    losses, ref_losses, frames, traced = [], [], [], []
    for step in range(STEPS):
        x, y = walk.batch(step, ROWS_PER_RANK * world)
        mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        loss = train_step(x[mine], y[mine])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        frames.append(counters["stats"].get("unique_graphs", 0))
        traced.append(counters["frames"].get("total", 0))
        ref_loss = _loss(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    params = [_full(p).detach().clone() for p in model.parameters()]
    worst = max_rel(params, [r.detach() for r in ref.parameters()])
    return {
        "ok": True, "losses": losses, "ref_losses": ref_losses, "ref_rel": worst,
        "params": {n: p.flatten().tolist() for n, p in zip(names, params)},
        "breaks": _breaks(counters), "frames": frames, "traced": traced,
        "graphs": counters["aot_autograd"].get("total", 0),
    }


def _run_once(impl, name):
    """_run, leaving dynamo's error_on_recompile off after it, whatever happened."""
    try:
        return _run(impl, name)
    finally:
        torch._dynamo.config.error_on_recompile = False


def train_cases(impl, scenarios):
    """Runs each named scenario; returns {name: result} (see workers_compile.run_cases)."""
    return run_cases(_run_once, impl, scenarios)
