"""Rank-side bodies of tests/test_fsdp.py: fully_shard training against references.

Every rank draws the same seeded global batches, trains its sharded model on its slice, and
beside it trains a plain copy of the model in-process on the whole global batch (the
reference).  Each rank's loss is the mean over its rows and fully_shard averages gradients over
ranks, so the reference's loss is the mean over the global batch.  A step is 2 micro-batches
of gradient accumulation (losses halved), clip_grad_norm_(1.0), then AdamW.

``impl`` picks the fully_shard under test: "dptc" or "torch" (torch.distributed.fsdp on gloo).
A scenario's result, per rank (JSON), keyed by scenario name:
    ok         False when the scenario raised; then "error" holds the traceback
    ref_rel    max over parameters of max|p - p_ref| / max|p_ref| (full tensors)
    grad_rel   the same for the gradients before each optimizer step (max over steps)
    params     {name: flat list}, the trained full parameters (cross-impl comparisons)
    local_rows {name: rows of the local shard}, types {name: type of the parameter}
    extra      scenario-specific numbers
"""

import dataclasses
import gc
import os
import time
import traceback

import torch
import torch.nn as nn

from examples.gpt import build_gpt
from tests._rank import load_impl
from tests._compare import max_rel

__all__ = ["train_cases", "memory_case", "reduction_memory_case", "methods_case",
           "staging_case", "ring_case", "all_reduce_hook_case", "frozen_reduce_case",
           "backward_hooks_case", "post_accumulate_hooks_case", "recast_case", "knobs_case"]

SEED = 4321
LR = 1e-3
# At initialisation the attention is nearly uniform, so many query, key and MLP weights get
# gradients of 1e-7 to 1e-6 that are sums of cancelling terms: in float32 their rounding noise
# (the ranks sum in another order than the reference) is ~1e-3 of their value, and AdamW's
# update lr * g / (|g| + eps) turns it into weight differences of ~1e-5 at 3 ranks.  The GPT
# scenarios therefore train in float64, where the same arithmetic differs by ~1e-12 and any
# wrong gradient or shard still shows as ~1e-3; "gpt_fp32" (2 ranks) and "mixed" keep float32.
ADAM_EPS = 1e-8
STEPS = 3
MICRO = 2
ROWS_PER_RANK = 4


@dataclasses.dataclass(frozen=True)
class Scenario:
    model: str = "gpt"                  # "gpt" (tied weights), "odd" (uneven dims), "mixed"
    reshard_after_forward: object = None
    accumulation: str = "sync"          # "sync": reduce every micro-batch; "nosync": only last;
    #                                     "noallreduce" (HSDP): all-reduce across replicas only last
    prefetch: bool = False              # explicit forward/backward prefetch lists
    ignored: bool = False               # pos_emb frozen and passed in ignored_params
    frozen: bool = False                # block 0's attention frozen
    # Every block's ln_attn frozen: backward needs its weight for the block's input gradient
    # after the block's trainable gradients are complete.
    frozen_norms: bool = False
    mp: bool = False                    # bf16 param_dtype, fp32 reduce_dtype
    dtype: torch.dtype = torch.float64  # of the GPT's parameters
    hsdp: bool = False                  # a (replicate=2, shard=world/2) mesh
    output_fp32: bool = False           # with mp: output_dtype=float32
    # An explicit 1-D mesh (init_device_mesh), CPUOffloadPolicy, and AdamW(foreach=True).
    explicit: bool = False
    # Block 0 in step 0: "freeze" (requires_grad_(False) before the first forward, unfrozen
    # for step 1) or "drop" (trainable, its gradients dropped before step 0's clip and step):
    # the same arithmetic, which torch's fully_shard can do only the second way.
    late: str = ""
    reference: bool = True              # train the single-process reference beside it
    # "last": shard_placement_fn puts every parameter of 2 or more dims on Shard(-1), its
    # last dim (the others on Shard(0)).
    placement: str = ""
    # Measure the bytes the first forward leaves held (_tensor_bytes after it, less before).
    forward_bytes: bool = False


SCENARIOS = {
    "gpt": Scenario(),
    "gpt_no_reshard": Scenario(reshard_after_forward=False),
    "gpt_nosync": Scenario(accumulation="nosync"),
    "gpt_prefetch": Scenario(prefetch=True),
    "gpt_ignored": Scenario(ignored=True),
    "gpt_frozen": Scenario(frozen=True),
    "gpt_frozen_norms": Scenario(frozen_norms=True),
    "gpt_frozen_bf16": Scenario(frozen=True, mp=True, reference=False, dtype=torch.float32),
    "gpt_frozen_norms_bf16": Scenario(frozen_norms=True, mp=True, reference=False,
                                      dtype=torch.float32),
    "gpt_nosync_bf16": Scenario(accumulation="nosync", mp=True, reference=False,
                                dtype=torch.float32),
    "odd": Scenario(model="odd"),
    "mixed": Scenario(model="mixed"),
    "gpt_fp32": Scenario(dtype=torch.float32),
    "gpt_explicit": Scenario(explicit=True),
    "gpt_hsdp": Scenario(hsdp=True),
    "odd_hsdp": Scenario(model="odd", hsdp=True),
    "gpt_hsdp_nosync": Scenario(hsdp=True, accumulation="nosync"),
    "gpt_hsdp_noallreduce": Scenario(hsdp=True, accumulation="noallreduce"),
    "gpt_hsdp_bf16": Scenario(hsdp=True, mp=True, reference=False, dtype=torch.float32),
    "gpt_bf16": Scenario(mp=True, reference=False, dtype=torch.float32),
    "odd_bf16": Scenario(model="odd", mp=True, reference=False, output_fp32=True),
    "gpt_unfreeze_bf16": Scenario(mp=True, reference=False, dtype=torch.float32, late="freeze"),
    "gpt_dropgrad_bf16": Scenario(mp=True, reference=False, dtype=torch.float32, late="drop"),
    "gpt_shard_last": Scenario(placement="last"),
    "gpt_no_reshard_shard_last": Scenario(placement="last", reshard_after_forward=False),
    "odd_shard_last": Scenario(model="odd", placement="last"),
    "gpt_hsdp_shard_last": Scenario(hsdp=True, placement="last"),
    "gpt_bf16_shard_last": Scenario(mp=True, reference=False, dtype=torch.float32,
                                    placement="last"),
    # At 4 ranks: reshard_after_forward True, 2 (blocks of 2 ranks) and False, each measuring
    # what the first forward leaves held.
    "gpt_flat": Scenario(forward_bytes=True),
    "gpt_reshard2": Scenario(reshard_after_forward=2, forward_bytes=True),
    "gpt_no_reshard_flat": Scenario(reshard_after_forward=False, forward_bytes=True),
    "odd_reshard2_shard_last": Scenario(model="odd", reshard_after_forward=2, placement="last"),
    "gpt_bf16_reshard2": Scenario(mp=True, reference=False, dtype=torch.float32,
                                  reshard_after_forward=2),
}


def _shard_last(param):
    from torch.distributed.tensor import Shard
    return Shard(-1) if param.dim() > 1 else None


class Odd(nn.Module):
    """Dims that do not divide 2 or 3 ranks, and one (2) smaller than 3 ranks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(7, 5), nn.Linear(5, 2), nn.Linear(2, 3)])
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale


class Mixed(nn.Module):
    """One unit holding float32 and float64 parameters (torch's fully_shard refuses this)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 5)
        self.gate = nn.Parameter(torch.randn(5, 5, dtype=torch.float64) * 0.3)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.inner(x)).double() @ self.gate
        return self.out(h.float())


def _build(name, dtype=torch.float32):
    torch.manual_seed(SEED)
    if name == "gpt":
        return build_gpt(vocab=64, d_model=32, n_layer=2, n_head=4, ctx=16,
                         bias=False).to(dtype)
    if name == "odd":
        return Odd()
    if name == "mixed":
        return Mixed()
    raise ValueError(name)


def _units(model):
    """The modules fully_shard goes on, bottom-up (the root last)."""
    if isinstance(model, Odd):
        return list(model.layers) + [model]
    if isinstance(model, Mixed):
        return [model]
    return list(model.blocks) + [model]


def _batch(name, step, micro, world, generator):
    rows = ROWS_PER_RANK * world
    if name == "gpt":
        idx = torch.randint(0, 64, (rows, 9), generator=generator)
        return idx[:, :-1], idx[:, 1:]
    inputs = {"odd": 7, "mixed": 6}[name]
    outputs = 3
    return torch.randn(rows, inputs, generator=generator), \
        torch.randn(rows, outputs, generator=generator)


_OUT_DTYPES = []


def _loss(model, name, x, y):
    out = model(x)
    _OUT_DTYPES.append(str(out.dtype))
    if name == "gpt":
        return model.loss(out if out.dtype == torch.float64 else out.float(), y)
    return (out.float() - y).square().mean()


def _freeze(model, scenario):
    if scenario.frozen:
        for p in model.blocks[0].attn.parameters():
            p.requires_grad_(False)
    if scenario.frozen_norms:
        for block in model.blocks:
            block.ln_attn.requires_grad_(False)


def _apply(fsdp, model, scenario, impl):
    _freeze(model, scenario)
    kwargs = {}
    if scenario.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = scenario.reshard_after_forward
    if scenario.placement == "last":
        kwargs["shard_placement_fn"] = _shard_last
    if scenario.mp:
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
            output_dtype=torch.float32 if scenario.output_fp32 else None)
    if scenario.explicit:
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["mesh"] = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        kwargs["offload_policy"] = fsdp.CPUOffloadPolicy()
    if scenario.hsdp:
        from torch.distributed.device_mesh import init_device_mesh
        world = torch.distributed.get_world_size()
        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2),
                                          mesh_dim_names=("replicate", "shard"))
    units = _units(model)
    for module in units:
        extra = {}
        if scenario.ignored and module is model:
            model.pos_emb.weight.requires_grad_(False)
            extra["ignored_params"] = {model.pos_emb.weight}
        fsdp.fully_shard(module, **kwargs, **extra)
    if scenario.prefetch:
        for before, after in zip(units[:-2], units[1:-1]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _param_rel(model, ref):
    """The largest relative difference of model's parameters from ref's."""
    return max_rel([_full(p.detach()) for p in model.parameters()],
                   [p.detach() for p in ref.parameters()])


def _sharded_gpt(impl, dtype=torch.float32):
    """The GPT with impl's fully_shard on every unit, its single-process twin, this rank's
    rows of a batch and the world size."""
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    if impl == "dptc":
        import dptc as fsdp
    else:
        import torch.distributed.fsdp as fsdp
    model, ref = _build("gpt", dtype), _build("gpt", dtype)
    for module in _units(model):
        fsdp.fully_shard(module)
    return model, ref, slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK), world


def _run(impl, name, scenario):
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    if impl == "dptc":
        import dptc as fsdp
    else:
        import torch.distributed.fsdp as fsdp
    model = _build(scenario.model, scenario.dtype)
    ref = _build(scenario.model, scenario.dtype) if scenario.reference else None
    if ref is not None:
        _freeze(ref, scenario)
    if ref is not None and scenario.ignored:
        ref.pos_emb.weight.requires_grad_(False)
    _apply(fsdp, model, scenario, impl)
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            eps=ADAM_EPS, foreach=True if scenario.explicit else None)
    late = list(model.blocks[0].parameters()) if scenario.late else []
    if scenario.late == "freeze":
        for p in late:
            p.requires_grad_(False)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                                eps=ADAM_EPS) if ref is not None else None
    generator = torch.Generator().manual_seed(SEED + 1)
    grad_rel = 0.0
    grad_layouts = set()      # whether each .grad has its parameter's placements, local shape
    losses = []
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = _batch(scenario.model, step, micro, world, generator)
            mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
            last = micro == MICRO - 1
            if scenario.accumulation == "nosync":
                model.set_requires_gradient_sync(last)
            if scenario.accumulation == "noallreduce":
                model.set_requires_all_reduce(last)
            if scenario.forward_bytes and step == 0 and micro == 0:
                gc.collect()
                before = _tensor_bytes()
            loss = _loss(model, scenario.model, x[mine], y[mine]) / MICRO
            if scenario.forward_bytes and step == 0 and micro == 0:
                # gloo's threads may still hold a finished collective's tensors for a moment
                # (1 launch in 8 of torch's, one rank: a block's gathered bytes).
                time.sleep(0.2)
                gc.collect()
                forward_held = _tensor_bytes() - before
            loss.backward()
            losses.append(loss.item())
            if ref is not None:
                (_loss(ref, scenario.model, x, y) / MICRO).backward()
        if step == 0 and scenario.late == "drop":
            for p in late:
                p.grad = None
        if step == 0 and scenario.late == "freeze":
            for p in late:
                p.requires_grad_(True)
        grad_layouts.update(
            (tuple(str(x) for x in p.grad.placements) == tuple(str(x) for x in p.placements)
             and p.grad.to_local().shape == p.to_local().shape)
            for p in model.parameters() if p.grad is not None and hasattr(p, "placements"))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if ref is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            pairs = [(p, r) for p, r in zip(model.parameters(), ref.parameters())
                     if r.grad is not None]
            grad_rel = max(grad_rel, max_rel([_full(p.grad) for p, _ in pairs],
                                              [r.grad for _, r in pairs]))
        opt.step()
        opt.zero_grad()
        if ref_opt is not None:
            ref_opt.step()
            ref_opt.zero_grad()
    params = {n: _full(p).detach() for n, p in zip(names, model.parameters())}
    result = {
        "ok": True, "losses": losses, "grad_rel": grad_rel,
        "params": {n: p.double().flatten().tolist() for n, p in params.items()},
        "local_rows": {n: (p.to_local().shape[0] if hasattr(p, "to_local") else p.shape[0])
                       for n, p in zip(names, model.parameters())},
        "types": {n: type(p.data).__name__ for n, p in zip(names, model.parameters())},
        "placements": {n: [type(x).__name__ for x in getattr(p, "placements", ())]
                       for n, p in zip(names, model.parameters())},
        "shard_dims": {n: [x.dim for x in getattr(p, "placements", ()) if hasattr(x, "dim")]
                       for n, p in zip(names, model.parameters())},
        "local_shapes": {n: list(p.to_local().shape if hasattr(p, "to_local") else p.shape)
                         for n, p in zip(names, model.parameters())},
        "dtypes": {n: str(p.dtype) for n, p in zip(names, model.parameters())},
        "class": type(model).__name__,
        "grad_layouts": sorted(grad_layouts),
        "out_dtype": _OUT_DTYPES[-1],
        "is_original": isinstance(model, type(_build(scenario.model))),
    }
    if scenario.forward_bytes:
        # The unsharded parameters' bytes, padded as the gathers pad them (ceil(d / world)
        # rows per rank; a tied parameter once).
        def padded(params):
            return sum(world * -(-p.shape[0] // world) * (p.numel() // p.shape[0]) *
                       p.element_size() for p in params)
        result["forward_held"] = forward_held
        result["padded_unsharded"] = padded(model.parameters())
        result["padded_unsharded_blocks"] = padded(model.blocks.parameters())
    if ref is not None:
        result["ref_rel"] = max_rel(list(params.values()),
                                     [r.detach() for r in ref.parameters()])
    return result


def train_cases(impl, scenarios):
    """Runs each named scenario; returns {name: result}.  One failing scenario does not stop
    the others (its result says why)."""
    results = {}
    for name in scenarios:
        try:
            results[name] = _run(impl, name, SCENARIOS[name])
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"ok": False, "error": traceback.format_exc()}
        gc.collect()
    _finish(impl)
    return results


def _finish(impl):
    import torch.distributed as dist
    if impl == "dptc":
        import dptc
        dptc.destroy_process_group()
    elif dist.is_initialized():
        dist.destroy_process_group()
    os.environ.pop("DPTC_UNUSED", None)


def _tensor_bytes():
    """Bytes of memory that live tensors hold (DTensors by their local tensor): the union of
    their storages' address ranges, since storages may alias one another's memory."""
    ranges = []
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            local = obj._local_tensor if hasattr(obj, "_local_tensor") else obj
            storage = local.untyped_storage()
        except Exception:  # noqa: BLE001 - meta tensors, exotic subclasses
            continue
        if storage.device.type == "cpu" and storage.nbytes():
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    total, end = 0, 0
    for begin, stop in sorted(ranges):
        if stop > end:
            total += stop - max(begin, end)
            end = stop
    return total


def memory_case(impl):
    """Bytes held between steps against the model state's share: params + grads + AdamW."""
    api = load_impl(impl)
    world, rank = api.get_world_size(), api.get_rank()
    if impl == "dptc":
        import dptc as fsdp
    else:
        import torch.distributed.fsdp as fsdp
    gc.collect()
    base = _tensor_bytes()
    model = build_gpt(vocab=256, d_model=64, n_layer=4, n_head=4, ctx=32)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    padded = sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) * p.element_size()
                 for p in model.parameters())
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(2):
        idx = torch.randint(0, 256, (4, 33), generator=generator)
        model.loss(model(idx[:, :-1]), idx[:, 1:]).backward()
        opt.step()
    gc.collect()
    held = _tensor_bytes() - base
    _finish(impl)
    # AdamW's step counters are 0-dim tensors, one per parameter.
    steps = sum(1 for _ in model.parameters()) * 4
    return {"held": held, "full": full, "padded_share": padded, "step_bytes": steps,
            "rank": rank}


def _step_peak(step):
    """The highest rise of torch's CPU allocator total within step() over its value when
    step() began (torch.profiler(profile_memory=True); the second of two profiled steps)."""
    import json
    import tempfile
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function("measured_step"):
            step()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        with open(trace.name) as f:
            events = json.load(f)["traceEvents"]
    span = next(e for e in events if e.get("name") == "measured_step" and e.get("ph") == "X")
    begin, end = span["ts"], span["ts"] + span["dur"]
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                    if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    before = [total for ts, total in memory if ts < begin]
    start = before[-1] if before else 0
    return max([start] + [total for ts, total in memory if begin <= ts <= end]) - start


def reduction_memory_case(impl):
    """The in-step peak of a one-unit model (fully_shard on the root only, two bias-free
    float32 Linears of 256 x 1024: 2 MiB unsharded, no prefetch, tiny activations), as the
    rise of torch's allocator total over the step, and the bytes a dptc reduction lays its
    input out in when that input lies in the shared reduce ring (outside the allocator)."""
    api = load_impl(impl)
    rank = api.get_rank()
    if impl == "dptc":
        import dptc as fsdp
    else:
        import torch.distributed.fsdp as fsdp
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(256, 1024, bias=False), nn.ReLU(),
                          nn.Linear(1024, 256, bias=False))
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters())
    fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    inputs = torch.randn(8, 256, generator=torch.Generator().manual_seed(SEED + rank))

    def step():
        opt.zero_grad(set_to_none=True)
        model(inputs).square().mean().backward()
        opt.step()

    step()
    peak = _step_peak(step)
    ring = 0
    if impl == "dptc":
        state = model.__dict__["_dptc_fsdp_state"]
        ring = max((memoryview(ring.buffers[0]).nbytes for ring in state.rings.values()),
                   default=0)
    params = [p.detach().full_tensor().tolist() for p in model.parameters()]
    _finish(impl)
    return {"peak": peak, "unsharded": unsharded, "ring": ring, "params": params,
            "rank": rank}


def _sharded_gpt_and_reference():
    """The float64 GPT with dptc's fully_shard on every block and the root, and an unsharded
    copy of its initial state (the single-process reference)."""
    import dptc
    model = _build("gpt", torch.float64)
    reference = _build("gpt", torch.float64)
    for block in model.blocks:
        dptc.fully_shard(block)
    dptc.fully_shard(model)
    return model, reference


def methods_case(impl):
    """FSDPModule's methods beyond a plain training step, each checked by numbers.

    On the float64 GPT (blocks and root sharded), against the single-process reference:
    - ``unshard(async_op=True)`` of the root before forward, ``wait()`` on the handle: the
      root's parameters are then the full plain tensors; training goes on unchanged;
    - ``register_fsdp_forward_method(model, "logits_of")``: a method other than forward
      gathers the parameters (its output equals the reference's);
    - ``set_reshard_after_backward(False)``: after backward the blocks' parameters stay
      unsharded (plain tensors of full shape on the module); the next step still matches;
    - ``set_gradient_divide_factor(1.0)``: gradients are summed, world size times the mean;
    - ``set_post_optim_event`` with a CPU event after each optimizer step: training goes on
      as the reference's, and the root drops the event at its next forward.
    - ``isinstance`` as user code asks it (pytorch/examples' FSDP2 ``inspect_model`` imports
      FSDPModule from torch.distributed.fsdp): the root and every block are instances of
      torch's FSDPModule, of dptc's and of their own class; slicing a fully_shard-ed
      nn.Sequential builds a plain nn.Sequential; torch's internal ``_get_fsdp_state`` raises
      NotImplementedError naming itself.
    Returns the largest relative differences and what was observed."""
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    import dptc as fsdp
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from examples.gpt import GPT
    model, ref = _sharded_gpt_and_reference()
    out = {"instances": [isinstance(m, (TorchFSDPModule, fsdp.FSDPModule, cls)) and
                         isinstance(m, TorchFSDPModule) and isinstance(m, fsdp.FSDPModule)
                         and isinstance(m, cls)
                         for m, cls in [(model, GPT)] + [(b, type(ref.blocks[0]))
                                                         for b in model.blocks]]}
    sequential = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fsdp.fully_shard(sequential)
    out["slice_type"] = type(sequential[0:1]).__name__
    try:
        model._get_fsdp_state()
        out["torch_state"] = "returned"
    except Exception as error:          # noqa: BLE001 (the test names the type it expects)
        out["torch_state"] = f"{type(error).__name__}: {error}"
    type(model).logits_of = lambda self, idx: self.forward(idx)
    fsdp.register_fsdp_forward_method(model, "logits_of")
    generator = torch.Generator().manual_seed(SEED + 7)
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)

    handle = model.unshard(async_op=True)
    handle.wait()
    out["root_unsharded"] = all(type(p) is torch.nn.Parameter and not hasattr(p, "placements")
                                for p in model._parameters.values() if p is not None) and \
        tuple(model.tok_emb.weight.shape) == (64, 32)
    x, y = _batch("gpt", 0, 0, world, generator)
    logits = model.logits_of(x[mine])
    out["method_rel"] = max_rel([logits.detach()], [ref(x[mine]).detach()])

    for block in model.blocks:
        block.set_reshard_after_backward(False)
    _loss(model, "gpt", x[mine], y[mine]).backward()
    _loss(ref, "gpt", x, y).backward()
    out["blocks_unsharded_after_backward"] = all(
        not hasattr(p, "placements") and p.shape == q.shape
        for block, ref_block in zip(model.blocks, ref.blocks)
        for p, q in zip(block.parameters(), ref_block.parameters()))
    for block in model.blocks:
        block.reshard()
        block.set_reshard_after_backward(True)
    # The reduced gradients are on the sharded parameters, back on the modules after reshard.
    out["grad_rel"] = max_rel([_full(p.grad) for p in model.parameters()],
                               [p.grad for p in ref.parameters()])
    out["blocks_sharded_after_reshard"] = all(hasattr(p, "placements")
                                              for p in model.parameters())
    model.zero_grad()
    ref.zero_grad()

    for module in [model] + list(model.blocks):
        module.set_gradient_divide_factor(1.0)
    x, y = _batch("gpt", 1, 0, world, generator)
    _loss(model, "gpt", x[mine], y[mine]).backward()
    _loss(ref, "gpt", x, y).backward()
    out["sum_rel"] = max_rel([_full(p.grad) for p in model.parameters()],
                              [p.grad * world for p in ref.parameters()])

    # set_post_optim_event with a CPU event after each optimizer step (summed
    # gradients still: the sharded model's learning rate is the reference's / world).
    opt = torch.optim.SGD(model.parameters(), lr=0.1 / world)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in (2, 3, 4):
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        model.set_post_optim_event(torch.Event("cpu"))   # on the CPU it cannot be recorded
        x, y = _batch("gpt", step, 0, world, generator)
        _loss(model, "gpt", x[mine], y[mine]).backward()
        _loss(ref, "gpt", x, y).backward()
    out["post_optim_event_rel"] = _param_rel(model, ref)
    out["post_optim_event_dropped"] = model._fsdp_state().post_optim_event is None
    _finish(impl)
    return out


def staging_case(impl):
    """Bytes of this rank's staging slots that each of two training steps overwrote: on the
    reduce stream (stream 1) in backward ("touched"), which the reduce-scatters' inputs pass
    through unless they lie in shared memory (see [Note: reduce inputs in shared memory] in
    dptc/fsdp/_unit.py), and on stream 0 in forward ("gather_touched"), which the
    all-gathers' inputs pass through unless the shard buffers are shared (Unit._new_flat)."""
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    import dptc
    from dptc.group import resolve
    model = _build("gpt", torch.float32)
    for block in model.blocks:
        dptc.fully_shard(block)
    dptc.fully_shard(model)
    generator = torch.Generator().manual_seed(SEED)
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    group = resolve(None)
    slot = group._c.slot(1, group.local_rank)
    gather_slot = group._c.slot(0, group.local_rank)
    touched, gather_touched = [], []
    for _ in range(2):
        x, y = _batch("gpt", 0, 0, world, generator)
        # A peer may still read this rank's slots in the collective it last finished: the
        # barrier lets every rank finish before the slots are marked.
        dptc.barrier()
        gather_slot[:] = b"\xab" * len(gather_slot)
        loss = _loss(model, "gpt", x[mine], y[mine])
        gather_touched.append(len(gather_slot) - bytes(gather_slot).count(b"\xab"))
        dptc.barrier()
        slot[:] = b"\xab" * len(slot)
        loss.backward()
        touched.append(len(slot) - bytes(slot).count(b"\xab"))
        model.zero_grad()
    slot_bytes = len(slot)
    slot.release()
    gather_slot.release()
    _finish(impl)
    return {"touched": touched, "gather_touched": gather_touched, "slot_bytes": slot_bytes}


def ring_case(impl):
    """What this rank's shared reduce ring buffers hold after each of two training steps:
    their nonzero bytes (the last reductions' inputs while the pages are kept; zero once they
    are given back, see [Note: reduce inputs in shared memory] in dptc/fsdp/_unit.py), and how
    far the parameters are from the single-process reference after the steps."""
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    model, reference = _sharded_gpt_and_reference()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(SEED)
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    nonzero = []
    for _ in range(2):
        x, y = _batch("gpt", 0, 0, world, generator)
        _loss(model, "gpt", x[mine], y[mine]).backward()
        optimizer.step()
        optimizer.zero_grad()
        _loss(reference, "gpt", x, y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        rings = model.__dict__["_dptc_fsdp_state"].rings.values()
        nonzero.append(sum(torch.frombuffer(b, dtype=torch.uint8).count_nonzero().item()
                           for ring in rings for b in ring.buffers))
    rel = max_rel([_full(p.detach()) for p in model.parameters()],
                  [p.detach() for p in reference.parameters()])
    _finish(impl)
    return {"nonzero": nonzero, "ref_rel": rel}


class _Branchy(nn.Module):
    """One unit's worth of layers: ``a`` always, ``b`` only where the caller says, ``c``
    never."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b):
        hidden = self.a(x)
        return hidden + self.b(hidden) if use_b else hidden


class _BranchyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.unit, self.head = _Branchy(), nn.Linear(8, 2)

    def forward(self, x, use_b):
        return self.head(self.unit(x, use_b))


def unused_branch_case(impl):
    """fully_shard with set_reduce_scatter_unused_params(True) on a unit whose layer ``b`` each
    rank uses at other steps (rank r at the steps where r + step is even) and whose ``c`` no
    rank uses, float64, AdamW: {name: flat parameter values} after training, and the same
    for the single-process reference on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    if impl == "dptc":
        from dptc import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        return _BranchyNet().double()

    model, ref = build(), build()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)

    for step in range(3):
        xs = [torch.randn(4, 8, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(10 * r + step))
              for r in range(world)]
        uses = [(r + step) % 2 == 0 for r in range(world)]
        model(xs[rank], uses[rank]).square().mean().backward()
        (sum(ref(xs[r], uses[r]).square().mean() for r in range(world)) / world).backward()
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    out = {"params": {n: _full(p).detach().flatten().tolist() for n, p in model.named_parameters()},
           "reference": {n: p.detach().flatten().tolist() for n, p in ref.named_parameters()}}
    _finish(impl)
    return out


HOOK_MODES = ("record", "force_sum", "double")


def recast_case(impl, when):
    """The float32 GPT sharded (blocks, then the root), cast with ``model.double()`` and
    trained 3 steps of SGD with momentum in float64; when="after_step": one float32 step
    first, on an optimizer made before the cast that goes on after it.  The single process
    takes the same steps and casts.  Returns the dtypes of the local shards and their
    gradients, and the largest relative difference of the parameters from the reference's."""
    model, ref, mine, world = _sharded_gpt(impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(SEED + 17)

    def step(dtype):
        x, y = _batch("gpt", 0, 0, world, generator)
        for m, o, rows in ((model, opt, mine), (ref, ref_opt, slice(None))):
            m.loss(m(x[rows]).to(dtype), y[rows]).backward()
            o.step()
            o.zero_grad()
    if when == "after_step":
        step(torch.float32)
    model.double(), ref.double()
    for _ in range(3):
        step(torch.float64)
    x, y = _batch("gpt", 0, 0, world, generator)
    model.loss(model(x[mine]), y[mine]).backward()
    out = {"local_dtypes": sorted({str(p._local_tensor.dtype) for p in model.parameters()}),
           "grad_dtypes": sorted({str(p.grad._local_tensor.dtype) for p in model.parameters()}),
           "param_rel": _param_rel(model, ref)}
    _finish(impl)
    return out


def backward_hooks_case(impl):
    """Full backward hooks (``register_full_backward_hook``) on each block, a fully_shard
    unit, and on the first Linear of its MLP, inside the unit, record what they see of the
    module's weight: whether it is a DTensor, its shape, and its gradient (None, or its type,
    shape and sum).  Under torch's fully_shard a unit reshards and reduces once its inputs'
    gradients are computed, so these hooks see the unsharded weight and this rank's
    unreduced gradient.  The float64 GPT, every unit sharded, two steps of AdamW; returns the
    records and the largest relative difference of the parameters from the single-process
    reference's."""
    model, ref, mine, world = _sharded_gpt(impl, torch.float64)
    records = []

    def record(name):
        def hook(module, _grad_input, _grad_output):
            weight, grad = module.weight, module.weight.grad
            records.append([name, hasattr(weight, "placements"), list(weight.shape),
                            None if grad is None else [hasattr(grad, "placements"),
                                                       list(grad.shape), grad.sum().item()]])
        return hook

    for i, block in enumerate(model.blocks):
        block.ln_attn.register_full_backward_hook(record(f"blocks.{i}.ln_attn"))
        block.mlp[0].register_full_backward_hook(record(f"blocks.{i}.mlp.0"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED + 17)
    for step in range(2):
        x, y = _batch("gpt", step, 0, world, generator)
        _loss(model, "gpt", x[mine], y[mine]).backward()
        _loss(ref, "gpt", x, y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    out = {"records": records,
           "param_rel": _param_rel(model, ref)}
    _finish(impl)
    return out


def post_accumulate_hooks_case(impl):
    """Optimizer in backward (torchtune's pattern with fully_shard): an SGD per sharded
    parameter, stepped and zeroed by a ``register_post_accumulate_grad_hook`` on that
    parameter.  torch's fully_shard runs those hooks on the sharded parameters once their
    reduced gradients are accumulated, in a backward that syncs gradients only.  The float64
    GPT, every unit sharded, 2 steps of 2 micro-batches (the first under
    ``set_requires_gradient_sync(False)``); the reference accumulates both micro-batches on
    the whole batch and steps SGD after.  Returns the hook calls per step and the largest
    relative difference of the parameters from the reference's."""
    model, ref, mine, world = _sharded_gpt(impl, torch.float64)
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    calls = []

    def step_in_backward(param):
        calls[-1] += 1
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(SEED + 19)
    for step in range(2):
        calls.append(0)
        for micro in range(MICRO):
            x, y = _batch("gpt", step, micro, world, generator)
            model.set_requires_gradient_sync(micro == MICRO - 1)
            (_loss(model, "gpt", x[mine], y[mine]) / MICRO).backward()
            (_loss(ref, "gpt", x, y) / MICRO).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out = {"calls": calls, "parameters": len(list(model.parameters())),
           "param_rel": _param_rel(model, ref)}
    _finish(impl)
    return out


def frozen_reduce_case(impl):
    """The float64 GPT with block 0's attention and the position embedding (in the root's
    unit) frozen, every unit sharded with ``set_all_reduce_hook`` recording the numel of
    what each reduce-scatter produced; two steps of AdamW.  Returns the numels of the first
    backward, the largest relative difference of the parameters from the single-process
    reference's after the two steps, and whether every frozen parameter kept no gradient."""
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    if impl == "dptc":
        import dptc as fsdp
    else:
        import torch.distributed.fsdp as fsdp
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    model, ref = _build("gpt", torch.float64), _build("gpt", torch.float64)
    for m in (model, ref):
        m.blocks[0].attn.requires_grad_(False)
        m.pos_emb.requires_grad_(False)
    numels = []
    for module in _units(model):
        fsdp.fully_shard(module)
        module.set_all_reduce_hook(lambda output: numels.append(output.numel()))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    generator = torch.Generator().manual_seed(SEED + 13)
    first = None
    for step in range(2):
        x, y = _batch("gpt", step, 0, world, generator)
        _loss(model, "gpt", x[mine], y[mine]).backward()
        _loss(ref, "gpt", x, y).backward()
        first = list(numels) if first is None else first
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    out = {"numels": first,
           "param_rel": _param_rel(model, ref),
           "frozen_without_grad": all(p.grad is None for p in model.parameters()
                                      if not p.requires_grad)}
    _finish(impl)
    return out


def all_reduce_hook_case(impl):
    """``set_all_reduce_hook`` and ``set_force_sum_reduction_for_comms`` on every unit of the
    float32 GPT (blocks and root), one backward per mode and mesh, against the single-process
    reference on the whole batch.  Modes:
        record     the hook records sum|reduce_output| of each call
        force_sum  the same with force-sum reduction: the hook sees sums, not means
        double     the hook doubles the reduced gradients in place
    Meshes: "flat", every rank on one shard dim; "hsdp", (replicate 2, shard world/2), where
    the hook runs after the replicas' all-reduce.  Returns {mesh: {mode: the records, and the
    largest relative difference of the full gradients from the reference's (times 2 for
    double)}}."""
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    if impl == "dptc":
        import dptc as fsdp
    else:
        import torch.distributed.fsdp as fsdp
    from torch.distributed.device_mesh import init_device_mesh
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    meshes = {"flat": init_device_mesh("cpu", (world,)),
              "hsdp": init_device_mesh("cpu", (2, world // 2),
                                       mesh_dim_names=("replicate", "shard"))}
    out = {}
    for mesh_name, mesh in meshes.items():
        out[mesh_name] = {}
        for mode in HOOK_MODES:
            model, ref = _build("gpt"), _build("gpt")
            records = []

            def hook(output, records=records, mode=mode):
                records.append(output.double().abs().sum().item())
                if mode == "double":
                    output.mul_(2)
            for module in _units(model):
                fsdp.fully_shard(module, mesh=mesh)
                module.set_all_reduce_hook(hook)
                if mode == "force_sum":
                    module.set_force_sum_reduction_for_comms(True)
            generator = torch.Generator().manual_seed(SEED + 11)
            x, y = _batch("gpt", 0, 0, world, generator)
            _loss(model, "gpt", x[mine], y[mine]).backward()
            _loss(ref, "gpt", x, y).backward()
            scale = 2.0 if mode == "double" else 1.0
            out[mesh_name][mode] = {
                "records": records,
                "grad_rel": max_rel([_full(p.grad) for p in model.parameters()],
                                    [p.grad * scale for p in ref.parameters()])}
            gc.collect()
    _finish(impl)
    return out


def knobs_case(impl):
    """torch 2.13's FSDPModule tuning methods that change no number, each set on the float64
    GPT (blocks and root) before 3 steps of 2 micro-batches and AdamW: the trained parameters
    (for the comparison with torch's) and their difference from the single-process
    reference; then {case: "ExceptionType: message"} for bad values and for the methods
    neither implementation runs on CPU (symmetric memory; dptc's custom collectives)."""
    api = load_impl(impl)
    rank, world = api.get_rank(), api.get_world_size()
    if impl == "dptc":
        from dptc import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    model = _build("gpt", torch.float64)
    ref = _build("gpt", torch.float64)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group(True)
    for module in [model] + list(model.blocks):
        module.set_allocate_memory_from_process_group_for_comm(True)
    model._set_unshard_async_op(True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED + 11)
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    for step in range(3):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x, y = _batch("gpt", step, micro, world, generator)
            (_loss(model, "gpt", x[mine], y[mine]) / 2).backward()
            (_loss(ref, "gpt", x, y) / 2).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    out = {"ref_rel": _param_rel(model, ref),
           "params": {name: _full(p.detach()).flatten().tolist()
                      for name, p in model.named_parameters()},
           "errors": {}}
    for case, call in [("buffers_bool", lambda: model.set_reduce_scatter_max_input_buffers(True)),
                       ("buffers_zero", lambda: model.set_reduce_scatter_max_input_buffers(0)),
                       ("symm_mem", lambda: model.set_symm_mem_for_comm()),
                       ("custom_all_gather", lambda: model.set_custom_all_gather(object())),
                       ("custom_reduce_scatter",
                        lambda: model.set_custom_reduce_scatter(object()))]:
        try:
            call()
            out["errors"][case] = "ok"
            if case == "symm_mem":   # torch's fails at the next gather
                _loss(model, "gpt", x[mine], y[mine]).backward()
        except Exception as error:   # noqa: BLE001 (the test names the type it expects)
            out["errors"][case] = f"{type(error).__name__}: {error}"
    _finish(impl)
    return out
