"""The C reducer's own behaviour, which the DDP equivalence tests (tests/test_ddp.py) cannot pin
down because tolerances or timing hide it.

Layer: one and two ranks (tests/_launch.py run_ranks); rank-side bodies at the bottom.
- The compression hooks round exactly like torch's casts: every float16/bfloat16 bit pattern,
  every tie between neighbours, subnormals, overflow to infinity, NaN.  With one rank the
  all-reduce is the identity, so .grad must equal grad.to(16 bits).to(float32) bit for bit.
- Buckets are rebuilt once, from the order gradients arrived in the first backward, and the
  rebuilt assignment is the same on every rank (rank 0's order).
- Buckets are launched during backward, not only at its end (the overlap DDP exists for),
  unless the node has fewer than two cores per rank, where they all wait for the end of
  backward ([Note: overlap] in csrc/reducer.c); DPTC_DDP_OVERLAP chooses.
"""

import os

import pytest

import torch
import torch.nn as nn

from tests._launch import run_ranks

RUN_TIMEOUT_S = 120


def test_compression_rounds_like_torch():
    mismatches = run_ranks("tests.test_ddp_reducer:compression_case", 1,
                           timeout=RUN_TIMEOUT_S)[0]
    assert mismatches == {"fp16": [], "bf16": []}, mismatches


def test_buckets_rebuilt_once_from_rank0_order():
    results = run_ranks("tests.test_ddp_reducer:rebuild_case", 2, timeout=RUN_TIMEOUT_S)
    for rank, result in enumerate(results):
        assert result["initial"] != result["rebuilt"], result
        # Before the first backward, as torch's DDP: one bucket, in definition order.  Then
        # one bucket per layer: layer 0 runs last in forward, so its gradients (0, 1) arrive
        # first, and the rebuilt assignment starts with it.
        assert result["initial"] == [list(range(12))], result
        assert sorted(result["rebuilt"][0]) == [0, 1], result
        assert sorted(result["rebuilt"][-1]) == [10, 11], result
        assert result["after_more_steps"] == result["rebuilt"], result
    assert results[0]["rebuilt"] == results[1]["rebuilt"]
    assert results[0]["params"] == results[1]["params"]


def test_overlap_setting_is_checked(monkeypatch):
    """Layer: a pure function (dptc.ddp._overlaps), no process group."""
    from dptc.ddp import _overlaps
    monkeypatch.setenv("DPTC_DDP_OVERLAP", "yes")
    with pytest.raises(ValueError, match="DPTC_DDP_OVERLAP must be auto, 0 or 1, got 'yes'"):
        _overlaps(False, None)
    monkeypatch.setenv("DPTC_DDP_OVERLAP", "0")
    assert _overlaps(True, None) is False        # the setting wins, on CUDA too
    monkeypatch.setenv("DPTC_DDP_OVERLAP", "auto")
    assert _overlaps(True, None) is True         # CUDA modules always overlap


@pytest.mark.parametrize("overlap", ["1", "0", "auto"])
def test_buckets_launch_during_backward(overlap):
    results = run_ranks("tests.test_ddp_reducer:overlap_case", 2, timeout=RUN_TIMEOUT_S,
                        env={"DPTC_DDP_OVERLAP": overlap})
    # auto: during backward only with two cores per local rank (2 ranks here).
    during = overlap == "1" or overlap == "auto" and len(os.sched_getaffinity(0)) >= 4
    for stats in results:
        assert stats["steps"] == 3, stats
        assert stats["overlap"] == during, stats
        # One bucket in the first step (torch's, before the order is known), then 6 per
        # step; with overlap, even the last one is full before the end of backward, which
        # finds nothing left to launch.
        assert stats["launched_in_backward"] == (13 if during else 0), stats
        assert stats["launched_at_end"] == (0 if during else 13), stats
        # Contiguous gradients are reduced where they are ([Note: gradients in place]).
        assert stats["launched_in_place"] == 13, stats
        # The callback's time holds its wait; without overlap it runs the buckets itself.
        assert 0 <= stats["wait_seconds"] <= stats["finalize_seconds"], stats
        assert during or stats["finalize_seconds"] > 0, stats
        # Either way the same numbers: every rank ends with rank-averaged gradients.
        assert stats["grad_rel_diff"] <= 1e-6, stats


# ---------------------------------------------------------------------------------------------
# Rank side

def _float_cases(dtype):
    """float32 values: every `dtype` value, the midpoints between neighbours (ties), values
    just around them, random floats over the whole exponent range, and specials."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    exact = patterns.view(dtype).to(torch.float32)
    finite = exact[torch.isfinite(exact)].unique()
    middle = (finite[:-1].double() + finite[1:].double()) / 2
    ties = middle.float()
    near = torch.cat([torch.nextafter(ties, torch.full_like(ties, float("inf"))),
                      torch.nextafter(ties, torch.full_like(ties, float("-inf")))])
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31, (200_000,), generator=generator, dtype=torch.int64)
    random = bits.to(torch.int32).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e10, -1e10,
                             2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14, 1e-45,
                             float("inf"), float("-inf"), float("nan")])
    return torch.cat([exact, ties, near, random, specials])


def compression_case():
    """Returns, per hook, up to 10 inputs where dptc's round trip differs from torch's cast."""
    import dptc
    import dptc.comm_hooks as hooks
    dptc.init_process_group()
    mismatches = {}
    for name, dtype, hook in (("fp16", torch.float16, hooks.fp16_compress_hook),
                              ("bf16", torch.bfloat16, hooks.bf16_compress_hook)):
        values = _float_cases(dtype)
        weight = nn.Parameter(torch.zeros(values.numel()))
        holder = nn.Module()
        holder.weight = weight
        holder.forward = lambda: (weight * values).sum()
        ddp = dptc.DistributedDataParallel(holder)
        ddp.register_comm_hook(None, hook)
        ddp().backward()
        got = weight.grad
        want = values.to(dtype).to(torch.float32)
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        bad = (~same).nonzero().flatten()[:10]
        mismatches[name] = [(values[i].item(), got[i].item(), want[i].item()) for i in bad]
    dptc.destroy_process_group()
    return mismatches


class _Reversed(nn.Module):
    """Six layers applied in reverse order of definition."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def rebuild_case():
    import dptc
    dptc.init_process_group()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = _Reversed()
    ddp = dptc.DistributedDataParallel(model, bucket_cap_mb=4 * 32 * 33 / 2 ** 20)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    result = {"initial": ddp._assignment}
    generator = torch.Generator().manual_seed(rank)
    for step in range(4):
        ddp(torch.randn(4, 32, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            result["rebuilt"] = ddp._assignment
    result["after_more_steps"] = ddp._assignment
    result["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    dptc.destroy_process_group()
    return result


def overlap_case():
    import dptc
    dptc.init_process_group()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    # One bucket per layer (weight + bias = 16.6 KB; the cap closes a bucket at 16 KB).
    ddp = dptc.DistributedDataParallel(model, bucket_cap_mb=16 * 1024 / 2 ** 20)
    reference = [p.detach().clone() for p in model.parameters()]
    rank, world = dptc.get_rank(), dptc.get_world_size()
    for step in range(3):
        ddp.zero_grad()
        batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + r))
                   for r in range(world)]
        ddp(batches[rank]).sum().backward()
    # The last step's gradients against the rank average computed here.
    single = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    for p, value in zip(single.parameters(), reference):
        p.data.copy_(value)
    sum(single(b).sum() for b in batches).div(world).backward()
    stats = ddp._reducer_stats()
    stats["overlap"] = ddp._reducer.overlap
    stats["grad_rel_diff"] = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                                 for p, q in zip(model.parameters(), single.parameters()))
    dptc.destroy_process_group()
    return stats
