"""Rank-side bodies of tests/test_fsdp_pipelining.py: fully_shard under torch's pipelining.

4 ranks on a (pp=2, dp=2) mesh: an MLP of 4 linears split into 2 stages of 2, each stage's
linears and the stage itself fully_shard over mesh["dp"], driven by torch's PipelineStage and
a schedule (ScheduleGPipe or Schedule1F1B) over mesh["pp"] with MICRO micro-batches; or in 4
stages of one linear, two per pp rank (stage r and r + 2), under a schedule of several stages
(ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble, which unshard and
reshard the stages themselves and split backward into input and weight passes).  Each dp
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

from tests._compare import max_rel

__all__ = ["pipeline_case"]

SEED = 2024
LR = 1e-2
STEPS = 3
MICRO = 2
ROWS = 4                  # per dp rank and micro-batch
WIDTHS = (6, 10, 9, 8, 3)  # 4 linears: stage 0 holds the first 2, stage 1 the last 2
MULTI = {}                # schedules of several stages per rank: 4 stages of one linear each


def _mlp():
    layers = []
    for i, (n_in, n_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers.append(nn.Linear(n_in, n_out, dtype=torch.float64))
        if i < len(WIDTHS) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _stage_slice(stage, stages):
    """The Sequential indices of stage's layers: of 2 stages (Linear, Tanh, Linear, Tanh |
    Linear, Tanh, Linear), of 4 each linear and its Tanh."""
    per = 4 // stages
    return slice(2 * per * stage, 2 * per * (stage + 1))


def pipeline_case(impl, schedule, share=False, mixed=False):
    """{"ok", "ref_rel", "params", "stage", "dp_rank", "loss"} (or "error"): the trained
    stages' full parameters against the reference's, after STEPS steps.  Schedules of one
    stage per rank ("gpipe", "1f1b") split the MLP in 2 stages, each fully_shard per linear
    and as a whole; those of two ("interleaved1f1b", "loopedbfs", "zerobubble") in 4, each
    one unit.  share: share_comm_ctx over a rank's stages, as torchtitan calls it.  mixed:
    every unit under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), so the
    micro-batches' gradients accumulate in float32 between the schedule's backwards."""
    try:
        return _pipeline(impl, schedule, share, mixed)
    except Exception:   # noqa: BLE001 - reported to the test
        return {"ok": False, "error": traceback.format_exc()}


def _pipeline(impl, schedule_name, share, mixed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleLoopedBFS)
    MULTI.update({"interleaved1f1b": ScheduleInterleaved1F1B, "loopedbfs": ScheduleLoopedBFS,
                  "zerobubble": ScheduleInterleavedZeroBubble})
    if impl == "dptc":
        import dptc as fsdp
        fsdp.init_process_group()
    else:
        import torch.distributed.fsdp as fsdp
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(SEED)
    ref = _mlp()
    multi = schedule_name in MULTI
    stages = 4 if multi else 2
    indices = [pp_rank, pp_rank + 2] if multi else [pp_rank]
    kwargs = {}
    if mixed:
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    chunks = []
    for stage_index in indices:
        torch.manual_seed(SEED)
        chunk = _mlp()[_stage_slice(stage_index, stages)]
        for layer in chunk:
            if isinstance(layer, nn.Linear) and not multi:
                fsdp.fully_shard(layer, mesh=mesh["dp"], **kwargs)
        fsdp.fully_shard(chunk, mesh=mesh["dp"], **kwargs)
        chunks.append(chunk)
    if share:
        fsdp.share_comm_ctx(chunks)   # as torchtitan does for the chunks of one rank
    pipeline = [PipelineStage(chunk, stage_index, stages, torch.device("cpu"),
                              group=mesh["pp"].get_group())
                for chunk, stage_index in zip(chunks, indices)]
    loss_fn = lambda out, y: (out - y).square().mean()   # noqa: E731
    if multi:
        schedule = MULTI[schedule_name](pipeline, n_microbatches=MICRO, loss_fn=loss_fn)
    else:
        schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
        schedule = schedule_cls(pipeline[0], n_microbatches=MICRO, loss_fn=loss_fn)
    model = nn.ModuleList(chunks)
    last = stages - 1 in indices
    first = 0 in indices
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED + 1)
    losses_seen = []
    for _ in range(STEPS):
        x = torch.randn(2 * MICRO * ROWS, WIDTHS[0], dtype=torch.float64, generator=generator)
        y = torch.randn(2 * MICRO * ROWS, WIDTHS[-1], dtype=torch.float64, generator=generator)
        mine = slice(dp_rank * MICRO * ROWS, (dp_rank + 1) * MICRO * ROWS)
        losses = []
        if first and last:
            schedule.step(x[mine], target=y[mine], losses=losses)
        elif first:
            schedule.step(x[mine])
        else:
            schedule.step(target=y[mine], losses=losses)
        if last:
            losses_seen.append(sum(loss.item() for loss in losses) / len(losses))
        opt.step()
        opt.zero_grad()
        (ref(x) - y).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    params = [p.full_tensor().detach() for p in model.parameters()]
    refs = [p.detach() for stage_index in indices
            for p in ref[_stage_slice(stage_index, stages)].parameters()]
    result = {"ok": True, "stage": pp_rank, "dp_rank": dp_rank,
              "ref_rel": max_rel(params, refs), "loss": losses_seen,
              "params": {name: p.flatten().tolist()
                         for (name, _), p in zip(model.named_parameters(), params)}}
    if impl == "dptc":
        fsdp.destroy_process_group()
    else:
        dist.destroy_process_group()
    return result
