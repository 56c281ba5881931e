"""Rank-side bodies of tests/test_fsdp_wrap.py: policies driving fully_shard, and activation
checkpointing composed with fully_shard and DDP, against single-process training.

The model is examples/gpt.py's GPT in float64 (see workers_fsdp's ADAM_EPS note); each rank
trains on its rows of a seeded global batch, the reference on all of them.
"""

import functools
import json
import os
import tempfile

import torch

from examples.gpt import GPT, Block, build_gpt
from tests._rank import load_impl
from tests._compare import max_rel

__all__ = ["policy_case", "checkpointing_case", "peak_allocated"]

SEED = 99
LR = 1e-3
ROWS = 4
STEPS = 2


def build(d_model=32, n_layer=3, ctx=16):
    torch.manual_seed(SEED)
    return build_gpt(vocab=64, d_model=d_model, n_layer=n_layer, n_head=4, ctx=ctx,
                     bias=False).double()


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _params_rel(model, ref):
    return max_rel([_full(p).detach() for p in model.parameters()],
                   [r.detach() for r in ref.parameters()])


def train(model, ref, rank, world, steps=STEPS, rows=ROWS, tokens=9, step_hook=None):
    """Trains model on this rank's rows and ref (if any) on all of them; returns the max
    relative parameter difference afterwards (None without ref)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR) if ref is not None else None
    generator = torch.Generator().manual_seed(SEED + 1)
    mine = slice(rank * rows, (rank + 1) * rows)
    loss_of = GPT.loss
    for _ in range(steps):
        idx = torch.randint(0, 64, (rows * world, tokens), generator=generator)
        x, y = idx[:, :-1], idx[:, 1:]

        def step():
            loss_of(model(x[mine]), y[mine]).backward()
        if step_hook is not None:
            step_hook(step)
        else:
            step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if ref is not None:
            loss_of(ref(x), y).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
    return _params_rel(model, ref) if ref is not None else None


def _unit_names(model):
    import dptc
    return sorted(name or "<root>" for name, module in model.named_modules()
                  if isinstance(module, dptc.FSDPModule))


def policy_case():
    """fully_shard_by_policy with torch's policies: the units it made, a CustomPolicy's
    override reaching its module, and training against the reference."""
    import dptc
    from dptc import (CustomPolicy, ModuleWrapPolicy, fully_shard_by_policy,
                      size_based_auto_wrap_policy, transformer_auto_wrap_policy)
    load_impl("dptc")
    rank, world = dptc.get_rank(), dptc.get_world_size()
    out = {}
    policies = {
        "transformer": functools.partial(transformer_auto_wrap_policy,
                                         transformer_layer_cls={Block}),
        "module": ModuleWrapPolicy({Block}),
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=5000),
    }
    for name, policy in policies.items():
        model, ref = build(), build()
        fully_shard_by_policy(model, policy)
        out[name] = {"units": _unit_names(model), "ref_rel": train(model, ref, rank, world)}
    model, ref = build(), build()
    blocks = list(model.blocks)
    custom = CustomPolicy(lambda m: {"reshard_after_forward": False} if m is blocks[1]
                          else isinstance(m, Block))
    fully_shard_by_policy(model, custom)
    states = [m.__dict__["_dptc_fsdp_state"] for m in blocks]
    rel = train(model, ref, rank, world)   # the first forward settles reshard_after_forward
    out["custom"] = {"units": _unit_names(model),
                     "reshard_after_forward": [s.reshard_after_forward for s in states],
                     "ref_rel": rel}
    # fully_shard of a list: one unit over two blocks.
    model, ref = build(), build()
    dptc.fully_shard([model.blocks[0], model.blocks[1]])
    dptc.fully_shard(model.blocks[2])
    dptc.fully_shard(model)
    rel = train(model, ref, rank, world)
    out["list"] = {"units": _unit_names(model), "ref_rel": rel,
                   "shared_state": model.blocks[0].__dict__["_dptc_fsdp_state"] is
                   model.blocks[1].__dict__["_dptc_fsdp_state"]}
    dptc.destroy_process_group()
    return out


def peak_allocated(step):
    """Peak rise of torch's CPU allocator over its value when `step` began (profiled)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("measured_step"):
            step()
    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        prof.export_chrome_trace(path)
        with open(path) as file:
            events = json.load(file)["traceEvents"]
    finally:
        os.unlink(path)
    span = next(e for e in events if e.get("name") == "measured_step" and e.get("ph") == "X")
    begin, end = span["ts"], span["ts"] + span["dur"]
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                    if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    before = [total for ts, total in memory if ts < begin]
    inside = [total for ts, total in memory if begin <= ts <= end]
    start = before[-1] if before else 0
    return max([start] + inside) - start


def _checkpointed(model):
    from dptc import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                       checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))
    return model


def checkpointing_case():
    """Activation checkpointing on every block, composed with fully_shard (applied to the
    checkpoint-wrapped blocks, then the root) and with DDP: parameters against the reference,
    state-dict keys, and the peak allocation of one forward+backward with and without it (a
    larger model, 8 layers of d_model 64 and 32 tokens, so activations dominate)."""
    import dptc
    load_impl("dptc")
    rank, world = dptc.get_rank(), dptc.get_world_size()
    out = {}
    def wrap(kind, ac, model):
        if ac:
            _checkpointed(model)
        if kind == "ddp":
            return dptc.DistributedDataParallel(model)
        for block in model.blocks:
            dptc.fully_shard(block)
        return dptc.fully_shard(model)

    for kind in ("fsdp", "ddp"):
        for ac in (False, True):
            ref = build()
            wrapped = wrap(kind, ac, build())
            result = {"ref_rel": train(wrapped, ref, rank, world)}
            keys = list(wrapped.state_dict().keys())
            result["wrapped_keys"] = sum("_checkpoint_wrapped_module" in k for k in keys)
            result["keys_equal_reference"] = (
                [k.removeprefix("module.") for k in keys] == list(ref.state_dict().keys()))
            peaks = []

            def hook(step):
                peaks.append(peak_allocated(step))
            big_wrapped = wrap(kind, ac, build(d_model=64, n_layer=8, ctx=32))
            train(big_wrapped, None, rank, world, steps=2, rows=8, tokens=33, step_hook=hook)
            result["peak"] = peaks[-1]
            out[f"{kind}_{'ac' if ac else 'plain'}"] = result
    dptc.destroy_process_group()
    return out
