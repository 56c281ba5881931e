"""fully_shard under torch.distributed.pipelining (PP + FSDP on a 2-D mesh).

Layer: 4 ranks, a (pp=2, dp=2) mesh; rank-side code in tests/workers_fsdp_pipelining.py.  An
MLP of 4 linears split into 2 stages, each stage fully_shard over mesh["dp"] (its linears,
then the stage), driven by torch's PipelineStage and ScheduleGPipe or Schedule1F1B with 2
micro-batches, 3 AdamW steps in float64; and in 4 stages, two per pp rank, under
ScheduleInterleaved1F1B, ScheduleLoopedBFS and ScheduleInterleavedZeroBubble.  torch's
schedule accumulates the micro-batches without sync and then reduces through torch's FSDP
state of the stage (see [Note: torch's pipelining] in dptc/fsdp/_fully_shard.py).  One
launch per implementation and schedule: dptc's fully_shard and torch's (gloo), each against
the single process on the whole batch.
"""

import pytest

from tests._compare import max_rel
from tests._launch import run_ranks

LAUNCH_TIMEOUT_S = 180
# float64: the ranks and the reference differ only by summation order (measured 1.7e-16).
FLOAT64_TOLERANCE = 1e-10

_launches = {}


def _results(impl, schedule, share=False, mixed=False):
    key = (impl, schedule, share, mixed)
    if key not in _launches:
        _launches[key] = run_ranks("tests.workers_fsdp_pipelining:pipeline_case", 4,
                                   args={"impl": impl, "schedule": schedule, "share": share,
                                         "mixed": mixed},
                                   timeout=LAUNCH_TIMEOUT_S, reference=impl == "torch")
    return _launches[key]


SCHEDULES = ["gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "zerobubble"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("impl", ["dptc", "torch"])
def test_pipeline_stages_match_single_process(impl, schedule):
    """Every rank's stage, after 3 steps, equals the same layers of the whole MLP trained in
    one process on the whole batch; torch's run checks the test with the same numbers."""
    results = _results(impl, schedule)
    for rank, result in enumerate(results):
        assert result["ok"], result.get("error")
        assert result["ref_rel"] <= FLOAT64_TOLERANCE, (rank, result["ref_rel"])
    assert sorted((r["stage"], r["dp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0),
                                                                   (1, 1)]
    assert all(len(r["loss"]) == 3 for r in results if r["stage"] == 1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_stages_are_torchs(schedule):
    """dptc's stages train bit-identically to torch's fully_shard under the same schedule,
    with the same losses on the last stage: one stage per rank, or two (the schedule unshards
    with unshard(async_op=True) and reshards them itself; zero-bubble splits each backward
    into an input and a weight pass)."""
    for mine, theirs in zip(_results("dptc", schedule), _results("torch", schedule)):
        assert mine["ok"], mine.get("error")
        assert (mine["stage"], mine["dp_rank"]) == (theirs["stage"], theirs["dp_rank"])
        assert max_rel(mine["params"], theirs["params"]) == 0.0
        assert mine["loss"] == theirs["loss"]


def test_share_comm_ctx_over_a_ranks_stages():
    """dptc.share_comm_ctx over the two stages of each pp rank (torchtitan calls it under
    interleaved schedules) changes nothing dptc computes: the same parameters as torch's
    fully_shard without it, bit for bit.  (torch 2.13's own share_comm_ctx breaks its
    interleaved 1F1B on CPU: IndexError in FSDPParamGroup._backward_prefetch, the roots
    then sharing one post-forward order.)  It takes fully_shard modules only, with torch's
    message."""
    for mine, theirs in zip(_results("dptc", "interleaved1f1b", share=True),
                            _results("torch", "interleaved1f1b")):
        assert mine["ok"], mine.get("error")
        assert max_rel(mine["params"], theirs["params"]) == 0.0
    import torch
    import dptc
    with pytest.raises(ValueError, match="Expects list of FSDPModules but got Linear"):
        dptc.share_comm_ctx([torch.nn.Linear(2, 2)])
    dptc.share_comm_ctx([])


def test_pipeline_bf16_policy_is_torchs():
    """Under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) and Schedule1F1B
    (the micro-batches' bf16 gradients accumulated in float32 until the schedule's
    perform_reduce_grad), dptc's stages train to torch's parameters and losses bit for bit
    (both 5e-2 from the float64 single process, the bf16 compute's rounding)."""
    for mine, theirs in zip(_results("dptc", "1f1b", mixed=True),
                            _results("torch", "1f1b", mixed=True)):
        assert mine["ok"], mine.get("error")
        assert max_rel(mine["params"], theirs["params"]) == 0.0
        assert mine["loss"] == theirs["loss"]
        assert 1e-3 < mine["ref_rel"] < 0.2   # the policy did run in bf16
