"""Rank-side bodies of tests/test_fsdp_tp.py: fully_shard over tensor-parallel parameters.

4 ranks on a (dp=2, tp=2) mesh, as torch's tensor-parallel tutorial builds it: each block's
two linears are made tensor-parallel on the tp dimension (parallelize_module with
ColwiseParallel and RowwiseParallel, so their parameters become DTensors on the tp mesh) and a
gate between them a Replicate() DTensor there, then
fully_shard shards every block and the root over the dp dimension.  The ranks of one tp group
see the same rows; the two dp groups see different rows.  Beside it every rank trains a plain
copy of the model on the whole global batch (the reference).  float64, 3 steps of 2
accumulated micro-batches and AdamW.

``impl`` picks the fully_shard under test: "dptc" or "torch" (torch.distributed.fsdp on gloo;
tensor parallelism is torch's own in both).
"""

import torch
import torch.nn as nn

from tests._compare import max_rel
from tests.workers_fsdp import _full

__all__ = ["tp_cases"]

SEED = 97
LR = 1e-3
STEPS = 3
MICRO = 2
ROWS = 4               # per dp group and micro-batch
WIDTH, HIDDEN = 6, 10  # HIDDEN / tp = 5 rows of w1 per tp rank: 3 and 2 on the 2 dp ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, dtype=torch.float64)
        self.w1 = nn.Linear(WIDTH, HIDDEN, dtype=torch.float64)
        self.w2 = nn.Linear(HIDDEN, WIDTH, dtype=torch.float64)
        # Made a Replicate() DTensor on the tp mesh: its gradient arrives in another placement
        # (it scales the column-parallel output, which is sharded on its last dim).
        self.gate = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, dtype=torch.float64))

    def forward(self, x):
        return x + self.w2(torch.tanh(self.w1(self.norm(x))) * self.gate)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 3, dtype=torch.float64)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tp_cases(impl):
    """{"float64", "mixed", "meta", "hsdp", "fsdp1": result}: fully_shard training in
    float64, under MixedPrecisionPolicy(param_dtype=float32, reduce_dtype=float64),
    initialised on the meta device, and as HSDP (a (replicate=2, shard=1, tp=2) mesh) in
    float64; then FSDP1's FullyShardedDataParallel over the (dp, tp) mesh's dp dim."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if impl == "dptc":
        import dptc as fsdp
        from dptc import ModuleWrapPolicy
        fsdp.init_process_group()
    else:
        import torch.distributed.fsdp as fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plain = (mesh["dp"], mesh["tp"], mesh["dp"].get_local_rank())
    # HSDP + TP: the dp ranks replicate (a shard group of one each), as across nodes.
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    hybrid = (mesh3["replicate", "shard"], mesh3["tp"], mesh3["replicate"].get_local_rank())
    results = {"float64": _train(fsdp, *plain, mp=False),
               "mixed": _train(fsdp, *plain, mp=True),
               "meta": _train(fsdp, *plain, mp=False, meta=True),
               "hsdp": _train(fsdp, *hybrid, mp=False),
               "fsdp1": _train_fsdp1(fsdp.FullyShardedDataParallel, ModuleWrapPolicy, *plain)}
    if impl == "dptc":
        fsdp.destroy_process_group()
    else:
        dist.destroy_process_group()
    return results


def _tensor_parallel(tp_mesh, meta=False):
    """The model, its blocks made tensor-parallel on tp_mesh (on the meta device if asked),
    and the plain reference with the same values."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    torch.manual_seed(SEED)
    with torch.device("meta" if meta else "cpu"):
        model = Net()
    torch.manual_seed(SEED)
    ref = Net()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"w1": ColwiseParallel(use_local_output=False),
                                            "w2": RowwiseParallel()})
        block.gate = nn.Parameter(distribute_tensor(block.gate.detach(), tp_mesh,
                                                    [Replicate()]))
    return model, ref


def _train(fsdp, dp_mesh, tp_mesh, dp_rank, mp, meta=False):
    """fully_shard over dp_mesh (1-D, or 2-D for HSDP), tensor parallelism on tp_mesh; the
    rank's rows are its dp_rank's.  meta: the model is built on the meta device, made
    tensor-parallel and sharded there, then materialised with to_empty and each module's
    reset_parameters under a seed, as torchtitan initialises large models."""
    model, ref = _tensor_parallel(tp_mesh, meta)
    kwargs = {}
    if mp:
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.float32,
                                                        reduce_dtype=torch.float64)
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=dp_mesh, **kwargs)
    fsdp.fully_shard(model, mesh=dp_mesh, **kwargs)
    if meta:
        model.to_empty(device="cpu")
        torch.manual_seed(SEED + 2)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (nn.Linear, nn.LayerNorm)):
                    module.reset_parameters()
            for block in model.blocks:
                block.gate.normal_(1.0, 0.1)
    names = [name for name, _ in model.named_parameters()]
    placements = {name: [str(p) for p in param.placements]
                  for name, param in model.named_parameters()}
    local_shapes = {name: list(param.to_local().shape)
                    for name, param in model.named_parameters()}
    grad_rel = _fit(model, ref, dp_rank, grads=True)
    params = {name: _full(p).detach() for name, p in zip(names, model.parameters())}
    return {
        "ref_rel": max_rel(list(params.values()), [r.detach() for r in ref.parameters()]),
        "grad_rel": grad_rel,
        "params": {name: p.double().flatten().tolist() for name, p in params.items()},
        "placements": placements,
        "local_shapes": local_shapes,
        "class": type(model.blocks[0]).__name__,
    }


def _train_fsdp1(FSDP, wrap_policy, dp_mesh, tp_mesh, dp_rank):
    """FSDP1 (FullyShardedDataParallel, device_mesh=dp_mesh, each block its own instance by
    ModuleWrapPolicy) over the tensor-parallel blocks, as torch's 2-D FSDP1 takes them; the
    full parameters after training through summon_full_params (tensor-parallel ones as
    DTensors on tp_mesh, gathered with full_tensor)."""
    model, ref = _tensor_parallel(tp_mesh)
    wrapped = FSDP(model, device_mesh=dp_mesh, use_orig_params=True, device_id="cpu",
                   auto_wrap_policy=wrap_policy({Block}))
    _fit(wrapped, ref, dp_rank, grads=False)
    # Copied inside the context: torch's FSDP1 frees the storage its full parameters view
    # when the context ends (resized to 0 bytes; reading them after it faults).
    with FSDP.summon_full_params(wrapped, writeback=False):
        params = [_full(p).detach().double().clone() for p in wrapped.parameters()]
    return {"ref_rel": max_rel(params, [r.detach() for r in ref.parameters()]),
            "params": {str(i): p.flatten().tolist() for i, p in enumerate(params)}}


def _fit(model, ref, dp_rank, grads):
    """STEPS steps of MICRO micro-batches and AdamW on both; with grads, the worst relative
    difference of the full gradients to the reference's, else None."""
    # Parameters on different meshes (2-D for the tensor-parallel ones, the dp mesh for the
    # others): AdamW one tensor at a time, as DTensor's foreach ops need one mesh.
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    generator = torch.Generator().manual_seed(SEED + 1)
    grad_rel = 0.0 if grads else None
    for _ in range(STEPS):
        for _ in range(MICRO):
            x = torch.randn(2 * ROWS, WIDTH, dtype=torch.float64, generator=generator)
            y = torch.randn(2 * ROWS, 3, dtype=torch.float64, generator=generator)
            mine = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
            (model(x[mine]) - y[mine]).square().mean().div(MICRO).backward()
            (ref(x) - y).square().mean().div(MICRO).backward()
        if grads:
            grad_rel = max(grad_rel, max_rel([_full(p.grad).double()
                                               for p in model.parameters()],
                                              [r.grad for r in ref.parameters()]))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return grad_rel


# -- dp_mesh_dims: parameters on the whole SPMD mesh ------------------------------------------

# Each parameter's placements on the tp dim of the SPMD mesh (Replicate() on the dp dims):
# w1 column-parallel, w2 row-parallel, the rest replicated.
_SPMD_TP = {"w1.weight": "S0", "w1.bias": "S0", "w2.weight": "S1"}


def spmd_cases(impl):
    """{"fsdp_tp", "hsdp", "flat", "flat_tp", "flat_hsdp", "ddp", "errors"}:
    fully_shard(mesh=spmd_mesh, dp_mesh_dims=...) over a model whose every parameter is a
    DTensor on the whole mesh, as torchtitan's SPMD path builds it: a (dp=2, tp=2) mesh
    sharding over dp (DataParallelMeshDims(shard="dp")); a (replicate=2, shard=2) one as HSDP
    (shard="shard", replicate="replicate"); shard=("dp_shard", "cp") flattened, on a (2, 2)
    mesh, a (1, 2, 2) one with tp, and a (dp_replicate=2, dp_shard=1, cp=2) one as HSDP;
    replicate="dp" alone on the (dp, tp) mesh.  The batch is a DTensor sharded over the dp
    dims, so the gradients arrive Partial() there.  "errors": the messages for bad
    dp_mesh_dims."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    if impl == "dptc":
        import dptc as fsdp
        fsdp.init_process_group()
    else:
        import torch.distributed.fsdp as fsdp
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results = {"fsdp_tp": _train_spmd(fsdp, mesh, DataParallelMeshDims(shard="dp")),
               "hsdp": _train_spmd(fsdp, hybrid, DataParallelMeshDims(shard="shard",
                                                                       replicate="replicate")),
               "errors": _spmd_errors(fsdp, mesh, DataParallelMeshDims)}
    # torchtitan's dense dims under context parallelism: shard over (dp_shard, cp), which
    # fully_shard flattens into one dim (also with tensor parallelism, and as HSDP).
    flat = DataParallelMeshDims(shard=("dp_shard", "cp"))
    cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    results["flat"] = _train_spmd(fsdp, cp, flat)
    cp_tp = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
    results["flat_tp"] = _train_spmd(fsdp, cp_tp, flat)
    cp_hsdp = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
    results["flat_hsdp"] = _train_spmd(fsdp, cp_hsdp, DataParallelMeshDims(
        shard=("dp_shard", "cp"), replicate="dp_replicate"))
    # Replicate only: torch's DDP through fully_shard, the parameters whole on every rank.
    results["ddp"] = _train_spmd(fsdp, mesh, DataParallelMeshDims(replicate="dp"))
    if impl == "dptc":
        fsdp.destroy_process_group()
    else:
        dist.destroy_process_group()
    return results


def _spmd_placements(name, mesh, dp_names):
    from torch.distributed.tensor import Replicate, Shard
    tp = _SPMD_TP.get(".".join(name.split(".")[-2:]))
    out = []
    for dim_name in mesh.mesh_dim_names:
        if dim_name == "tp" and tp is not None:
            out.append(Shard(int(tp[1])))
        else:
            out.append(Replicate())
    return out


def _spmd_model(mesh, dp_names):
    """Net with every parameter a DTensor on mesh (see _SPMD_TP), and the plain reference."""
    from torch.distributed.tensor import distribute_tensor
    torch.manual_seed(SEED)
    model = Net()
    torch.manual_seed(SEED)
    ref = Net()
    for name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            full = f"{name}.{pname}" if name else pname
            placements = _spmd_placements(full, mesh, dp_names)
            module._parameters[pname] = nn.Parameter(
                distribute_tensor(param.detach(), mesh, placements))
    return model, ref


def _train_spmd(fsdp, mesh, dims):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    dp_names = set(dims.shard_names) | set(dims.replicate_names)
    model, ref = _spmd_model(mesh, dp_names)
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    placements = {name: [str(p) for p in param.placements]
                  for name, param in model.named_parameters()}
    local_shapes = {name: list(param.to_local().shape)
                    for name, param in model.named_parameters()}
    batch = [Shard(0) if name in dp_names else Replicate() for name in mesh.mesh_dim_names]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    generator = torch.Generator().manual_seed(SEED + 1)
    grad_rel = 0.0
    for _ in range(STEPS):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            x = torch.randn(4 * ROWS, WIDTH, dtype=torch.float64, generator=generator)
            y = torch.randn(4 * ROWS, 3, dtype=torch.float64, generator=generator)
            out = model(distribute_tensor(x, mesh, batch)).redistribute(mesh, batch)
            mine = distribute_tensor(y, mesh, batch).to_local()
            (out.to_local() - mine).square().mean().div(MICRO).backward()
            (ref(x) - y).square().mean().div(MICRO).backward()
        grad_rel = max(grad_rel, max_rel([p.grad.full_tensor() for p in model.parameters()],
                                          [r.grad for r in ref.parameters()]))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    params = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    return {
        "ref_rel": max_rel(list(params.values()), [r.detach() for r in ref.parameters()]),
        "grad_rel": grad_rel,
        "params": {name: p.flatten().tolist() for name, p in params.items()},
        "placements": placements,
        "local_shapes": local_shapes,
        "mesh_is_spmd": all(p.device_mesh is mesh for p in model.parameters()),
    }


def _spmd_errors(fsdp, mesh, DataParallelMeshDims):
    """{case: "ExceptionType: message"} for dp_mesh_dims misuse."""
    from torch.distributed.tensor import Shard, distribute_tensor
    cases = {}

    def attempt(name, build, **kwargs):
        try:
            fsdp.fully_shard(build(), mesh=mesh, **kwargs)
            cases[name] = "ok"
        except Exception as exc:   # noqa: BLE001 - reported to the test
            cases[name] = f"{type(exc).__name__}: {exc}"

    def plain():
        return nn.Linear(4, 4, dtype=torch.float64)

    def on_dp_shard():
        module = plain()
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh,
                                                       [Shard(0), Shard(0)]))
        module.bias = nn.Parameter(distribute_tensor(module.bias.detach(), mesh,
                                                     [Shard(0), Shard(0)]))
        return module
    attempt("unknown_name", plain, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))
    attempt("plain_param", plain, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    attempt("not_replicate", on_dp_shard, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    attempt("int_reshard", plain, dp_mesh_dims=DataParallelMeshDims(shard="dp"),
            reshard_after_forward=2)
    attempt("replicate_only", plain, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
    attempt("several_names", plain, dp_mesh_dims=DataParallelMeshDims(shard=("dp", "tp")))
    return cases
