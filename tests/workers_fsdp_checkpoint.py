"""Rank-side bodies of tests/test_fsdp_checkpoint.py: checkpointing fully_shard models.

One launch runs ``checkpoint_cases(impl, root, phases)``: ``impl`` is "dptc" (dptc's
fully_shard) or "torch" (torch.distributed.fsdp.fully_shard on gloo), ``root`` the test's
temporary folder (checkpoints and the files the test body compares), ``phases`` the names in
PHASES, run in order.  Each phase's result, per rank, is a dict of numbers keyed by phase name;
a phase that raises reports {"ok": False, "error": traceback} and the later phases still run.

The model is examples/gpt.py's GPT (vocab 64, d_model 32, 2 layers, 4 heads, ctx 16, no biases,
tied tok_emb/head weights) in float64, fully_shard on each block then the root, trained with
AdamW on a global batch of GLOBAL_ROWS sequences that every world size (1, 2, 3) splits evenly;
each rank's loss is the mean over its rows, so every world size trains the same model up to
summation order.  Step s draws its batch from a generator seeded with (SEED, s), so a run that
resumes at step K sees the batches an uninterrupted run sees.

Files under root (written by rank 0, read by later launches and by the test body):
    {impl}_ws{W}_step{K}.pt       {"model", "optim"}: full state dicts at the checkpoint step
    {impl}_ws{W}_final.pt         full parameters after K + M uninterrupted steps
    {impl}_ws{W}_from_{src}.pt    full parameters after loading checkpoint src and M steps
    reset_{impl}_ws{W}.pt         full parameters after reset_parameters on the sharded model
    {impl}_sync/, {impl}_async/   DCP checkpoints (dcp.save / dcp.async_save) at step K
"""

import gc
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from examples.gpt import build_gpt
from tests._rank import load_impl
from tests._compare import max_rel

__all__ = ["checkpoint_cases", "state_dict_after_eval_case", "PHASES", "STEPS_BEFORE", "STEPS_AFTER",
           "GLOBAL_ROWS"]

SEED = 2024
RESET_SEED = 77
LR = 1e-2
WEIGHT_DECAY = 0.1
ADAM_EPS = 1e-8
GLOBAL_ROWS = 12            # divides 1, 2 and 3 ranks
SEQ = 8
STEPS_BEFORE = 3            # K: steps before the checkpoint
STEPS_AFTER = 2             # M: steps after it


# ---------------------------------------------------------------------------------------------
# Model, data, training

def _build(seed=SEED):
    torch.manual_seed(seed)
    return build_gpt(vocab=64, d_model=32, n_layer=2, n_head=4, ctx=16,
                     bias=False).to(torch.float64)


def _shard_last(param):
    """shard_placement_fn: matrices on their last dim, vectors on dim 0."""
    from torch.distributed.tensor import Shard
    return Shard(-1) if param.dim() > 1 else None


def _shard(fsdp, model, shard_placement_fn=None):
    for block in model.blocks:
        fsdp.fully_shard(block, shard_placement_fn=shard_placement_fn)
    fsdp.fully_shard(model, shard_placement_fn=shard_placement_fn)
    return model


def _meta_model(fsdp, shard_placement_fn=None):
    """A sharded GPT built on the meta device, then given (uninitialised) CPU storage."""
    with torch.device("meta"):
        model = _build()
    _shard(fsdp, model, shard_placement_fn)
    model.to_empty(device="cpu")
    return model


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                             eps=ADAM_EPS)


def _batch(step):
    generator = torch.Generator().manual_seed(SEED * 1000 + step)
    idx = torch.randint(0, 64, (GLOBAL_ROWS, SEQ + 1), generator=generator)
    return idx[:, :-1], idx[:, 1:]


def _train(model, opt, steps, rank, world):
    """Trains over the given step numbers; returns this rank's losses (mean over its rows)."""
    rows = GLOBAL_ROWS // world
    mine = slice(rank * rows, (rank + 1) * rows)
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = model.loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reset(model):
    """Per-module re-initialisation with torch's own reset_parameters (GPT has none)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()


# ---------------------------------------------------------------------------------------------
# Measuring

def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _full_params(model):
    """{name: full tensor} of the model's parameters (a collective: every rank calls it)."""
    return {name: _full(p.detach()).clone() for name, p in model.named_parameters()}


def _max_abs(values, refs):
    worst = 0.0
    for key, ref in refs.items():
        worst = max(worst, (values[key].double() - ref.double()).abs().max().item())
    return worst


def _optim_tensors(osd):
    """{"fqn/exp_avg": tensor, ...} of an FQN-keyed optimizer state dict."""
    flat = {}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                flat[f"{fqn}/{key}"] = _full(value)
    return flat


def _losses_diff(mine, theirs):
    return max(abs(a - b) for a, b in zip(mine, theirs, strict=True))


def _chunk(full, rank, world):
    pieces = full.chunk(world)
    return pieces[rank] if rank < len(pieces) else full[:0]


FULL = StateDictOptions(full_state_dict=True)
FULL_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class _Context:
    def __init__(self, impl, root):
        self.impl = impl
        self.root = root
        self.api = load_impl(impl)
        if impl == "dptc":
            import dptc
            dptc.init_process_group()
            self.fsdp = dptc
        else:
            import torch.distributed.fsdp as fsdp
            self.fsdp = fsdp
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tag = f"{impl}_ws{self.world}"
        self.state = {}     # what one phase leaves for the next

    def path(self, name):
        return os.path.join(self.root, name)

    def save0(self, name, obj):
        if self.rank == 0:
            torch.save(obj, self.path(name))
        dist.barrier()


def _all_ranks(flag):
    """True when flag holds on every rank (so that all ranks agree on what runs next)."""
    value = torch.tensor([1 if flag else 0])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _wait(future):
    """dcp.async_save returns a Future, or an AsyncSaveResponse with a staging stager."""
    upload = getattr(future, "upload_completion", future)
    return upload.result()


# ---------------------------------------------------------------------------------------------
# Phases

def phase_meta_full(ctx):
    """Meta-device init, to_empty, then a full state dict from rank 0 (broadcast_from_rank0),
    another one that every rank passes (full_state_dict), and one loaded straight into the meta
    model (no to_empty: set_model_state_dict assigns)."""
    eager = _build()
    reference = {name: p.detach() for name, p in eager.named_parameters()}
    result = {}
    for variant in ("broadcast", "every_rank", "no_to_empty"):
        if variant == "no_to_empty":
            with torch.device("meta"):
                model = _build()
            _shard(ctx.fsdp, model)
        else:
            model = _meta_model(ctx.fsdp)
        tied = model.tok_emb.weight is model.head.weight
        if variant == "every_rank":
            set_model_state_dict(model, eager.state_dict(), options=FULL)
        else:
            set_model_state_dict(model, eager.state_dict() if ctx.rank == 0 else {},
                                 options=BROADCAST)
        # The first forward adopts what load_state_dict(assign=True) put on the modules.
        x, y = _batch(0)
        model.loss(model(x[:1]), y[:1]).backward()
        model.zero_grad()
        full = _full_params(model)
        local = max(
            (p.to_local() - _chunk(reference[name], ctx.rank, ctx.world)).abs().max().item()
            if p.to_local().numel() else 0.0
            for name, p in model.named_parameters())
        result[variant] = {
            "full_diff": _max_abs(full, reference),
            "local_diff": local,
            "tied_after_to_empty": tied,
            "tied_after_load": model.tok_emb.weight is model.head.weight,
            "is_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            "local_rows": {name: p.to_local().shape[0] for name, p in model.named_parameters()},
            "devices": sorted({str(p.device) for p in model.parameters()}),
        }
        if variant == "broadcast":
            ctx.state["meta_model"] = model
    return result


def phase_reset(ctx):
    """Meta init, to_empty, then per-module reset_parameters under a fixed seed; the values are
    saved for the test (against torch's fully_shard and the eager model), then 2 steps train it
    beside an eager model loaded with the same full values."""
    model = _meta_model(ctx.fsdp)
    torch.manual_seed(RESET_SEED)
    _reset(model)
    full = _full_params(model)
    ctx.save0(f"reset_{ctx.tag}.pt", full)
    eager = _build(SEED + 1)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            p.copy_(full[name])
    losses = _train(model, _optimizer(model), range(2), ctx.rank, ctx.world)
    eager_losses = _train(eager, _optimizer(eager), range(2), 0, 1)
    trained = _full_params(model)
    reference = {name: p.detach() for name, p in eager.named_parameters()}
    # This rank's loss is the mean over its rows; the eager loss is over all of them.
    return {"trained_rel": max_rel(trained, reference), "losses": losses,
            "eager_losses": eager_losses,
            "tied": model.tok_emb.weight is model.head.weight}


def phase_train_save(ctx):
    """K steps beside a single-process reference; full state dicts (test 3); dcp.save and
    dcp.async_save; then M more steps (the uninterrupted run), the step after async_save
    running while its upload is in flight."""
    model = ctx.state.get("meta_model") or _meta_model_loaded(ctx)
    opt = _optimizer(model)
    ref = _build()
    ref_opt = _optimizer(ref)
    K, M = STEPS_BEFORE, STEPS_AFTER
    losses = _train(model, opt, range(K), ctx.rank, ctx.world)
    ref_losses = _train(ref, ref_opt, range(K), 0, 1)
    ref_model = {k: v for k, v in ref.state_dict().items()}
    ref_optim = _optim_tensors(get_optimizer_state_dict(ref, ref_opt))
    result = {"ref_losses": ref_losses}

    # Full state dicts: cpu_offload=True gives rank 0 everything and the others nothing.
    msd0 = get_model_state_dict(model, options=FULL_RANK0)
    osd0 = get_optimizer_state_dict(model, opt, options=FULL_RANK0)
    msd = get_model_state_dict(model, options=FULL)
    osd = get_optimizer_state_dict(model, opt, options=FULL)
    result["rank0_only"] = {
        "model_keys": len(msd0), "optim_keys": len(osd0),
        "model_types": sorted({type(v).__name__ for v in msd0.values()}),
        "model_devices": sorted({str(v.device) for v in msd0.values()}),
        "optim_types": sorted({type(v).__name__ for v in _optim_tensors(osd0).values()})
        if osd0 else [],
        "model_rel": max_rel(msd0, ref_model) if msd0 else None,
        "optim_rel": max_rel(_optim_tensors(osd0), ref_optim) if osd0 else None,
        "optim_key_match": sorted(_optim_tensors(osd0)) == sorted(ref_optim) if osd0 else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in osd0.get("param_groups", [])] if osd0 else None,
    }
    result["every_rank"] = {
        "model_keys": len(msd), "model_types": sorted({type(v).__name__ for v in msd.values()}),
        "model_rel": max_rel(msd, ref_model),
        "optim_rel": max_rel(_optim_tensors(osd), ref_optim),
        "model_key_match": sorted(msd) == sorted(ref_model),
    }
    ctx.save0(f"{ctx.tag}_step{K}.pt", {"model": msd0, "optim": osd0})
    # Plain tensors (AdamW's step counters) come back as the live objects: copy them.
    ctx.state["full_at_k"] = tree_map_only(torch.Tensor, torch.clone, (msd0, osd0, msd, osd))

    # Sharded state dicts: DTensors whose local pieces are torch.chunk's rows.
    sharded_model = get_model_state_dict(model)
    sharded_optim = get_optimizer_state_dict(model, opt)
    result["sharded"] = {
        "model_types": sorted({type(v).__name__ for v in sharded_model.values()}),
        "optim_types": sorted({type(v).__name__ for state in sharded_optim["state"].values()
                               for v in state.values()}),
        "local_diff": max(
            (v.to_local() - _chunk(ref_model[k], ctx.rank, ctx.world)).abs().max().item()
            if v.to_local().numel() else 0.0 for k, v in sharded_model.items()),
    }
    dcp.save({"model": sharded_model, "optim": sharded_optim},
             checkpoint_id=ctx.path(f"{ctx.impl}_sync"))
    # async_save uploads from a thread: give it a gloo group of its own (as torchtitan does),
    # so its collectives never interleave with the training thread's.  The step after it runs
    # while the upload is in flight; the checkpoint must still hold step K's state.
    upload_group = dist.new_group(backend="gloo")
    try:
        future = dcp.async_save({"model": get_model_state_dict(model),
                                 "optim": get_optimizer_state_dict(model, opt)},
                                checkpoint_id=ctx.path(f"{ctx.impl}_async"),
                                process_group=upload_group)
    except Exception:  # noqa: BLE001 - reported to the test; training goes on
        future = None
        result["async_error"] = traceback.format_exc()
    losses += _train(model, opt, range(K, K + 1), ctx.rank, ctx.world)
    if future is not None:
        _wait(future)
    result["async_ok"] = _all_ranks(future is not None)
    losses += _train(model, opt, range(K + 1, K + M), ctx.rank, ctx.world)
    ref_losses = _train(ref, ref_opt, range(K, K + M), 0, 1)
    final = _full_params(model)
    ctx.save0(f"{ctx.tag}_final.pt", final)
    ctx.state["uninterrupted"] = (losses, final)
    ctx.state["trained"] = (model, opt)
    result.update({
        "losses": losses,
        "ref_rel": max_rel(final, {n: p.detach() for n, p in ref.named_parameters()}),
        "ref_losses": result["ref_losses"] + ref_losses,
    })
    return result


def _meta_model_loaded(ctx):
    model = _meta_model(ctx.fsdp)
    set_model_state_dict(model, _build().state_dict() if ctx.rank == 0 else {},
                         options=BROADCAST)
    return model


def phase_uninterrupted(ctx):
    """K + M steps without a checkpoint (the run a resumed run must match at this world size)."""
    model = _meta_model_loaded(ctx)
    opt = _optimizer(model)
    losses = _train(model, opt, range(STEPS_BEFORE + STEPS_AFTER), ctx.rank, ctx.world)
    final = _full_params(model)
    ctx.save0(f"{ctx.tag}_final.pt", final)
    ctx.state["uninterrupted"] = (losses, final)
    return {"losses": losses}


def _resume(ctx, source, *, optimizer=True, shard_placement_fn=None, label=None):
    """A fresh sharded model + AdamW (meta init, to_empty: no values), dcp.load of checkpoint
    `source`, set_model/optimizer_state_dict, then M steps.  Returns what the loaded state and
    the continued run measure against the checkpoint's step-K file and the uninterrupted run of
    this launch."""
    model = _meta_model(ctx.fsdp, shard_placement_fn)
    opt = _optimizer(model)
    state = {"model": get_model_state_dict(model)}
    if optimizer:
        state["optim"] = get_optimizer_state_dict(model, opt)
    dcp.load(state, checkpoint_id=ctx.path(source))
    set_model_state_dict(model, state["model"])
    if optimizer:
        set_optimizer_state_dict(model, opt, state["optim"])
    return _continue(ctx, model, opt, source, label)


def _continue(ctx, model, opt, source, label=None):
    """Measures the loaded state against the step-K file of the run that wrote `source`, trains
    M steps, and measures against this launch's uninterrupted run.  The trained parameters go
    to {tag}_from_{label or source}.pt."""
    writer = source.rsplit("_", 1)[0]
    msd0 = get_model_state_dict(model, options=FULL_RANK0)
    osd0 = get_optimizer_state_dict(model, opt, options=FULL_RANK0)
    result = {}
    if ctx.rank == 0:
        saved = torch.load(ctx.path(f"{writer}_ws2_step{STEPS_BEFORE}.pt"))
        result["loaded_model_diff"] = _max_abs(msd0, saved["model"])
        result["loaded_optim_diff"] = _max_abs(_optim_tensors(osd0),
                                               _optim_tensors(saved["optim"]))
        result["loaded_optim_keys"] = sorted(_optim_tensors(osd0)) == \
            sorted(_optim_tensors(saved["optim"]))
    result["tied"] = model.tok_emb.weight is model.head.weight
    losses = _train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), ctx.rank,
                    ctx.world)
    final = _full_params(model)
    ctx.save0(f"{ctx.tag}_from_{label or source}.pt", final)
    own_losses, own_final = ctx.state["uninterrupted"]
    result.update({
        "losses": losses,
        "loss_diff": _losses_diff(losses, own_losses[STEPS_BEFORE:]),
        "param_rel": max_rel(final, own_final),
        "param_abs": _max_abs(final, own_final),
    })
    return result


def phase_resume(ctx, sources):
    """Resumes from each checkpoint in turn; one that fails does not hide the others."""
    results = {}
    for source in sources:
        if not os.path.exists(ctx.path(os.path.join(source, ".metadata"))):
            results[source] = {"ok": False, "error": f"no checkpoint {source} was written"}
            continue
        try:
            results[source] = {"ok": True, **_resume(ctx, source)}
        except Exception:  # noqa: BLE001 - reported to the test
            results[source] = {"ok": False, "error": traceback.format_exc()}
    return results


def phase_resume_shard_last(ctx):
    """dptc's 2-rank checkpoint (every parameter on Shard(0)) into a model whose matrices are
    sharded on their last dim."""
    return _resume(ctx, "dptc_sync", shard_placement_fn=_shard_last, label="dptc_shard_last")


def phase_resume_model_only(ctx):
    """Negative control: the model from the checkpoint but a fresh AdamW."""
    return _resume(ctx, f"{ctx.impl}_sync", optimizer=False)


def phase_resume_full(ctx):
    """Resume from the full state dicts of phase train_save: from rank 0 (broadcast_from_rank0)
    and from every rank (full_state_dict only)."""
    msd0, osd0, msd, osd = ctx.state["full_at_k"]
    result = {}
    for variant in ("broadcast", "every_rank"):
        model = _meta_model(ctx.fsdp)
        opt = _optimizer(model)
        if variant == "broadcast":
            set_model_state_dict(model, msd0, options=BROADCAST)
            set_optimizer_state_dict(model, opt, osd0, options=BROADCAST)
        else:
            set_model_state_dict(model, msd, options=FULL)
            set_optimizer_state_dict(model, opt, osd, options=FULL)
        result[variant] = _continue(ctx, model, opt, f"{ctx.impl}_full")
    return result


def phase_rollback(ctx):
    """Loads step K's checkpoint back into the model that went on training (lazily initialised,
    AdamW state of step K + M) and repeats the M steps."""
    model, opt = ctx.state["trained"]
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=ctx.path(f"{ctx.impl}_sync"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return _continue(ctx, model, opt, f"{ctx.impl}_sync", label="rollback")


PHASES = {
    "rollback": phase_rollback,
    "meta_full": phase_meta_full,
    "reset": phase_reset,
    "train_save": phase_train_save,
    "uninterrupted": phase_uninterrupted,
    "resume_own": lambda ctx: phase_resume(ctx, [f"{ctx.impl}_sync", f"{ctx.impl}_async"]),
    "resume_model_only": phase_resume_model_only,
    "resume_full": phase_resume_full,
    "resume_dptc": lambda ctx: phase_resume(ctx, ["dptc_sync", "dptc_async"]),
    "resume_torch": lambda ctx: phase_resume(ctx, ["torch_sync"]),
    "resume_shard_last": phase_resume_shard_last,
}


def checkpoint_cases(impl, root, phases):
    """Runs the named phases in order; returns {phase: result}.  A failing phase does not stop
    the others (its result says why)."""
    ctx = _Context(impl, root)
    results = {}
    for name in phases:
        started = time.monotonic()
        try:
            value = PHASES[name](ctx)
            results[name] = {"ok": True, **value}
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = time.monotonic() - started
        gc.collect()
    _finish(impl)
    return results


def _finish(impl):
    """The ranks meet, then the implementation's group is destroyed."""
    dist.barrier()
    if impl == "dptc":
        import dptc
        dptc.destroy_process_group()
    else:
        dist.destroy_process_group()


def state_dict_after_eval_case(impl):
    """Saving and loading after an evaluation forward under no_grad, which leaves the root
    unsharded (see [Note: state dicts of an unsharded unit] in dptc/fsdp/_state.py).  After
    one training step and an evaluation forward: the type of every value of
    model.state_dict() and of get_model_state_dict(); then load_state_dict() of the state
    saved before the evaluation, halved, after a second evaluation forward, and 2 more steps.
    Returns the types, the losses and the final full parameters (lists)."""
    ctx = _Context(impl, None)
    model = _shard(ctx.fsdp, _build())
    opt = _optimizer(model)
    losses = _train(model, opt, [0], ctx.rank, ctx.world)
    halved = {k: v.detach() * 0.5 for k, v in model.state_dict().items()}
    x, _ = _batch(100)
    with torch.no_grad():
        model(x)
    out = {"state_dict_types": sorted({type(v).__name__ for v in model.state_dict().values()}),
           "get_model_state_dict_types": sorted({type(v).__name__
                                                 for v in get_model_state_dict(model).values()})}
    with torch.no_grad():
        model(x)
    model.load_state_dict(halved)
    out["losses"] = losses + _train(model, opt, [1, 2], ctx.rank, ctx.world)
    out["params"] = {k: v.flatten().tolist() for k, v in _full_params(model).items()}
    _finish(impl)
    return out
