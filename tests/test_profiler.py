"""Named ranges in torch.profiler traces (see [Note: profiler ranges] in dptc/_ranges.py).

Layer: several ranks.  One launch of 2 ranks (tests/workers_profiler.py) runs every scenario
once without a profiler, twice under ``torch.profiler.profile(activities=[CPU])`` and once
after it; the tests below read its results.  They assert the exact range names and counts in
``prof.events()``, ``key_averages()`` and the exported Chrome trace, the order ranges start in,
and that dptc opens no range at all while no profiler records.
"""

import pytest

from tests._launch import once, run_ranks
from tests.workers_profiler import DDP_LAYERS, FSDP_BLOCKS, PROFILED_RUNS, SCENARIOS

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 120

_launches = {}


def _results(name):
    """Per rank, the result of scenario `name` (one launch for the whole file)."""
    outcome = once(_launches, "profile",
                   lambda: run_ranks("tests.workers_profiler:profile_cases", WORLD_SIZE,
                                     args={"scenarios": list(SCENARIOS)},
                                     timeout=LAUNCH_TIMEOUT_S),
                   "the profiler launch")
    per_rank = [ranks[name] for ranks in outcome]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"{name} raised on rank {rank}:\n{result['error']}"
    return per_rank


def _per_run(names):
    return {name: PROFILED_RUNS * count for name, count in names.items()}


BLOCKS = [f"blocks.{i}" for i in range(FSDP_BLOCKS)]
# One training step of fully_shard on each block, then the root: the root keeps its
# parameters after forward (reshard_after_forward defaults to False for it), so it gathers
# once; each block gathers in forward and again in backward; every unit reduce-scatters once.
FSDP_STEP = {"dptc::all_gather root": 1, "dptc::reduce_scatter root": 1,
             "dptc::fsdp finalize": 1,
             **{f"dptc::all_gather {b}": 2 for b in BLOCKS},
             **{f"dptc::reduce_scatter {b}": 1 for b in BLOCKS}}
EXPECTED = {
    "collectives": _per_run({"dptc::all_reduce": 2, "dptc::broadcast": 1,
                             "dptc::all_gather": 2, "dptc::reduce_scatter": 1,
                             "dptc::barrier": 1}),
    "ddp": _per_run({**{f"dptc::all_reduce bucket {k}": 1 for k in range(DDP_LAYERS)},
                     "dptc::ddp finalize": 1}),
    "ddp_no_sync": {},
    "fsdp": _per_run(FSDP_STEP),
    # HSDP on a (2 replicas, 1 shard) mesh: over a shard group of one there is nothing to
    # gather (the unsharded parameters are the shard buffers) or reduce-scatter; each unit's
    # gradients are all-reduced across the replicas in place.
    "hsdp": _per_run({"dptc::fsdp finalize": 1, "dptc::all_reduce root": 1,
                      **{f"dptc::all_reduce {b}": 1 for b in BLOCKS}}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_exact_names_and_counts(name):
    for rank, result in enumerate(_results(name)):
        assert result["counts"] == EXPECTED[name], f"rank {rank}"
        assert result["averages"] == EXPECTED[name], f"rank {rank}: key_averages()"
        assert result["trace_counts"] == EXPECTED[name], f"rank {rank}: chrome trace"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_no_range_without_a_profiler(name):
    """Not one call into the range functions (Python's or C's) unless a profiler records;
    under the profiler, every range opened is recorded once."""
    for rank, result in enumerate(_results(name)):
        assert result["calls_unprofiled"] == 0, f"rank {rank}: before the profiler"
        assert result["calls_after"] == 0, f"rank {rank}: after the profiler"
        assert result["flag_after"] is False
        assert result["calls_profiled"] == sum(EXPECTED[name].values()), f"rank {rank}"


def test_collectives_in_call_order():
    run = ["dptc::all_reduce", "dptc::broadcast", "dptc::all_gather", "dptc::all_gather",
           "dptc::reduce_scatter", "dptc::barrier", "dptc::all_reduce"]
    for result in _results("collectives"):
        assert result["order"] == run * PROFILED_RUNS
        assert len(result["threads"]) == 1


def test_ddp_buckets_in_launch_order_inside_the_step():
    """Bucket k's range is the k-th to start (the reducer numbers buckets in launch order, as
    torch's DDP does) and each ends by the end of its step's finalize range, which waits for
    it."""
    step = [f"dptc::all_reduce bucket {k}" for k in range(DDP_LAYERS)] + ["dptc::ddp finalize"]
    for result in _results("ddp"):
        assert result["extra"]["buckets"] == DDP_LAYERS
        assert result["order"] == step * PROFILED_RUNS
        spans = result["spans"]
        for run in range(PROFILED_RUNS):
            ranges = spans[run * len(step):(run + 1) * len(step)]
            finalize_start, finalize_end = ranges[-1][1], ranges[-1][2]
            for name, start, end in ranges[:-1]:
                assert start < finalize_start, name
                assert start < end <= finalize_end, name
        assert len(result["threads"]) == 1


@pytest.mark.parametrize("name", ["fsdp", "hsdp"])
def test_fsdp_units_named_by_module(name):
    for result in _results(name):
        extra = result["extra"]
        assert extra["labels_before"] == ["Sequential"] * FSDP_BLOCKS   # before lazy init
        assert extra["labels"] == BLOCKS + ["root"]
        assert extra["c_labels"] == BLOCKS + ["root"]
        gathers = [n for n in result["order"] if n.startswith("dptc::all_gather")]
        forward = ["dptc::all_gather root"] + [f"dptc::all_gather {b}" for b in BLOCKS]
        backward = [f"dptc::all_gather {b}" for b in reversed(BLOCKS)]
        assert gathers == ((forward + backward) * PROFILED_RUNS if name == "fsdp" else [])
        reductions = [n for n in result["order"] if n.startswith("dptc::all_reduce")]
        expected = [f"dptc::all_reduce {b}" for b in reversed(BLOCKS)] + \
            ["dptc::all_reduce root"]
        assert reductions == (expected * PROFILED_RUNS if name == "hsdp" else [])
        assert len(result["threads"]) == 1


def test_ranges_closed_when_a_ddp_step_fails():
    """Layer 0 gets no gradient: the three buckets before its own launch and complete, the
    finalize callback raises and aborts the group, and every range opened is still recorded
    once, closed by the failing step."""
    for result in _results("ddp_failure"):
        assert "did not receive a gradient" in result["error_message"]
        assert "0.weight, 0.bias" in result["error_message"]
        assert result["counts"] == {**{f"dptc::all_reduce bucket {k}": 1
                                       for k in range(DDP_LAYERS - 1)},
                                    "dptc::ddp finalize": 1}
        assert result["state"] == "idle"


def test_unit_names_drop_wrapper_attributes():
    """Layer: a pure function.  FSDP1 and activation checkpointing wrap modules in attributes
    the user's model does not have; a unit's range name leaves them out."""
    import torch.nn as nn
    from dptc.fsdp._state import _range_names

    def wrap(attribute, module):
        wrapper = nn.Module()
        setattr(wrapper, attribute, module)
        return wrapper

    block = nn.Linear(2, 2)
    inner = wrap("_fsdp_wrapped_module", block)
    model = nn.Module()
    model.blocks = nn.ModuleList([wrap("_checkpoint_wrapped_module", inner)])
    outer = wrap("_fsdp_wrapped_module", model)
    names = _range_names([outer])
    assert names[outer] == "root" and names[model] == "root"
    assert names[block] == "blocks.0" and names[inner] == "blocks.0"
    assert list(names.values()) == ["root", "root", "blocks", "blocks.0", "blocks.0",
                                    "blocks.0"]
