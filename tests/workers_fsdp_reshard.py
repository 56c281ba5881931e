"""Rank-side bodies of tests/test_fsdp_reshard.py: reshard_after_forward=k over meshes of
several shapes.

torch's fully_shard reshards to blocks of k consecutive ranks of the mesh it is given
(mesh.mesh.view(-1, k)); dptc builds the same blocks as groups.  Groups are collectives: every
rank must build the same groups in the same order, or ranks meet the wrong peers, or wait.
Each case trains the GPT of tests/workers_fsdp.py in float64 (3 steps of 2 micro-batches,
clip_grad_norm_, AdamW) with ``reshard_after_forward=k`` on every block and the root, on one
of these meshes:
    flat      a 1-D mesh over the world
    hsdp      a 2-D (replicate, shard) mesh of (replicas, world / replicas)
    submesh   mesh["dp_shard"] of a (dp_shard, tp) mesh of (world / tp, tp); the ranks of a tp
              group see the same rows (no tensor parallelism: tp only shapes the mesh)
and returns the trained parameters, their distance from single-process training on the data
parallel batch, and the groups this rank reshards to, with the name and ranks of every torch
group it knows, so that the test can check that no name means two sets of ranks.
"""

import torch
import torch.distributed as dist

from tests.workers_fsdp import (ADAM_EPS, LR, MICRO, ROWS_PER_RANK, STEPS, _batch, _build,
                                _full, _loss, max_rel)

__all__ = ["reshard_case"]


def _mesh(layout, world, replicas, tp):
    from torch.distributed.device_mesh import init_device_mesh
    if layout == "flat":
        mesh = init_device_mesh("cpu", (world,))
        return mesh, mesh.get_local_rank(), world
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (replicas, world // replicas),
                                mesh_dim_names=("replicate", "shard"))
        return mesh, dist.get_rank(), world
    if layout == "submesh":
        full = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
        mesh = full["dp_shard"]
        return mesh, mesh.get_local_rank(), world // tp
    raise ValueError(f"layout must be flat, hsdp or submesh, got {layout!r}")


def _post_forward_ranks(impl, module):
    """The global ranks of the group `module`'s unit reshards to after forward, or None."""
    if impl == "dptc":
        unit = module.__dict__["_dptc_fsdp_state"].unit
        group = unit.post_forward_group
        return None if group is None else list(group.ranks)
    info = module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info
    if info is None:
        return None
    return sorted(dist.get_process_group_ranks(info.shard_process_group))


def _torch_groups():
    """{name: sorted global ranks} of every torch group this rank is a member of."""
    from torch.distributed.distributed_c10d import _world
    return {str(name): sorted(dist.get_process_group_ranks(pg))
            for pg, name in _world.pg_names.items() if pg is not dist.GroupMember.WORLD}


def reshard_case(impl, layout, k, replicas=1, tp=1):
    """Trains with reshard_after_forward=k on every unit over the mesh `layout`; returns
    {"params", "ref_rel", "post_forward": [ranks per unit], "groups": {name: ranks}}."""
    from tests._rank import load_impl
    api = load_impl(impl)
    world = api.get_world_size()
    if impl == "dptc":
        import dptc as fsdp
    else:
        import torch.distributed.fsdp as fsdp
    if not dist.is_initialized():
        import dptc
        dptc.init_process_group()
    mesh, dp_rank, dp_world = _mesh(layout, world, replicas, tp)
    model, ref = _build("gpt", torch.float64), _build("gpt", torch.float64)
    units = list(model.blocks) + [model]
    for module in units:
        fsdp.fully_shard(module, mesh=mesh, reshard_after_forward=k)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAM_EPS)
    generator = torch.Generator().manual_seed(4322)
    mine = slice(dp_rank * ROWS_PER_RANK, (dp_rank + 1) * ROWS_PER_RANK)
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = _batch("gpt", step, micro, dp_world, generator)
            (_loss(model, "gpt", x[mine], y[mine]) / MICRO).backward()
            (_loss(ref, "gpt", x, y) / MICRO).backward()
        for m, o in ((model, opt), (ref, ref_opt)):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            o.zero_grad()
    params = [_full(p).detach() for p in model.parameters()]
    result = {
        "params": [p.flatten().tolist() for p in params],
        "ref_rel": max_rel(params, [p.detach() for p in ref.parameters()]),
        "post_forward": [_post_forward_ranks(impl, m) for m in units],
        "groups": _torch_groups(),
    }
    if impl == "dptc":
        import dptc
        dptc.destroy_process_group()
    return result
