"""Rank-side functions for tests/test_staging.py: how a one-node collective stages its data in
the shared segment's slots (cached or streamed, see [Note: staging] in csrc/shm.c), chosen by
local rank 0 or fixed with DPTC_SHM_STAGING.

Each function returns what this rank saw, including how its group's collectives were staged
(`ProcessGroup.stagings`), so that the test can tell which path ran.
"""

from __future__ import annotations

import copy
import hashlib

import torch

from tests._rank import load_impl
from tests.workers_collectives import run_async_checks, run_sync_cases

__all__ = ["sweep", "auto_choice", "ddp_training", "bad_staging"]

# Above the size local rank 0 times (STAGING_MEASURED_BYTES, 4 MiB), and no multiple of a round.
MEASURED_COUNT = (5 << 20) // 4 + 17


def _stagings():
    import dptc
    return dptc.group.default_group().stagings(0)


def sweep(seed: int):
    """Every collective case of tests/workers_collectives.py (every op, dtype and size, the
    64.8 MiB all-reduce, the async checks), then how the collectives were staged."""
    api = load_impl("dptc")
    result = {"sync": run_sync_cases(api, seed=seed, large=True),
              "async": run_async_checks(api, seed=seed)}
    result["stagings"] = _stagings()
    api.destroy_process_group()
    return result


def _inputs(seed, call, size, count, dtype):
    """Every rank's input of all-reduce number `call`, regenerated alike on every rank."""
    out = []
    for rank in range(size):
        generator = torch.Generator().manual_seed(seed * 100_003 + call * 101 + rank)
        if dtype.is_floating_point:
            out.append(torch.randn(count, generator=generator).to(dtype))
        else:
            out.append(torch.randint(-1000, 1000, (count,), generator=generator, dtype=dtype))
    return out


def _expected(op, inputs, rank, size):
    if op == "all_reduce":
        total = inputs[0].clone()
        for other in inputs[1:]:
            total += other
        return total
    if op == "all_gather":
        return torch.cat(inputs)
    if op == "reduce_scatter":
        total = _expected("all_reduce", inputs, rank, size)
        return total.chunk(size)[rank].clone()
    return inputs[0]  # broadcast from rank 0


def auto_choice(seed: int, calls: int):
    """`calls` collectives of each staged kind (all_reduce, all_gather, reduce_scatter,
    broadcast), of at least 4 MiB, under the automatic choice, float32 and int64, each checked
    bit for bit against the math (sums in rank order).  Returns the failures and how the
    collectives were staged: every rank must report the same counts, as every rank stages each
    collective the same way."""
    import dptc
    dptc.init_process_group()
    rank, size = dptc.get_rank(), dptc.get_world_size()
    failures = []
    for call in range(calls):
        dtype = torch.int64 if call % 3 == 2 else torch.float32
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            count = MEASURED_COUNT * (size if op == "reduce_scatter" else 1)
            if op == "all_gather":
                count = MEASURED_COUNT // size + 1
            inputs = _inputs(seed, call, size, count, dtype)
            expected = _expected(op, inputs, rank, size)
            if op == "all_reduce":
                got = inputs[rank].clone()
                dptc.all_reduce(got)
            elif op == "all_gather":
                got = torch.empty(count * size, dtype=dtype)
                dptc.all_gather_into_tensor(got, inputs[rank])
            elif op == "reduce_scatter":
                got = torch.empty(count // size, dtype=dtype)
                dptc.reduce_scatter_tensor(got, inputs[rank])
            else:
                got = inputs[rank].clone()
                dptc.broadcast(got, src=0)
            if not torch.equal(got, expected):
                wrong = (got != expected).nonzero().flatten()
                failures.append(f"call {call} {op} ({dtype}): {wrong.numel()} elements "
                                f"differ, first at {wrong[0].item()}: "
                                f"{got[wrong[0]].item()} != {expected[wrong[0]].item()}")
    stagings = _stagings()
    dptc.destroy_process_group()
    return {"failures": failures, "stagings": stagings}


def _model(seed):
    torch.manual_seed(seed)
    # 1.6 M parameters, 6.3 MiB of gradients: buckets of 1 MiB and 5.3 MiB, both staged in
    # rounds, the second one timed by local rank 0.
    return torch.nn.Sequential(torch.nn.Linear(96, 1024), torch.nn.GELU(),
                               torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                               torch.nn.Linear(1024, 513), torch.nn.GELU(),
                               torch.nn.Linear(513, 10))


def _digest(module):
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train_ddp_beside_single(seed: int, steps: int):
    """dptc's DDP (gradients all-reduced where autograd left them, as pieces) trains _model for
    `steps` SGD steps on this rank's slice of a global batch, beside a single-process copy on
    the whole batch.  Returns the DDP model and the parameters' largest relative difference
    from the copy.  dptc must be initialised."""
    import dptc
    rank, size = dptc.get_rank(), dptc.get_world_size()
    reference = _model(seed)
    model = dptc.DistributedDataParallel(copy.deepcopy(reference))
    # SGD, whose update is proportional to the gradient: AdamW would turn the rounding of
    # gradients near zero into steps of lr either way.
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    per_rank = 4
    for step in range(steps):
        generator = torch.Generator().manual_seed(seed * 7919 + step)
        inputs = torch.randn(per_rank * size, 96, generator=generator)
        targets = torch.randint(10, (per_rank * size,), generator=generator)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        for optimizer in optimizers:
            optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs[mine]), targets[mine]).backward()
        torch.nn.functional.cross_entropy(reference(inputs), targets).backward()
        for optimizer in optimizers:
            optimizer.step()
    worst = max(((got - want).abs().max() / want.abs().max()).item()
                for got, want in zip(model.module.parameters(), reference.parameters()))
    return model, worst


def ddp_training(seed: int, steps: int):
    """train_ddp_beside_single: the parameters' digest, their largest relative difference from
    the single-process copy, and how the collectives were staged."""
    import dptc
    dptc.init_process_group()
    model, worst = train_ddp_beside_single(seed, steps)
    result = {"digest": _digest(model.module), "max_rel": worst, "stagings": _stagings()}
    dptc.destroy_process_group()
    return result


def bad_staging():
    """What dptc's initialisation raises with this DPTC_SHM_STAGING, as "Type: message"."""
    import dptc
    try:
        dptc.init_process_group()
    except Exception as error:  # noqa: BLE001 - the test checks the type
        return f"{type(error).__name__}: {error}"
    dptc.destroy_process_group()
    return "no error"
