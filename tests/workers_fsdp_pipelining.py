"""Rank-side bodies of tests/test_fsdp_pipelining.py: fully_shard under torch's pipelining.

4 ranks on a (pp=2, dp=2) mesh: an MLP of 4 linears split into 2 stages of 2, each stage's
linears and the stage itself fully_shard over mesh["dp"], driven by torch's PipelineStage and
a schedule (ScheduleGPipe or Schedule1F1B) over mesh["pp"] with MICRO micro-batches.  Each dp
rank feeds its rows of the global batch; torch's schedule accumulates the micro-batches'
gradients without sync (set_requires_gradient_sync(False)), then reduces them in its
perform_reduce_grad.  Beside it every rank trains the whole MLP in-process on the whole global
batch (the reference).  float64, STEPS steps of AdamW.

``impl`` picks the fully_shard under test: "dptc" or "torch" (torch.distributed.fsdp on gloo;
the pipelining is torch's own in both).
"""

import traceback

import torch
import torch.nn as nn

__all__ = ["pipeline_case"]

SEED = 2024
LR = 1e-2
STEPS = 3
MICRO = 2
ROWS = 4                  # per dp rank and micro-batch
WIDTHS = (6, 10, 9, 8, 3)  # 4 linears: stage 0 holds the first 2, stage 1 the last 2


def _mlp():
    layers = []
    for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers.append(nn.Linear(n_in, n_out, dtype=torch.float64))
        if i < len(WIDTHS) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _stage_slice(stage):
    """The Sequential indices of stage's layers (Linear, Tanh, Linear, Tanh | Linear, Tanh,
    Linear)."""
    return slice(0, 4) if stage == 0 else slice(4, 7)


def _max_rel(values, refs):
    worst = 0.0
    for value, ref in zip(values, refs):
        scale = ref.abs().max().item()
        diff = (value - ref).abs().max().item()
        worst = max(worst, diff / scale if scale else diff)
    return worst


def pipeline_case(impl, schedule):
    """{"ok", "ref_rel", "params", "stage", "dp_rank", "loss"} (or "error"): the trained
    stage's full parameters against the reference's, after STEPS steps."""
    try:
        return _pipeline(impl, schedule)
    except Exception:   # noqa: BLE001 - reported to the test
        return {"ok": False, "error": traceback.format_exc()}


def _pipeline(impl, schedule_name):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    if impl == "dptc":
        import dptc as fsdp
        fsdp.init_process_group()
    else:
        import torch.distributed.fsdp as fsdp
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(SEED)
    ref = _mlp()
    torch.manual_seed(SEED)
    model = _mlp()[_stage_slice(stage_index)]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp.fully_shard(layer, mesh=mesh["dp"])
    fsdp.fully_shard(model, mesh=mesh["dp"])
    stage = PipelineStage(model, stage_index, 2, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_cls(stage, n_microbatches=MICRO,
                            loss_fn=lambda out, y: (out - y).square().mean())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED + 1)
    losses_seen = []
    for _ in range(STEPS):
        x = torch.randn(2 * MICRO * ROWS, WIDTHS[0], dtype=torch.float64, generator=generator)
        y = torch.randn(2 * MICRO * ROWS, WIDTHS[-1], dtype=torch.float64, generator=generator)
        mine = slice(dp_rank * MICRO * ROWS, (dp_rank + 1) * MICRO * ROWS)
        if stage_index == 0:
            schedule.step(x[mine])
        else:
            losses = []
            schedule.step(target=y[mine], losses=losses)
            losses_seen.append(sum(loss.item() for loss in losses) / len(losses))
        opt.step()
        opt.zero_grad()
        (ref(x) - y).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    params = [p.full_tensor().detach() for p in model.parameters()]
    refs = [p.detach() for p in ref[_stage_slice(stage_index)].parameters()]
    result = {"ok": True, "stage": stage_index, "dp_rank": dp_rank,
              "ref_rel": _max_rel(params, refs), "loss": losses_seen,
              "params": {name: p.flatten().tolist()
                         for (name, _), p in zip(model.named_parameters(), params)}}
    if impl == "dptc":
        fsdp.destroy_process_group()
    else:
        dist.destroy_process_group()
    return result
