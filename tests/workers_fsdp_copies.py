"""Rank-side bodies of tests/test_fsdp_copies.py: copies of sharded models, as users make them.

An EMA or "best model" copy.  ``impl`` is "dptc" or "torch" (torch's own wrappers on gloo),
``kind`` "fully_shard" (every block, then the root) or "fsdp1" (FullyShardedDataParallel with
each block an instance of its own, use_orig_params=True).

torch 2.13 refuses ``copy.deepcopy`` of a sharded model and ``torch.save`` of the whole of one
(see [Note: copies of a sharded module] in dptc/fsdp/_fully_shard.py), so a case records what
each raises (before the first forward and after training, also for a model whose root alone is
sharded without resharding after forward), then makes the copies the error messages name:
- ``ema``: torch's ``AveragedModel`` (an EMA, ``get_ema_multi_avg_fn``) made before sharding,
  its ``module`` sharded the same way, updated after every step with ``update_parameters``
  (a ``lerp_`` over the DTensor parameters), and evaluated at the end;
- ``best``: a second model built and sharded the same way, loaded from the trained model's
  ``state_dict()`` after PRE steps, then trained beside it (a step of one, then a step of the
  other, each with a fresh AdamW) for POST steps.
Beside them one process trains an unsharded twin (and its EMA) on the whole batch through the
same steps: the reference.
"""

import copy
import io

import torch
from torch.distributed.tensor import DTensor

from examples.gpt import Block
from tests._rank import load_impl
from tests._compare import max_rel
from tests.workers_fsdp import ROWS_PER_RANK, SEED, _build, _finish, _full

__all__ = ["copies_case"]

PRE = 2
POST = 3
LR = 1e-3
HOW = ("deepcopy", "save", "averaged")
EMA = 0.25          # the weight each EMA update gives the model's parameters


def _fsdp1_class(impl):
    if impl == "dptc":
        from dptc import FullyShardedDataParallel
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
    return FullyShardedDataParallel


def _shard(impl, kind, model, root_only=False):
    if kind == "fsdp1":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return _fsdp1_class(impl)(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                  use_orig_params=True, device_id="cpu")
    if impl == "dptc":
        from dptc import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    if root_only:
        return fully_shard(model, reshard_after_forward=False)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _gpt(model):
    """The module with .loss (FSDP1 wraps the GPT)."""
    return model if hasattr(model, "loss") else model.module


def _step(model, opt, x, y, kind):
    """One AdamW step; clipped to norm 1 except under FSDP1 (torch 2.13's FSDP1
    clip_grad_norm_ refuses float64 gradients)."""
    _gpt(model).loss(model(x), y).backward()
    if kind != "fsdp1":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _averaged(model):
    """torch's EMA helper over a copy of the model (AveragedModel deep-copies it)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(1 - EMA))


def _full_params(impl, kind, model):
    """The model's full parameters in the unwrapped model's order (FSDP1's under
    summon_full_params: torch's are pieces of flat parameters otherwise)."""
    if kind != "fsdp1":
        return [_full(p.detach()).clone() for p in model.parameters()]
    with _fsdp1_class(impl).summon_full_params(model, writeback=False):
        return [p.detach().clone() for p in _gpt(model).parameters()]


def _locals(model):
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


def _shared_storages(a, b):
    """How many of b's parameters' (local) storages are also one of a's."""
    mine = {t.untyped_storage().data_ptr() for t in _locals(a) if t.numel()}
    return sum(t.untyped_storage().data_ptr() in mine for t in _locals(b) if t.numel())


def _raised(model, how):
    """[type name, message] of what copying ``model`` raised (copy.deepcopy, torch.save, or
    AveragedModel, which deep-copies it), or None."""
    try:
        if how == "deepcopy":
            copy.deepcopy(model)
        elif how == "averaged":
            _averaged(model)
        else:
            torch.save(model, io.BytesIO())
    except Exception as error:  # noqa: BLE001 - what torch raises is the result
        return [type(error).__name__, str(error)]
    return None


def _batch(world, generator):
    idx = torch.randint(0, 64, (ROWS_PER_RANK * world, 9), generator=generator)
    return idx[:, :-1], idx[:, 1:]


def copies_case(impl, kind):
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    raised = {}
    if kind == "fully_shard":
        root_only = _shard(impl, kind, _build("gpt", torch.float64), root_only=True)
        raised["root_only"] = [_raised(root_only, how) for how in HOW]
    model = _build("gpt", torch.float64)
    ema = _averaged(model)
    ref = _build("gpt", torch.float64)
    ref_ema = _averaged(ref)
    model = _shard(impl, kind, model)
    ema.module = _shard(impl, kind, ema.module)
    raised["before_forward"] = [_raised(model, how) for how in HOW]
    generator = torch.Generator().manual_seed(SEED + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for _ in range(PRE):
        x, y = _batch(world, generator)
        _step(model, opt, x[mine], y[mine], kind)
        _step(ref, ref_opt, x, y, kind)
        ema.update_parameters(model)
        ref_ema.update_parameters(ref)
    raised["trained"] = [_raised(model, how) for how in HOW]
    best = _shard(impl, kind, _build("gpt", torch.float64))
    best.load_state_dict(model.state_dict())
    loaded_rel = max_rel(_full_params(impl, kind, best), _full_params(impl, kind, model))
    models = [model, best]
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for _ in range(POST):
        x, y = _batch(world, generator)
        for m, o in zip(models, opts):
            _step(m, o, x[mine], y[mine], kind)
        _step(ref, ref_opt, x, y, kind)
        ema.update_parameters(model)
        ref_ema.update_parameters(ref)
    # Parameters that are DTensors, of best's and ema's (torch's FSDP1's: none), before the
    # evaluation leaves the root's gathered.
    dtensors = [sum(isinstance(p, DTensor) for p in m.parameters())
                for m in (best, ema.module)]
    x, y = _batch(world, generator)
    with torch.no_grad():
        ema_loss = _gpt(ema.module).loss(ema(x[mine]), y[mine]).item()
        ref_ema_loss = ref_ema.module.loss(ref_ema(x[mine]), y[mine]).item()
    ref_params = [p.detach() for p in ref.parameters()]
    full = {name: _full_params(impl, kind, m)
            for name, m in (("model", model), ("best", best), ("ema", ema.module))}
    result = {
        "raised": raised,
        "dtensors": dtensors,
        "param_count": len(list(best.parameters())),
        "loaded_rel": loaded_rel,
        "model_ref_rel": max_rel(full["model"], ref_params),
        "best_ref_rel": max_rel(full["best"], ref_params),
        "best_model_rel": max_rel(full["best"], full["model"]),
        "ema_ref_rel": max_rel(full["ema"],
                               [p.detach() for p in ref_ema.module.parameters()]),
        "ema_loss": ema_loss, "ref_ema_loss": ref_ema_loss,
        "shared": [_shared_storages(model, best), _shared_storages(model, ema.module)],
        "params": {name: [t.flatten().tolist() for t in params]
                   for name, params in full.items()},
    }
    _finish(impl)
    return result
