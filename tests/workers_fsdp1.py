"""Rank-side bodies of tests/test_fsdp1.py: FullyShardedDataParallel (FSDP1's API) from dptc
and from torch (gloo, device_id="cpu"), against single-process training.

The model is examples/gpt.py's GPT in float64 (d_model 32, vocab 64: uneven at 3 ranks),
wrapped with transformer_auto_wrap_policy.  A step is 2 micro-batches (the first under
no_sync()), the wrapper's clip_grad_norm_(1.0), then AdamW.
"""

import copy
import functools
import math
import traceback

import torch

from examples.gpt import GPT, Block
from tests._rank import load_impl
from tests._compare import max_rel
from tests.workers_fsdp_wrap import build

__all__ = ["strategy_cases", "state_cases"]

SEED = 5
LR = 1e-3
ROWS = 4
STEPS = 2


def _api(impl):
    load_impl(impl)
    if impl == "dptc":
        import dptc as api
        api.init_process_group()
        return api, api.FullyShardedDataParallel
    import torch.distributed.fsdp as api
    return api, api.FullyShardedDataParallel


def _wrap(impl, model, strategy, mp=False):
    api, FSDP = _api(impl)
    kwargs = {}
    if mp:
        kwargs["mixed_precision"] = api.MixedPrecision(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
    return FSDP(model, sharding_strategy=getattr(api.ShardingStrategy, strategy),
                auto_wrap_policy=functools.partial(
                    _policy(impl), transformer_layer_cls={Block}),
                device_id="cpu", use_orig_params=True, **kwargs)


def _policy(impl):
    if impl == "dptc":
        from dptc import transformer_auto_wrap_policy
    else:
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    return transformer_auto_wrap_policy


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _backward(wrapped, ref, rank, world, generator):
    """One step's backward: 2 micro-batches, the first under no_sync(); the reference, if
    any, on the whole of each."""
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    for micro in range(2):
        idx = torch.randint(0, 64, (ROWS * world, 9), generator=generator)
        x, y = idx[:, :-1], idx[:, 1:]
        if micro == 0:
            with wrapped.no_sync():
                (GPT.loss(wrapped(x[mine]), y[mine]) / 2).backward()
        else:
            (GPT.loss(wrapped(x[mine]), y[mine]) / 2).backward()
        if ref is not None:
            (GPT.loss(ref(x), y) / 2).backward()


def _train(impl, wrapped, ref, rank, world, steps=STEPS, opt=None, generator=None,
           ref_opt=None):
    import torch.distributed as dist
    opt = opt or torch.optim.AdamW(wrapped.parameters(), lr=LR)
    if ref is not None and ref_opt is None:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    generator = generator or torch.Generator().manual_seed(SEED)
    norms = []
    for _ in range(steps):
        _backward(wrapped, ref, rank, world, generator)
        norms.append(float(wrapped.clip_grad_norm_(1.0)))
        opt.step()
        opt.zero_grad()
        if ref is not None:
            norms[-1] -= float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
            ref_opt.step()
            ref_opt.zero_grad()
    del dist
    return opt, norms


def _torch_full_grads(wrapped, world):
    """The full gradients of torch's FSDP1 (use_orig_params) in wrapped.parameters() order,
    assembled from every rank's flattened pieces at the offsets its handles record: its own
    summon_full_params(with_grads=True) fails under keep_low_precision_grads (it assigns the
    bfloat16 gradient to the float32 flat parameter)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    where = {}
    for module in FSDP.fsdp_modules(wrapped):
        if module._handle is None:
            continue
        flat = module._handle.flat_param
        for param, info, shape in zip(flat._params, flat._shard_param_infos, flat._shapes):
            where[id(param)] = (info.intra_param_start_idx if info.in_shard else None,
                                shape.numel())
    pieces = []
    for i, p in enumerate(wrapped.parameters()):
        start, _ = where[id(p)]
        if start is not None and p.grad is not None:
            pieces.append((i, start, p.grad.double().flatten().tolist()))
    everyone = [None] * world
    dist.all_gather_object(everyone, pieces)
    grads = [[None] * where[id(p)][1] for p in wrapped.parameters()]
    for i, start, values in (piece for rank_pieces in everyone for piece in rank_pieces):
        grads[i][start:start + len(values)] = values
    assert all(v is not None for g in grads for v in g), "a gradient element no rank holds"
    return grads


def _low_precision_grads(impl, rank, world, tied, keep=True):
    """FULL_SHARD under MixedPrecision(bf16, fp32 reduce, keep_low_precision_grads=keep) on
    the float32 GPT, its embedding and head weights tied or not: per step the gradients'
    dtypes and full values after backward (a no_sync micro-batch, then a synced one; the
    second step's backward without zero_grad before it, so it accumulates into the kept
    gradients), each followed by SGD (AdamW refuses bfloat16 gradients on float32
    parameters); then the trained parameters."""
    api, FSDP = _api(impl)
    policy = api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                keep_low_precision_grads=keep)
    model = build(n_layer=2).float()
    if not tied:
        model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    wrapped = FSDP(model, sharding_strategy=api.ShardingStrategy.FULL_SHARD,
                   auto_wrap_policy=functools.partial(_policy(impl),
                                                      transformer_layer_cls={Block}),
                   device_id="cpu", use_orig_params=True, mixed_precision=policy)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(SEED)
    steps = []
    for _ in range(2):
        _backward(wrapped, None, rank, world, generator)
        dtypes = sorted({str(p.grad.dtype) for p in wrapped.parameters() if p.grad is not None})
        if impl == "torch" and keep:
            grads = _torch_full_grads(wrapped, world)
        else:
            with FSDP.summon_full_params(wrapped, writeback=False, with_grads=True):
                grads = [p.grad.double().flatten().tolist() for p in wrapped.parameters()]
        steps.append({"dtypes": dtypes, "grads": grads})
        opt.step()
    opt.zero_grad()
    with FSDP.summon_full_params(wrapped, writeback=False):
        params = [p.detach().double().flatten().tolist() for p in wrapped.parameters()]
    return {"steps": steps, "params": params}


def strategy_cases(impl, strategies, mp_strategies=(), low_precision_grads=False):
    """Per strategy: the parameters' names, the FSDP instances, the parameters after training
    against the reference (or, for mp_strategies, the trained parameters themselves); with
    low_precision_grads, also "low_precision_grads": see _low_precision_grads."""
    import torch.distributed as dist
    _api(impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # torch 2.13's FSDP1 fails to keep low-precision gradients of tied parameters under
    # use_orig_params ("attempting to assign a gradient with dtype BFloat16 to a tensor with
    # grad_dtype Float"): its tied run keeps them in float32 instead, for comparison.
    runs = {"low_precision_grads": dict(tied=False),
            "low_precision_grads_tied": dict(tied=True, keep=impl == "dptc")}
    for name, kwargs in runs.items() if low_precision_grads else ():
        try:
            out[name] = {"ok": True, **_low_precision_grads(impl, rank, world, **kwargs)}
        except Exception:  # noqa: BLE001 - reported to the test
            out[name] = {"ok": False, "error": traceback.format_exc()}
    for strategy in list(strategies) + [f"{s}+bf16" for s in mp_strategies]:
        try:
            mp = strategy.endswith("+bf16")
            # torch's FullyShardedDataParallel.clip_grad_norm_ refuses float64 gradients
            # (it asks vector_norm for a float32 result), so its runs train in float32.
            float32 = mp or impl == "torch"
            model = build(n_layer=2)
            ref = build(n_layer=2) if not mp else None
            if float32:
                model = model.float()
                ref = ref.float() if ref is not None else None
            wrapped = _wrap(impl, model, strategy.removesuffix("+bf16"), mp=mp)
            FSDP = _api(impl)[1]
            names = [n for n, _ in wrapped.named_parameters()]
            with FSDP.summon_full_params(wrapped, writeback=False):
                summoned_names = [n for n, _ in wrapped.named_parameters()]
            _, norms = _train(impl, wrapped, ref, rank, world)
            with FSDP.summon_full_params(wrapped, writeback=False):
                params = [p.detach().clone() for p in wrapped.parameters()]
            result = {"ok": True, "names": names, "summoned_names": summoned_names,
                      "instances": len(FSDP.fsdp_modules(wrapped)),
                      "keys": list(wrapped.state_dict().keys())}
            if ref is not None:
                result["ref_names"] = [n for n, _ in ref.named_parameters()]
                result["ref_rel"] = max_rel(params, [p.detach() for p in ref.parameters()])
                result["norm_diff"] = max(abs(n) for n in norms)
            else:
                result["params"] = [p.double().flatten().tolist() for p in params]
            out[strategy] = result
        except Exception:  # noqa: BLE001 - reported to the test
            out[strategy] = {"ok": False, "error": traceback.format_exc()}
    if impl == "dptc":
        import dptc
        dptc.destroy_process_group()
    else:
        dist.destroy_process_group()
    return out


def state_cases():
    """dptc only, FULL_SHARD: summon_full_params with writeback; FULL_STATE_DICT with
    offload_to_cpu and rank0_only, SHARDED_STATE_DICT; their round trips; and
    optim_state_dict / optim_state_dict_to_load resuming training exactly."""
    import dptc
    from dptc import FullStateDictConfig, StateDictType
    FSDP = dptc.FullyShardedDataParallel
    _api("dptc")
    rank, world = dptc.get_rank(), dptc.get_world_size()
    out = {}
    ref = build(n_layer=2)
    wrapped = _wrap("dptc", build(n_layer=2), "FULL_SHARD")
    generator = torch.Generator().manual_seed(SEED)
    opt, _ = _train("dptc", wrapped, ref, rank, world, generator=generator)

    with FSDP.summon_full_params(wrapped):
        out["summon_rel"] = max_rel([p.detach() for p in wrapped.parameters()],
                                 [p.detach() for p in ref.parameters()])
        with torch.no_grad():
            for p in wrapped.parameters():
                p.add_(1.0)
    out["writeback_rel"] = max_rel([_full(p).detach() for p in wrapped.parameters()],
                                [p.detach() + 1.0 for p in ref.parameters()])
    with FSDP.summon_full_params(wrapped):
        with torch.no_grad():
            for p in wrapped.parameters():
                p.sub_(1.0)

    # State dicts are snapshots (see [Note: FSDP1 state dicts are snapshots]); the clones
    # keep this test independent of that.
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        full = _clone(wrapped.state_dict())
        optim_full = _clone(FSDP.optim_state_dict(wrapped, opt))
    out["full_keys"] = len(full)
    out["full_keys_equal"] = list(full) == list(ref.state_dict()) if rank == 0 else None
    out["full_rel"] = max_rel([full[k] for k in ref.state_dict()], ref.state_dict().values()) \
        if rank == 0 else None
    out["full_plain"] = all(type(v) is torch.Tensor for v in full.values())
    with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
        sharded = _clone(wrapped.state_dict())
        optim_sharded = _clone(FSDP.optim_state_dict(wrapped, opt))
    out["sharded_types"] = sorted({type(v).__name__ for v in sharded.values()})
    out["optim_keys_equal"] = sorted(optim_sharded["state"]) == sorted(
        n for n, p in ref.named_parameters() if p.requires_grad)
    out["sharded_keys_equal"] = list(sharded) == list(ref.state_dict())

    # Continue training from the full and from the sharded state, into fresh wrappers, and
    # against the uninterrupted run.
    uninterrupted = [p.detach().clone() for p in ref.parameters()]
    state = torch.get_rng_state()
    continued = {}
    for kind in ("uninterrupted", "full", "sharded"):
        generator_copy = torch.Generator().manual_seed(SEED + 100)
        if kind == "uninterrupted":
            model, model_opt = wrapped, opt
        else:
            model = _wrap("dptc", build(n_layer=2), "FULL_SHARD")
            model_opt = torch.optim.AdamW(model.parameters(), lr=LR)
            if kind == "full":
                everyone = [full]
                import torch.distributed as dist
                dist.broadcast_object_list(everyone, src=0)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                    model.load_state_dict(everyone[0])
                    model_opt.load_state_dict(FSDP.optim_state_dict_to_load(
                        model, model_opt, _broadcast(optim_full)))
            else:
                with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                    model.load_state_dict(sharded)
                    model_opt.load_state_dict(FSDP.optim_state_dict_to_load(
                        model, model_opt, optim_sharded))
        _train("dptc", model, None, rank, world, steps=1, opt=model_opt,
               generator=generator_copy)
        with FSDP.summon_full_params(model, writeback=False):
            continued[kind] = [p.detach().clone() for p in model.parameters()]
    torch.set_rng_state(state)
    del uninterrupted
    out["resumed_full_rel"] = max_rel(continued["full"], continued["uninterrupted"])
    out["resumed_sharded_rel"] = max_rel(continued["sharded"], continued["uninterrupted"])
    dptc.destroy_process_group()
    return out


def extras_case():
    """dptc, FULL_SHARD, 2 ranks: sync_module_states (rank 1 starts from other weights),
    param_init_fn on a meta-device model (FULL_SHARD and NO_SHARD), ignored_modules (a frozen embedding kept whole), and
    activation checkpointing applied to the blocks after wrapping; each trained against the
    single-process reference."""
    import dptc
    from dptc import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper
    api, FSDP = _api("dptc")
    rank, world = dptc.get_rank(), dptc.get_world_size()
    policy = functools.partial(api.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    out = {}

    ref = build(n_layer=2)
    model = build(n_layer=2)
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    wrapped = FSDP(model, auto_wrap_policy=policy, sync_module_states=True)
    _train("dptc", wrapped, ref, rank, world)
    with FSDP.summon_full_params(wrapped, writeback=False):
        out["sync_rel"] = max_rel([p.detach() for p in wrapped.parameters()],
                               [p.detach() for p in ref.parameters()])

    with torch.device("meta"):
        model = build_meta()
    initialised = []

    def init(module):
        initialised.append(type(module).__name__)
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.fill_(0.25)
    wrapped = FSDP(model, auto_wrap_policy=policy, param_init_fn=init)
    with FSDP.summon_full_params(wrapped, writeback=False):
        values = torch.cat([p.detach().flatten() for p in wrapped.parameters()])
    out["init_all"] = bool((values == 0.25).all())
    out["init_modules"] = len(initialised)

    # NO_SHARD from the meta device: shard groups of one rank, whose unsharded parameters in
    # forward are the shard buffers' memory (see [Note: a shard group of one]).
    with torch.device("meta"):
        model = build_meta()
    wrapped = FSDP(model, auto_wrap_policy=policy, param_init_fn=init,
                   sharding_strategy=api.ShardingStrategy.NO_SHARD)
    ref = build_meta().to_empty(device="cpu")
    with torch.no_grad():
        for p in ref.parameters():
            p.fill_(0.25)
    shards = {(id(m), name): p.to_local().data_ptr() for m in wrapped.modules()
              for name, p in m._parameters.items() if p is not None}
    in_forward = {}

    def record(module, _args):
        for name, param in module._parameters.items():
            if param is not None:
                in_forward[(id(module), name)] = param.data_ptr()
    hooks = [m.register_forward_pre_hook(record) for m in wrapped.modules()
             if m._parameters and not isinstance(m, FSDP)]
    _train("dptc", wrapped, ref, rank, world)
    for hook in hooks:
        hook.remove()
    out["no_shard_params"] = len(shards)
    out["no_shard_in_place"] = sum(in_forward.get(key) == ptr for key, ptr in shards.items())
    # The gradients are all-reduced where autograd left them and become the sharded ones:
    # each in a storage of its own, none laid out in a unit's reduce buffer.
    _backward(wrapped, None, rank, world, torch.Generator().manual_seed(SEED))
    grads = [p.grad.to_local() for p in wrapped.parameters() if p.grad is not None]
    out["no_shard_grads"] = len(grads)
    out["no_shard_grad_storages"] = len({g.untyped_storage().data_ptr() for g in grads})
    wrapped.zero_grad()
    with FSDP.summon_full_params(wrapped, writeback=False):
        # By name: the reference lists its tied weight once, the summoned model at both places.
        mine = dict(wrapped.named_parameters())
        out["no_shard_rel"] = max_rel({name: mine[name] for name, _ in ref.named_parameters()},
                                      dict(ref.named_parameters()))

    ref = build(n_layer=2)
    model = build(n_layer=2)
    for m in (model, ref):
        m.pos_emb.weight.requires_grad_(False)
    wrapped = FSDP(model, auto_wrap_policy=policy, ignored_modules=[model.pos_emb])
    out["ignored_plain"] = not isinstance(model.pos_emb.weight, torch.distributed.tensor.DTensor)
    _train("dptc", wrapped, ref, rank, world)
    with FSDP.summon_full_params(wrapped, writeback=False):
        out["ignored_rel"] = max_rel([p.detach() for p in wrapped.parameters()],
                                  [p.detach() for p in ref.parameters()])

    ref = build(n_layer=2)
    wrapped = FSDP(build(n_layer=2), auto_wrap_policy=policy)
    apply_activation_checkpointing(
        wrapped, checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))
    out["checkpointed"] = sum(type(m).__name__ == "CheckpointWrapper" for m in wrapped.modules())
    _train("dptc", wrapped, ref, rank, world)
    with FSDP.summon_full_params(wrapped, writeback=False):
        out["checkpoint_rel"] = max_rel([p.detach() for p in wrapped.parameters()],
                                     [p.detach() for p in ref.parameters()])
    out["checkpoint_keys"] = list(wrapped.state_dict()) == list(ref.state_dict())
    dptc.destroy_process_group()
    return out


def build_meta():
    from examples.gpt import build_gpt
    return build_gpt(vocab=64, d_model=32, n_layer=2, n_head=4, ctx=16, bias=False).double()


def _clone(state):
    from torch.utils._pytree import tree_map
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, state)


def _broadcast(obj):
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def groups_case():
    """dptc, 4 ranks: process_group as torch's FSDP1 takes it.  FULL_SHARD and NO_SHARD over a
    pair group ({0,1} and {2,3} train two independent models on their own data), and
    HYBRID_SHARD over the pair (shard {0,2}/{1,3}, replicate {0,1}/{2,3}): each against
    single-process training on the data of the ranks it spans, with the mesh and the local
    shard sizes that layout implies."""
    import torch.distributed as dist
    api, FSDP = _api("dptc")
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair, stride = pairs[rank // 2], strided[rank % 2]
    policy = functools.partial(api.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    out = {}
    cases = {"FULL_SHARD": pair, "NO_SHARD": pair, "HYBRID_SHARD": (stride, pair)}
    for strategy, group in cases.items():
        hybrid = isinstance(group, tuple)
        # Pairs see their own data (a seed per pair); the hybrid run spans all 4 ranks.
        seed = SEED if hybrid else SEED + 10 * (rank // 2)
        torch.manual_seed(seed)
        ref, model = build(n_layer=2), build(n_layer=2)
        with torch.no_grad():        # each pair's model starts from its own weights
            for a, b in zip(ref.parameters(), model.parameters()):
                b.copy_(a)
        wrapped = FSDP(model, process_group=group, auto_wrap_policy=policy,
                       sharding_strategy=getattr(api.ShardingStrategy, strategy))
        param = next(wrapped.parameters())
        _train("dptc", wrapped, ref, rank if hybrid else rank % 2, 4 if hybrid else 2,
               generator=torch.Generator().manual_seed(seed))
        with FSDP.summon_full_params(wrapped, writeback=False):
            rel = max_rel([p.detach() for p in wrapped.parameters()],
                          [p.detach() for p in ref.parameters()])
        out[strategy] = {"rel": rel, "mesh": param.device_mesh.mesh.tolist(),
                         "local_rows": param.to_local().shape[0], "rows": param.shape[0]}
    errors = {}
    bad = {"hybrid_one_group": dict(process_group=pair, sharding_strategy=api.ShardingStrategy
                                    .HYBRID_SHARD),
           "full_pair": dict(process_group=(stride, pair)),
           "group_and_mesh": dict(process_group=pair, device_mesh=param.device_mesh),
           "prefetch": dict(backward_prefetch="BACKWARD_PRE")}
    for label, kwargs in bad.items():
        try:
            FSDP(build(n_layer=1), **kwargs)
            errors[label] = None
        except Exception as error:  # noqa: BLE001 - reported to the test
            errors[label] = (type(error).__name__, str(error))
    out["errors"] = errors
    import dptc
    dptc.destroy_process_group()
    return out


def prefetch_case():
    """dptc, 2 ranks, FULL_SHARD over a 2-block GPT: the gathers and reductions each
    prefetch option issues, logged in order, with marks where each block's backward computes
    and forwards (their MLPs' hooks); and the parameters trained against the reference."""
    import dptc
    api, FSDP = _api("dptc")
    rank, world = dptc.get_rank(), dptc.get_world_size()
    policy = functools.partial(api.transformer_auto_wrap_policy, transformer_layer_cls={Block})
    out = {}
    options = {"default": {}, "forward": {"forward_prefetch": True},
               "post": {"backward_prefetch": api.BackwardPrefetch.BACKWARD_POST},
               "none": {"backward_prefetch": None}}
    for label, kwargs in options.items():
        ref = build(n_layer=2)
        wrapped = FSDP(build(n_layer=2), auto_wrap_policy=policy, **kwargs)
        log = []
        names = {id(m.__dict__["_fsdp_state"].unit):
                 name.replace("_fsdp_wrapped_module.", "") or "root"
                 for name, m in wrapped.named_modules() if isinstance(m, FSDP)}
        for fsdp in FSDP.fsdp_modules(wrapped):
            unit = fsdp.__dict__["_fsdp_state"].unit
            _log_calls(unit, names[id(unit)], log)
        for index in (0, 1):
            mlp = wrapped.module.blocks[index].module.mlp
            mlp.register_forward_pre_hook(lambda *_, i=index: log.append(f"forward blocks.{i}"))
            mlp.register_full_backward_pre_hook(
                lambda *_, i=index: log.append(f"backward blocks.{i}"))
        opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
        step = opt.step
        opt.step = lambda: (log.append("step"), step())
        _train("dptc", wrapped, ref, rank, world, steps=2, opt=opt)
        with FSDP.summon_full_params(wrapped, writeback=False):
            rel = max_rel([p.detach() for p in wrapped.parameters()],
                          [p.detach() for p in ref.parameters()])
        # The second step's: the first learns the order units run in.
        log = log[log.index("step") + 1:-1]
        out[label] = {"rel": rel, "log": log}
    dptc.destroy_process_group()
    return out


def _log_calls(unit, name, log):
    """Logs unit.unshard calls that start a gather (the unit was sharded) and unit.reduce."""
    unshard, reduce = unit.unshard, unit.reduce

    def logged_unshard(*args, **kwargs):
        if unit.state == "sharded":
            log.append(f"gather {name}")
        return unshard(*args, **kwargs)

    def logged_reduce(*args, **kwargs):
        log.append(f"reduce {name}")
        return reduce(*args, **kwargs)
    unit.unshard, unit.reduce = logged_unshard, logged_reduce


def legacy_optim_case(impl):
    """FSDP1's optimizer state-dict API from before optim_state_dict (deprecated in torch, still
    there), FULL_SHARD, under torch's FSDP1 or dptc's: full_optim_state_dict (rank0_only and
    not), rekey_optim_state_dict both ways, get_state_dict_type, and three ways back into a
    fresh model: shard_full_optim_state_dict, scatter_full_optim_state_dict (the full state on
    rank 0 only) and sharded_optim_state_dict + flatten_sharded_optim_state_dict, each resuming
    one step against the uninterrupted run."""
    import warnings
    import torch.distributed as dist
    api, FSDP = _api(impl)
    from torch.distributed.fsdp import OptimStateKeyType
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # float32: torch's clip_grad_norm_ refuses float64 gradients (see strategy_cases).
    wrapped = _wrap(impl, build(n_layer=2).float(), "FULL_SHARD")
    ref = build(n_layer=2).float()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt, _ = _train(impl, wrapped, ref, rank, world,
                    generator=torch.Generator().manual_seed(SEED), ref_opt=ref_opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full0 = _clone(FSDP.full_optim_state_dict(wrapped, opt))
        full = _clone(FSDP.full_optim_state_dict(wrapped, opt, rank0_only=False))
        sharded = _clone(FSDP.sharded_optim_state_dict(wrapped, opt))
    out["warnings"] = sorted({type(w.message).__name__ for w in caught
                              if "is being deprecated" in str(w.message)})
    out["rank0_only_keys"] = sorted(full0.get("state", {}))
    out["full_state"] = {name: {key: float(value.double().sum()) for key, value in entry.items()}
                         for name, entry in full["state"].items()}
    out["full_groups"] = [sorted(group["params"]) for group in full["param_groups"]]
    # The single-process run's AdamW state, parameter by parameter.
    out["full_vs_reference"] = max(
        max_rel([full["state"][name][key]], [ref_opt.state[param][key]])
        for name, param in ref.named_parameters() for key in ("exp_avg", "exp_avg_sq"))
    by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, wrapped)
    out["id_keys"] = sorted(by_id["state"])
    back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, wrapped)
    out["rekey_round_trip"] = sorted(back["state"]) == sorted(full["state"]) and all(
        torch.equal(back["state"][n]["exp_avg"], full["state"][n]["exp_avg"])
        for n in full["state"])
    with FSDP.state_dict_type(wrapped, api.StateDictType.FULL_STATE_DICT,
                              api.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        settings = FSDP.get_state_dict_type(wrapped)
    out["settings"] = [str(settings.state_dict_type), type(settings.state_dict_config).__name__,
                       settings.state_dict_config.rank0_only,
                       settings.state_dict_config.offload_to_cpu,
                       type(settings.optim_state_dict_config).__name__]

    def resumed(load):
        generator = torch.Generator().manual_seed(SEED + 100)
        if load is None:
            model, model_opt = wrapped, opt
        else:
            model = _wrap(impl, build(n_layer=2).float(), "FULL_SHARD")
            model.load_state_dict(wrapped.state_dict())
            model_opt = torch.optim.AdamW(model.parameters(), lr=LR)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model_opt.load_state_dict(load(model, model_opt))
        _train(impl, model, None, rank, world, steps=1, opt=model_opt, generator=generator)
        with FSDP.summon_full_params(model, writeback=False):
            return [p.detach().clone() for p in model.parameters()]

    ways = {
        "shard_full": lambda model, o: FSDP.shard_full_optim_state_dict(full, model,
                                                                         optim=o),
        "scatter_full": lambda model, o: FSDP.scatter_full_optim_state_dict(
            full0 if rank == 0 else None, model, optim=o),
        "flatten_sharded": lambda model, o: FSDP.flatten_sharded_optim_state_dict(
            sharded, model, o),
    }
    continued = {name: resumed(load) for name, load in ways.items()}
    uninterrupted = resumed(None)
    out["resumed_rel"] = {name: max_rel(params, uninterrupted)
                          for name, params in continued.items()}
    out["trained"] = [float(p.double().sum()) for p in uninterrupted]
    dist.destroy_process_group()
    return out


def _held(model_state, optim_state):
    """What a rank holds of a state dict pair: {"model"/"optim": [elements held here, elements
    of the full tensors, tensors that are shards]} over tensors of one dimension or more
    (DTensor, torch's ShardedTensor, or plain)."""
    from torch.distributed.tensor import DTensor
    out = {}
    tensors = {"model": list(model_state.values()),
               "optim": [value for entries in optim_state.get("state", {}).values()
                         for value in entries.values()]}
    for part, values in tensors.items():
        held = full = shards = 0
        for value in values:
            if isinstance(value, DTensor):
                local = value.to_local().numel()
            elif hasattr(value, "local_shards"):
                local = sum(shard.tensor.numel() for shard in value.local_shards())
            elif isinstance(value, torch.Tensor):
                local = value.numel()
            else:
                continue
            size = value.size()
            if len(size) == 0:
                continue
            held, full = held + local, full + math.prod(size)
            shards += type(value) is not torch.Tensor
        out[part] = [held, full, shards]
    return out


def dcp_case(impl, path):
    """torch.distributed.checkpoint as torch's FSDP1 tutorial uses it: under
    SHARDED_STATE_DICT, model.state_dict() and FSDP.optim_state_dict into dcp.save; then one
    more step.  Under dptc, after its own save, a fresh dptc FSDP1 also loads torch's
    checkpoint (path/torch, written by the torch launch that ran first) and takes that step.
    Then the same through torch.distributed.checkpoint.state_dict's get_state_dict and
    set_state_dict: by default (shards), with full_state_dict=True, and (dptc only) with
    cpu_offload=True into set_state_dict's broadcast_from_rank0=True.  Returns the full
    parameters after the step (per way), the key lists of the model and optimizer states,
    what a rank holds of each state (_held) and the full state's values."""
    import os
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd
    api, FSDP = _api(impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = api.StateDictType.SHARDED_STATE_DICT

    def save(model, opt, where):
        with FSDP.state_dict_type(model, sharded):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
            dcp.save(state, checkpoint_id=where)
        return list(state["model"])

    def load(where):
        model = _wrap(impl, build(n_layer=2).float(), "FULL_SHARD")
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        with FSDP.state_dict_type(model, sharded):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=where)
            model.load_state_dict(state["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state["optim"]))
        return model, opt

    def step(model, opt):
        _train(impl, model, None, rank, world, steps=1, opt=opt,
               generator=torch.Generator().manual_seed(SEED + 100))
        with FSDP.summon_full_params(model, writeback=False):
            return [p.detach().double().flatten().tolist() for p in model.parameters()]

    wrapped = _wrap(impl, build(n_layer=2).float(), "FULL_SHARD")
    opt, _ = _train(impl, wrapped, None, rank, world)
    out = {"keys": save(wrapped, opt, os.path.join(path, impl))}
    model_state, optim_state = dsd.get_state_dict(wrapped, opt)
    out["dsd_model_keys"] = sorted(model_state)
    out["dsd_optim_keys"] = sorted(optim_state["state"])
    out["dsd_held"] = _held(model_state, optim_state)
    dcp.save({"model": model_state, "optim": optim_state},
             checkpoint_id=os.path.join(path, f"{impl}_dsd"))
    full = dsd.StateDictOptions(full_state_dict=True)
    # Copied: the optimizer's step counters in a state dict are its own tensors, which the
    # step below advances.
    full_model, full_optim = copy.deepcopy(dsd.get_state_dict(wrapped, opt, options=full))
    out["dsd_full"] = {key: value.double().flatten().tolist()
                       for key, value in full_model.items()}
    out["dsd_full_held"] = _held(full_model, full_optim)
    if impl == "dptc":    # torch 2.13's FSDP1 on CPU dies in get_state_dict with cpu_offload
        rank0_model, rank0_optim = copy.deepcopy(dsd.get_state_dict(
            wrapped, opt, options=dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)))
        out["dsd_rank0_held"] = _held(rank0_model, rank0_optim)
    dist.barrier()
    out["continued"] = step(wrapped, opt)
    out["from_own"] = step(*load(os.path.join(path, impl)))
    if impl == "dptc":
        out["from_torch"] = step(*load(os.path.join(path, "torch")))

        def fresh():
            model = _wrap(impl, build(n_layer=2).float(), "FULL_SHARD")
            return model, torch.optim.AdamW(model.parameters(), lr=LR)
        model, model_opt = fresh()
        model_state, optim_state = dsd.get_state_dict(model, model_opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(path, f"{impl}_dsd"))
        dsd.set_state_dict(model, model_opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        out["from_own_dsd"] = step(model, model_opt)
        model, model_opt = fresh()
        dsd.set_state_dict(model, model_opt, model_state_dict=full_model,
                           optim_state_dict=full_optim, options=full)
        out["from_full_dsd"] = step(model, model_opt)
        model, model_opt = fresh()
        # set_state_dict would take rank 1's empty model state for "optimizer only".
        from_rank0 = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        dsd.set_model_state_dict(model, rank0_model, options=from_rank0)
        dsd.set_optimizer_state_dict(model, model_opt, rank0_optim, options=from_rank0)
        out["from_rank0_dsd"] = step(model, model_opt)
    dist.destroy_process_group()
    return out


def _error(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - reported to the test
        return [type(error).__name__, str(error)]
    return None


def comm_hook_case(impl):
    """register_comm_hook, 2 ranks, float32: per (strategy, hook), the trained parameters
    against the single-process reference and as a list (the test compares the two impls),
    and the calls a Python hook saw; then what misuse raises.  Hooks: torch's default ones
    ("default": allreduce_hook under NO_SHARD, reduce_scatter_hook otherwise; dptc runs them
    natively), the same behind a Python function of the test's ("python", over gloo),
    fp16_compress_hook ("fp16"), and its arithmetic written out in the test ("fp16_python",
    over gloo, without the record_stream that fails on CPU)."""
    import torch.distributed as dist
    from torch.distributed.algorithms._comm_hooks import default_hooks
    load_impl("torch")
    api, FSDP = _api(impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in ("NO_SHARD", "FULL_SHARD"):
        default = default_hooks.allreduce_hook if strategy == "NO_SHARD" else \
            default_hooks.reduce_scatter_hook
        calls = []

        def python_hook(state, grad, output=None, default=default, calls=calls):
            calls.append([grad.numel(), None if output is None else output.numel()])
            default(state, grad) if output is None else default(state, grad, output)
        def fp16_python(state, grad, output=None, default=default):
            # torch's fp16_compress_hook without its CUDA-only record_stream, over gloo.
            grad.data = grad.data.to(torch.float16)
            if output is None:
                default(state, grad)
                grad.data = grad.data.to(state.parameter_type)
                return
            output.data = output.data.to(torch.float16)
            default(state, grad, output)
            output.data = output.data.to(state.parameter_type)
        hooks = {"default": (default_hooks.DefaultState(dist.group.WORLD), default),
                 "python": (default_hooks.DefaultState(dist.group.WORLD), python_hook),
                 "fp16": (default_hooks.LowPrecisionState(dist.group.WORLD),
                          default_hooks.fp16_compress_hook),
                 "fp16_python": (default_hooks.LowPrecisionState(dist.group.WORLD),
                                 fp16_python)}
        for name, (state, hook) in hooks.items():
            key = f"{strategy}/{name}"
            try:
                model, ref = build(n_layer=2).float(), build(n_layer=2).float()
                wrapped = _wrap(impl, model, strategy)
                wrapped.register_comm_hook(state, hook)
                _train(impl, wrapped, ref, rank, world)
                with FSDP.summon_full_params(wrapped, writeback=False):
                    params = [p.detach().clone() for p in wrapped.parameters()]
                out[key] = {"ok": True,
                            "ref_rel": max_rel(params, [p.detach() for p in ref.parameters()]),
                            "params": [p.flatten().tolist() for p in params],
                            "calls": list(calls) if name == "python" else None}
                calls.clear()
            except Exception:  # noqa: BLE001 - reported to the test
                out[key] = {"ok": False, "error": traceback.format_exc()}
    # Misuse: each as torch raises it.
    model = _wrap(impl, build(n_layer=2).float(), "FULL_SHARD")
    state = default_hooks.DefaultState(dist.group.WORLD)
    errors = {"not callable": _error(lambda: model.register_comm_hook(state, 3))}
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    errors["twice"] = _error(
        lambda: model.register_comm_hook(state, default_hooks.reduce_scatter_hook))
    x = torch.randint(0, 64, (ROWS, 8))
    model(x).sum().backward()
    inner = FSDP.fsdp_modules(model)[0]
    inner = inner if inner is not model else FSDP.fsdp_modules(model)[1]
    errors["not root"] = _error(
        lambda: inner.register_comm_hook(state, default_hooks.reduce_scatter_hook))
    hybrid = _wrap(impl, build(n_layer=2).float(), "HYBRID_SHARD")
    errors["hybrid"] = _error(
        lambda: hybrid.register_comm_hook(state, default_hooks.reduce_scatter_hook))
    out["errors"] = errors
    if impl == "dptc":
        import dptc
        dptc.destroy_process_group()
    dist.destroy_process_group()
    return out


def meta_init_case(impl):
    """A GPT built on the meta device, wrapped by a transformer auto wrap policy with no
    param_init_fn: FSDP1 materialises it and calls each module's reset_parameters().  Returns
    the full parameters (float64 lists) on rank 0's side, for comparing the two
    implementations' initialisation orders."""
    api, FSDP = _api(impl)
    with torch.device("meta"):
        model = build_meta()
    torch.manual_seed(7)
    wrapped = _wrap(impl, model, "FULL_SHARD")
    with FSDP.summon_full_params(wrapped, writeback=False):
        params = {name.replace("_fsdp_wrapped_module.", ""): p.detach().double().flatten().tolist()
                  for name, p in wrapped.named_parameters()}
    if impl == "dptc":
        api.destroy_process_group()
    return params


def _loss_step(model, opt, rank, world, generator):
    idx = torch.randint(0, 64, (ROWS * world, 9), generator=generator)
    mine = idx[rank * ROWS:(rank + 1) * ROWS]
    loss = GPT.loss(model(mine[:, :-1]), mine[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def snapshot_case(impl):
    """An in-memory rollback, float32 GPT, FULL_SHARD, use_orig_params=False (the default):
    one step, the model's and optimizer's state dicts (FULL, then SHARDED), two more steps,
    both dicts loaded back, the two steps again, and once more from the same dicts.  Returns
    {kind: (losses, losses after the first rollback, after the second)}."""
    api, FSDP = _api(impl)
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        state_dict_type = getattr(api.StateDictType, kind)
        model = FSDP(build(n_layer=2).float(), device_id="cpu",
                     auto_wrap_policy=functools.partial(_policy(impl),
                                                        transformer_layer_cls={Block}))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        generator = torch.Generator().manual_seed(SEED)
        _loss_step(model, opt, rank, world, generator)
        with FSDP.state_dict_type(model, state_dict_type):
            state, optim_state = model.state_dict(), FSDP.optim_state_dict(model, opt)
        resume = generator.get_state()
        runs = []
        for _ in range(3):
            if runs:
                with FSDP.state_dict_type(model, state_dict_type):
                    model.load_state_dict(state)
                    opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, optim_state))
            generator.set_state(resume)
            runs.append([_loss_step(model, opt, rank, world, generator) for _ in range(2)])
        out[kind] = runs
    if impl == "dptc":
        api.destroy_process_group()
    return out


def state_dict_settings_case(impl):
    """set_state_dict_type as scripts use it: what it returns (the settings before, whose
    fields restore them), and a config of the other state-dict type.  Returns what each
    call gave, by name, for comparing the two implementations."""
    api, FSDP = _api(impl)
    model = _wrap(impl, build(n_layer=1).float(), "FULL_SHARD")
    out = {}
    before = FSDP.set_state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT)
    out["returns"] = type(before).__name__
    out["before"] = (before.state_dict_type.name, type(before.state_dict_config).__name__,
                     type(before.optim_state_dict_config).__name__)
    FSDP.set_state_dict_type(model, before.state_dict_type, before.state_dict_config,
                             before.optim_state_dict_config)
    out["restored"] = FSDP.get_state_dict_type(model).state_dict_type.name
    for kind, config in (("SHARDED_STATE_DICT", api.FullStateDictConfig()),
                         ("FULL_STATE_DICT", api.ShardedStateDictConfig())):
        out[f"{kind} with {type(config).__name__}"] = _error(
            lambda: FSDP.set_state_dict_type(model, getattr(api.StateDictType, kind), config))
    out["after errors"] = FSDP.get_state_dict_type(model).state_dict_type.name
    if impl == "dptc":
        api.destroy_process_group()
    return out


def nested_clip_case(impl):
    """clip_grad_norm_ and no_sync() on a nested instance, after a backward: returns what
    each call gave ([type, message], or None) and the root's norm afterwards."""
    api, FSDP = _api(impl)
    model = _wrap(impl, build(n_layer=2).float(), "FULL_SHARD")
    idx = torch.randint(0, 64, (ROWS, 9), generator=torch.Generator().manual_seed(SEED))
    GPT.loss(model(idx[:, :-1]), idx[:, 1:]).backward()
    nested = [m for m in FSDP.fsdp_modules(model) if m is not model][0]
    out = {"nested": _error(lambda: nested.clip_grad_norm_(1e-3)),
           "nested no_sync": _error(lambda: nested.no_sync().__enter__()),
           "root": float(model.clip_grad_norm_(1.0))}
    if impl == "dptc":
        api.destroy_process_group()
    return out


def sync_ignored_case():
    """dptc, 2 ranks: sync_module_states with ignored_modules=[pos_emb] and
    ignored_states=[ln_f.weight], rank 1 starting from other weights.  Returns whether the
    managed parameters are rank 0's and whether the ignored ones are still this rank's."""
    _api("dptc")
    import dptc
    from dptc import FullyShardedDataParallel as FSDP
    rank = dptc.get_rank()
    ref, model = build(n_layer=1), build(n_layer=1)
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    ignored = [model.pos_emb.weight, model.ln_f.weight]
    own = [p.detach().clone() for p in ignored]
    wrapped = FSDP(model, sync_module_states=True, ignored_modules=[model.pos_emb],
                   ignored_states=[model.ln_f.weight], device_id="cpu",
                   auto_wrap_policy=functools.partial(_policy("dptc"),
                                                      transformer_layer_cls={Block}))
    with FSDP.summon_full_params(wrapped, writeback=False):
        managed = {name: p.detach().clone() for name, p in wrapped.named_parameters()
                   if not any(p is q for q in ignored)}
    expected = dict(ref.named_parameters())
    out = {"managed_rel": max_rel(list(managed.values()),
                                  [expected[name].detach() for name in managed]),
           "managed": len(managed),
           "ignored_kept": [bool(torch.equal(p.detach(), q)) for p, q in zip(ignored, own)]}
    dptc.destroy_process_group()
    return out


def post_accumulate_hooks_case(impl, register="register_post_accumulate_grad_hook"):
    """register_post_accumulate_grad_hook on every parameter of a FULL_SHARD float32 GPT, with
    use_orig_params True and False, hooks that only record what they see (`register`: or
    register_hook, whose hooks get the gradient).  Per setting: the hooks' calls in one
    training step ([numel of the tensor the hook got, its gradient's sum])
    or the error the step raised (it is then taken again with the hooks removed), then the
    parameters after a second step without hooks (float64 lists)."""
    api, FSDP = _api(impl)
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for use_orig_params in (True, False):
        model = FSDP(build(n_layer=2).float(), device_id="cpu",
                     use_orig_params=use_orig_params,
                     auto_wrap_policy=functools.partial(_policy(impl),
                                                        transformer_layer_cls={Block}))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        calls = []

        def record(param):
            calls.append([param.numel(), float(param.grad.double().sum())])

        def record_grad(grad):
            calls.append([grad.numel(), float(grad.double().sum())])
        handles = [getattr(p, register)(record if register != "register_hook" else record_grad)
                   for p in model.parameters()]
        generator = torch.Generator().manual_seed(SEED)
        state = generator.get_state()
        error = _error(lambda: _loss_step(model, opt, rank, world, generator))
        for handle in handles:
            handle.remove()
        if error is not None:
            generator.set_state(state)
            _loss_step(model, opt, rank, world, generator)
        _loss_step(model, opt, rank, world, generator)
        with FSDP.summon_full_params(model, writeback=False):
            params = [p.detach().double().flatten().tolist() for p in model.parameters()]
        out[f"use_orig_params={use_orig_params}"] = {
            "calls": calls, "error": error, "params": params,
            "local_numels": [p.numel() if not hasattr(p, "to_local") else p.to_local().numel()
                             for p in model.parameters()]}
    if impl == "dptc":
        api.destroy_process_group()
    return out


class _NormBlock(torch.nn.Module):
    """A block with a BatchNorm, as in the CNNs FSDP1 scripts wrap: Linear, BatchNorm1d, and
    a float buffer of its own."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x):
        return torch.relu(self.norm(self.lin(x))) * self.scale


def _norm_net():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(_NormBlock(), _NormBlock(), torch.nn.Linear(8, 2))


def batch_norm_precision_case(impl):
    """FULL_SHARD, float32, 2 ranks: a network of _NormBlocks under MixedPrecision with an
    auto_wrap_policy (a ModuleWrapPolicy object and a lambda_auto_wrap_policy function), two
    SGD steps.  Per (policy, precision): the warnings naming the modules left in full
    precision, the instances, the buffers' dtypes after training, the trained parameters and
    buffers (float64 lists), or the error."""
    import warnings
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy
    api, FSDP = _api(impl)
    import torch.distributed as dist
    rank = dist.get_rank()
    policies = {"ModuleWrapPolicy": ModuleWrapPolicy({_NormBlock}),
                "lambda": functools.partial(lambda_auto_wrap_policy,
                                            lambda_fn=lambda m: isinstance(m, _NormBlock))}
    precisions = {
        "bf16": api.MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16),
        "buffer_fp16": api.MixedPrecision(buffer_dtype=torch.float16),
        "param_fp64": api.MixedPrecision(param_dtype=torch.float64)}
    out = {}
    for (pname, policy), (mname, mp) in ((p, m) for p in policies.items()
                                         for m in precisions.items()):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = FSDP(_norm_net(), auto_wrap_policy=policy, mixed_precision=mp,
                             device_id="cpu", use_orig_params=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            generator = torch.Generator().manual_seed(SEED + rank)
            for _ in range(2):
                x = torch.randn(4, 8, generator=generator)
                model(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            with FSDP.summon_full_params(model, writeback=False):
                params = [p.detach().double().flatten().tolist() for p in model.parameters()]
            out[f"{pname}/{mname}"] = {
                "warnings": [str(w.message) for w in caught
                             if "mixed precision disabled" in str(w.message)],
                "instances": len(FSDP.fsdp_modules(model)),
                "buffer_dtypes": {name.replace("_fsdp_wrapped_module.", ""): str(b.dtype)
                                  for name, b in model.named_buffers()},
                "buffers": [b.double().flatten().tolist() for b in model.buffers()],
                "params": params}
        except Exception:  # noqa: BLE001 - reported to the test
            out[f"{pname}/{mname}"] = {"error": traceback.format_exc()}
    if impl == "dptc":
        api.destroy_process_group()
    return out


def buffer_state_dict_case(impl):
    """MixedPrecision(buffer_dtype=float16), FULL_SHARD, 2 ranks, a network of _NormBlocks whose
    first block is an instance of its own (the second's buffers are the root's), one training
    step: the buffers' dtypes in the module, in a FULL and in a SHARDED state dict, and the
    state dicts' buffer values (float64 lists), by key."""
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
    api, FSDP = _api(impl)
    import torch.distributed as dist
    rank = dist.get_rank()
    net = _norm_net()
    first = net[0]
    model = FSDP(net, device_id="cpu", use_orig_params=True,
                 mixed_precision=api.MixedPrecision(buffer_dtype=torch.float16),
                 auto_wrap_policy=functools.partial(lambda_auto_wrap_policy,
                                                    lambda_fn=lambda m: m is first))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(SEED + rank))
    model(x).pow(2).mean().backward()
    out = {"module": {name.replace("_fsdp_wrapped_module.", ""): str(b.dtype)
                      for name, b in model.named_buffers() if b.is_floating_point()}}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        with FSDP.state_dict_type(model, getattr(api.StateDictType, kind)):
            state = model.state_dict()
        buffers = {key: value for key, value in state.items() if key in out["module"]}
        out[kind] = {key: [str(value.dtype), value.double().flatten().tolist()]
                     for key, value in buffers.items()}
    if impl == "dptc":
        api.destroy_process_group()
    return out


def summon_forward_case(impl):
    """Forwards inside summon_full_params before any training forward, FULL_SHARD float32 GPT,
    2 ranks, each on a fresh model: the generation pattern (recurse=False, the wrapped
    module called directly, under no_grad), the wrapper's forward in a full summon, and one
    with gradients enabled; each followed by a training step.  Returns per case the output's
    values and the step's loss (or the error), and what summon_full_params inside
    summon_full_params raises, and summon_full_params(rank0_only=True, writeback=True)."""
    api, FSDP = _api(impl)
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(SEED))

    def generation(model):
        with torch.no_grad(), FSDP.summon_full_params(model, recurse=False, writeback=False):
            return model.module(x)

    def full(model):
        with torch.no_grad(), FSDP.summon_full_params(model, writeback=False):
            return model(x)

    def with_grad(model):
        with FSDP.summon_full_params(model, writeback=False):
            return model(x).detach()
    out = {}
    for name, run in (("generation", generation), ("full", full), ("with_grad", with_grad)):
        model = _wrap(impl, build(n_layer=2).float(), "FULL_SHARD")
        try:
            logits = run(model).double().flatten().tolist()
        except Exception as error:  # noqa: BLE001 - reported to the test
            logits = [type(error).__name__, str(error)]
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        out[name] = [logits, _loss_step(model, opt, rank, world,
                                        torch.Generator().manual_seed(SEED))]

    def nested():
        with FSDP.summon_full_params(model, writeback=False):
            with FSDP.summon_full_params(model, writeback=False):
                pass
    out["nested"] = _error(nested)
    out["rank0_writeback"] = _error(lambda: FSDP.summon_full_params(
        model, rank0_only=True, writeback=True).__enter__())
    if impl == "dptc":
        api.destroy_process_group()
    return out


def sync_meta_case():
    """dptc, 2 ranks, the low-memory loading pattern: rank 0 builds the GPT, rank 1 on the
    meta device, FullyShardedDataParallel(sync_module_states=True, param_init_fn=to_empty
    module by module).  With the head untied from the embedding: the largest difference of
    the wrapped parameters from rank 0's, and how many there are.  Tied (to_empty unties
    rank 1's): the error."""
    _api("dptc")
    import dptc
    from dptc import FullyShardedDataParallel as FSDP
    rank = dptc.get_rank()

    def load(tied):
        if rank == 0:
            model = build(n_layer=2).float()
        else:
            with torch.device("meta"):
                model = build(n_layer=2).float()
        if not tied:
            model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
        return FSDP(model, sync_module_states=True, device_id="cpu", use_orig_params=True,
                    param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False),
                    auto_wrap_policy=functools.partial(_policy("dptc"),
                                                       transformer_layer_cls={Block}))
    wrapped = load(tied=False)
    ref = build(n_layer=2).float()
    ref.head.weight = torch.nn.Parameter(ref.head.weight.detach().clone())
    ref = dict(ref.named_parameters())
    with FSDP.summon_full_params(wrapped, writeback=False):
        params = {name: p.detach().clone() for name, p in wrapped.named_parameters()}
    out = {"untied_diff": max(float((params[name] - ref[name].detach()).abs().max())
                              for name in params), "untied_count": len(params),
           "tied": _error(lambda: load(tied=True))}
    dptc.destroy_process_group()
    return out


class _Scale(torch.nn.Module):
    """x * w: an op that takes a float32 input with bfloat16 weights (the result float32)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return x * self.w


def nested_cast_case(impl):
    """Wrapping by hand, 2 ranks: Sequential(Linear, _Scale, Linear) whose _Scale is an
    instance of its own under MixedPrecision(param_dtype=bfloat16) (cast_forward_inputs False,
    cast_root_forward_inputs True: the defaults), inside a root instance without mixed
    precision.  Two SGD steps; returns per step the output's dtype and values and then the
    parameters (float64 lists), or the error."""
    api, FSDP = _api(impl)
    import torch.distributed as dist
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Scale(), torch.nn.Linear(8, 8))
    model[1] = FSDP(model[1], device_id="cpu", use_orig_params=True,
                    mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16))
    model = FSDP(model, device_id="cpu", use_orig_params=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(SEED + rank)
    out = {"steps": []}
    try:
        for _ in range(2):
            y = model(torch.randn(4, 8, generator=generator))
            out["steps"].append([str(y.dtype), y.detach().double().flatten().tolist()])
            y.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        with FSDP.summon_full_params(model, writeback=False):
            out["params"] = [p.detach().double().flatten().tolist() for p in model.parameters()]
    except Exception as error:  # noqa: BLE001 - reported to the test
        out["error"] = [type(error).__name__, str(error)]
    if impl == "dptc":
        api.destroy_process_group()
    return out


def incompatible_keys_case(impl):
    """load_state_dict of a model's own FULL and SHARDED state dicts, with use_orig_params
    True and False, 2 ranks: missing two keys (strict=False), with one unexpected key
    (strict=False), and missing one (strict=True).  Returns what each reported: the missing
    and unexpected keys, or the error's type and message."""
    api, FSDP = _api(impl)
    out = {}
    for use_orig_params in (True, False):
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            model = FSDP(build(n_layer=2).float(), device_id="cpu",
                         use_orig_params=use_orig_params,
                         auto_wrap_policy=functools.partial(_policy(impl),
                                                            transformer_layer_cls={Block}))
            FSDP.set_state_dict_type(model, getattr(api.StateDictType, kind))
            state = model.state_dict()
            missing = {k: v for k, v in state.items()
                       if k not in ("blocks.0.attn.qkv.weight", "ln_f.weight")}
            extra = {**state, "blocks.0.extra": torch.zeros(2)}

            def keys(result):
                return [sorted(result.missing_keys), sorted(result.unexpected_keys)]
            label = f"use_orig_params={use_orig_params}/{kind}"
            out[f"{label}/missing"] = keys(model.load_state_dict(missing, strict=False))
            out[f"{label}/extra"] = keys(model.load_state_dict(extra, strict=False))
            out[f"{label}/strict"] = _error(lambda: model.load_state_dict(
                {k: v for k, v in state.items() if k != "ln_f.weight"}))
    if impl == "dptc":
        api.destroy_process_group()
    return out


def state_dict_order_case(impl):
    """The keys of FULL and SHARDED state dicts, in order, 2 ranks, of a network of
    _NormBlocks whose BatchNorms are instances nested in the blocks' (MixedPrecision with an
    auto_wrap_policy), and of the unwrapped network."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    api, FSDP = _api(impl)
    model = FSDP(_norm_net(), auto_wrap_policy=ModuleWrapPolicy({_NormBlock}),
                 mixed_precision=api.MixedPrecision(torch.bfloat16,
                                                    buffer_dtype=torch.bfloat16),
                 device_id="cpu", use_orig_params=True)
    out = {"plain": list(_norm_net().state_dict())}
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        with FSDP.state_dict_type(model, getattr(api.StateDictType, kind)):
            out[kind] = list(model.state_dict())
    if impl == "dptc":
        api.destroy_process_group()
    return out
