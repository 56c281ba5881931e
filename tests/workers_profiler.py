"""Rank-side bodies of tests/test_profiler.py: dptc's named ranges in torch.profiler traces.

``profile_cases`` runs every scenario on each rank, in the same order, and returns per
scenario (JSON):
    counts       {range name: times recorded in prof.events()}, for names starting with dptc::
    averages     the same from prof.key_averages(); trace_counts from export_chrome_trace
    calls_*      times dptc opened a range (called its open_range) in one unprofiled run
                 before the profiler, in the profiled runs, and in one run after the profiler
    flag_after   torch's profiler flag once the profiler stopped
    order        the names by start time; spans [name, start, end] in that order (us)
    threads      the threads the ranges were recorded on
    extra        scenario-specific facts (bucket count, unit labels)
A scenario that raises returns {"error": traceback} instead.  Last, "ddp_failure" profiles a
DDP step that fails (and aborts the group): its error message and range counts.
"""

import collections
import json
import os
import tempfile
import traceback

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from tests._rank import load_impl

__all__ = ["profile_cases"]

SEED = 99
WIDTH = 16
DDP_LAYERS = 4
FSDP_BLOCKS = 3


class _OpenCounter:
    """Counts calls of dptc._ranges.open_range, in Python and in C (see _ranges.install)."""

    def __init__(self, ranges):
        self.ranges = ranges
        self.original = ranges.open_range
        self.calls = 0

    def __enter__(self):
        def counting(name):
            self.calls += 1
            return self.original(name)
        self.ranges.open_range = counting
        self.ranges.install()
        return self

    def __exit__(self, *exc_info):
        self.ranges.open_range = self.original
        self.ranges.install()


def _dptc_events(prof):
    return [e for e in prof.events() if e.name.startswith("dptc::")]


def _counts(events):
    return dict(collections.Counter(e.name for e in events))


def _trace_counts(prof):
    """{name: count} of the dptc:: ranges in the Chrome trace the profiler exports."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as file:
            trace = json.load(file)
    finally:
        os.unlink(path)
    names = [e["name"] for e in trace["traceEvents"]
             if e.get("ph") == "X" and e.get("name", "").startswith("dptc::")]
    return dict(collections.Counter(names))


# ---------------------------------------------------------------------------------------------
# Scenarios: each returns (a function run once unprofiled and once profiled, extra facts)

def _collectives(dptc):
    world = dptc.get_world_size()

    def run():
        t = torch.ones(8)
        dptc.all_reduce(t)
        dptc.broadcast(t, src=0)
        out = torch.empty(8 * world)
        dptc.all_gather_into_tensor(out, t)
        dptc.all_gather_into_tensors([torch.empty(4 * world), torch.empty(4 * world)], t)
        dptc.reduce_scatter_tensor(torch.empty(8), out)
        dptc.barrier()
        dptc.all_reduce(t, async_op=True).wait()
    return run, lambda: {}


def _ddp(dptc, no_sync=False):
    torch.manual_seed(SEED)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DDP_LAYERS)])
    # One weight (1 KiB) and one bias per bucket: DDP_LAYERS buckets.
    ddp = dptc.DistributedDataParallel(model, bucket_cap_mb=WIDTH * WIDTH * 4 / 2 ** 20)
    generator = torch.Generator().manual_seed(SEED + dptc.get_rank())

    def step():
        ddp(torch.randn(4, WIDTH, generator=generator)).square().mean().backward()

    def step_without_sync():
        with ddp.no_sync():
            step()

    # The first backward's order rebuilds the buckets at the next forward (one broadcast):
    # two steps before any run, so every run sees the final buckets.
    step()
    step()
    return (step_without_sync if no_sync else step), \
        lambda: {"buckets": ddp._reducer_stats()["buckets"]}


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(FSDP_BLOCKS))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _fsdp(dptc, hsdp):
    torch.manual_seed(SEED)
    model = _Net()
    kwargs = {}
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["mesh"] = init_device_mesh("cpu", (dptc.get_world_size(), 1),
                                          mesh_dim_names=("replicate", "shard"))
    labels_before = []
    for block in model.blocks:
        dptc.fully_shard(block, **kwargs)
        labels_before.append(block._dptc_fsdp_state.unit.label)
    dptc.fully_shard(model, **kwargs)
    generator = torch.Generator().manual_seed(SEED + dptc.get_rank())

    def step():
        model(torch.randn(4, 8, generator=generator)).square().mean().backward()

    def extra():
        units = [b._dptc_fsdp_state.unit for b in model.blocks] + [model._dptc_fsdp_state.unit]
        return {"labels_before": labels_before, "labels": [u.label for u in units],
                "c_labels": [b.c.label for u in units for b in u.buckets]}
    return step, extra


SCENARIOS = {
    "collectives": _collectives,
    "ddp": _ddp,
    "ddp_no_sync": lambda dptc: _ddp(dptc, no_sync=True),
    "fsdp": lambda dptc: _fsdp(dptc, hsdp=False),
    "hsdp": lambda dptc: _fsdp(dptc, hsdp=True),
}

# Profiled runs per scenario (the unprofiled run comes first, once).
PROFILED_RUNS = 2


def _scenario(dptc, ranges, make):
    run, extra = make(dptc)
    with _OpenCounter(ranges) as unprofiled:
        run()
    with _OpenCounter(ranges) as profiled:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_RUNS):
                run()
    events = _dptc_events(prof)
    flag_after = ranges.flags._is_profiler_enabled
    # A run after the profiler stopped opens nothing and leaves nothing open.
    with _OpenCounter(ranges) as after:
        run()
    by_start = sorted(events, key=lambda e: e.time_range.start)
    return {
        "counts": _counts(events),
        "averages": {a.key: a.count for a in prof.key_averages() if a.key.startswith("dptc::")},
        "trace_counts": _trace_counts(prof),
        "calls_unprofiled": unprofiled.calls,
        "calls_profiled": profiled.calls,
        "calls_after": after.calls,
        "flag_after": flag_after,
        "order": [e.name for e in by_start],
        "threads": sorted({e.thread for e in events}),
        "spans": [[e.name, e.time_range.start, e.time_range.end] for e in by_start],
        "extra": extra(),
    }


def _ddp_failure(dptc):
    """A synced backward in which layer 0 gets no gradient, under the profiler: the buckets
    of layers DDP_LAYERS-1..1 launch, bucket DDP_LAYERS-1 (layer 0's) never fills, and the
    finalize callback raises after aborting the group.  Returns the error and the ranges."""
    torch.manual_seed(SEED)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DDP_LAYERS)])
    ddp = dptc.DistributedDataParallel(model, bucket_cap_mb=WIDTH * WIDTH * 4 / 2 ** 20)
    skip_first = nn.Sequential(*list(model)[1:])
    # Two full steps first: the first backward's order gives the buckets their layers, and
    # the second forward installs them (one broadcast).
    for _ in range(2):
        ddp(torch.randn(4, WIDTH)).sum().backward()
    error = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        try:
            ddp.forward(torch.randn(4, WIDTH))      # arms the reducer
            skip_first(torch.randn(4, WIDTH)).sum().backward()
        except RuntimeError as raised:
            error = str(raised)
    return {"error_message": error, "counts": _counts(_dptc_events(prof)),
            "state": ddp._reducer.state}


def profile_cases(scenarios):
    dptc = load_impl("dptc").module
    from dptc import _ranges
    results = {}
    for name in scenarios:
        try:
            results[name] = _scenario(dptc, _ranges, SCENARIOS[name])
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = {"error": traceback.format_exc()}
    # Last: it aborts the group.
    try:
        results["ddp_failure"] = _ddp_failure(dptc)
    except Exception:  # noqa: BLE001
        results["ddp_failure"] = {"error": traceback.format_exc()}
    dptc.destroy_process_group()
    return results
