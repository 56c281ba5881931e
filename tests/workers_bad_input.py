"""Rank-side bodies of tests/test_bad_input.py: mistakes a new user makes, each call's outcome
recorded as {"type", "message", "value"} so the test can pin error types, words and numbers."""

import datetime
import time

import numpy as np
import torch
from torch import nn

from tests._rank import load_impl

__all__ = ["call_cases", "model_cases", "gather_mismatch"]


def _outcome(call):
    try:
        value = call()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"type": type(error).__name__, "message": str(error), "value": None}
    return {"type": None, "message": "", "value": value}


def _in_step(api, world_size):
    """True when the group still works after the bad calls: an all-reduce gives its sum."""
    check = torch.full((3,), float(api.get_rank() + 1))
    api.all_reduce(check)
    return check.tolist() == [float(world_size * (world_size + 1) // 2)] * 3


def call_cases(impl):
    """Work.wait's timeout and broadcast's src, as torch.distributed (gloo) or dptc."""
    api = load_impl(impl)
    rank, world_size = api.get_rank(), api.get_world_size()

    def waited(timeout, late=0.0):
        def call():
            if rank == 1:
                time.sleep(late)   # the peer arrives late: the wait must not give up at once
            tensor = torch.full((4,), float(rank + 1))
            work = api.all_reduce(tensor, async_op=True)
            try:
                done = work.wait(timeout=timeout)
            finally:
                if impl == "torch":
                    work.wait()    # a refused argument leaves the collective to finish
            return [bool(done), tensor.tolist()]
        return call

    def broadcast_from(**kwargs):
        def call():
            tensor = torch.full((3,), float(rank + 10))
            api.broadcast(tensor, **kwargs)
            return tensor.tolist()
        return call

    def complex_call(kind, op=None):
        def call():
            tensor = torch.tensor([1 + 2j, rank * 1j - rank], dtype=torch.complex64)
            if kind == "all_reduce":
                api.all_reduce(tensor, **({} if op is None else {"op": op}))
                result = tensor
            elif kind == "broadcast":
                api.broadcast(tensor, 1)
                result = tensor
            elif kind == "all_gather":
                result = torch.empty(2 * world_size, dtype=torch.complex64)
                api.all_gather_into_tensor(result, tensor)
            else:   # each rank's block, gathered so every rank reports the whole result
                block = torch.empty(1, dtype=torch.complex64)
                api.reduce_scatter_tensor(block, tensor, **({} if op is None else {"op": op}))
                result = torch.empty(world_size, dtype=torch.complex64)
                api.all_gather_into_tensor(result, block)
            return [[z.real, z.imag] for z in result.tolist()]
        return call

    def strided(kind):
        """A non-contiguous tensor through each collective: the result (the same on every
        rank), and whether the memory around a sliced tensor was left alone."""
        def sliced(n, value):      # every other element of a vector of 2n, the rest 7.0
            base = torch.full((2 * n,), 7.0)
            base[::2] = value
            return base, base[::2]

        def call():
            untouched = True
            if kind == "all_reduce_transposed":
                result = (torch.arange(12.0).reshape(3, 4) + rank).t()
                api.all_reduce(result)
            elif kind == "all_reduce_sliced":
                base, result = sliced(6, torch.arange(6.0) + rank)
                api.all_reduce(result)
                untouched = bool((base[1::2] == 7.0).all())
                # torch's gloo reduces the storage's first elements instead: pinned as booleans
                return [result.tolist() == (2 * torch.arange(6.0) + 1).tolist(), untouched]
            elif kind == "all_reduce_transposed_async":
                result = (torch.arange(12.0).reshape(3, 4) + rank).t()
                work = api.all_reduce(result, async_op=True)
                value = work.get_future().wait()[0]
                work.wait()
                return [result.tolist(), value.tolist(), value.stride()]
            elif kind == "all_reduce_transposed_polled":
                result = (torch.arange(12.0).reshape(3, 4) + rank).t()
                work = api.all_reduce(result, async_op=True)
                deadline = time.monotonic() + 60
                while not work.is_completed() and time.monotonic() < deadline:
                    time.sleep(0.001)
                seen = result.tolist()     # read as soon as is_completed() said True
                work.wait()
                return [seen, result.tolist()]
            elif kind == "broadcast_transposed":
                result = (torch.arange(12.0).reshape(3, 4) * (rank + 1)).t()
                api.broadcast(result, 0)
            elif kind == "all_gather_sliced":
                base, result = sliced(2 * world_size, 0.0)
                _, mine = sliced(2, torch.tensor([rank + 1.0, rank + 2.0]))
                api.all_gather_into_tensor(result, mine)
                untouched = bool((base[1::2] == 7.0).all())
            elif kind == "reduce_scatter_sliced":
                _, data = sliced(2 * world_size, torch.arange(2.0 * world_size) + rank)
                base, block = sliced(2, 0.0)
                api.reduce_scatter_tensor(block, data)
                untouched = bool((base[1::2] == 7.0).all())
                result = torch.empty(2 * world_size)
                api.all_gather_into_tensor(result, block.contiguous())
            elif kind == "all_gather_expanded_output":
                api.all_gather_into_tensor(torch.zeros(1).expand(2 * world_size), torch.ones(2))
                return "no error"
            elif kind == "reduce_scatter_expanded_output":
                api.reduce_scatter_tensor(torch.zeros(1).expand(2), torch.ones(2 * world_size))
                return "no error"
            elif kind == "all_reduce_expanded":
                if impl == "torch":
                    # torch's gloo reduces numel elements from the data pointer: past the end
                    # of the one-element storage, so the reference does not run it.
                    return "not run"
                api.all_reduce(torch.zeros(1).expand(4))
                return "no error"
            return [result.tolist(), untouched]
        return call

    cases = {
        "int_all_reduce_avg": lambda: repr(api.all_reduce(torch.arange(4), op=api.ReduceOp.AVG)),
        "meta_all_reduce": lambda: repr(api.all_reduce(torch.ones(4, device="meta"))),
        "all_reduce_transposed": strided("all_reduce_transposed"),
        "all_reduce_sliced": strided("all_reduce_sliced"),
        "all_reduce_transposed_async": strided("all_reduce_transposed_async"),
        "all_reduce_transposed_polled": strided("all_reduce_transposed_polled"),
        "broadcast_transposed": strided("broadcast_transposed"),
        "all_gather_sliced": strided("all_gather_sliced"),
        "reduce_scatter_sliced": strided("reduce_scatter_sliced"),
        "all_gather_expanded_output": strided("all_gather_expanded_output"),
        "reduce_scatter_expanded_output": strided("reduce_scatter_expanded_output"),
        "all_reduce_expanded": strided("all_reduce_expanded"),
        "complex_all_reduce_sum": complex_call("all_reduce"),
        "complex_all_reduce_avg": complex_call("all_reduce", api.ReduceOp.AVG),
        "complex_all_reduce_max": complex_call("all_reduce", api.ReduceOp.MAX),
        "complex_broadcast": complex_call("broadcast"),
        "complex_all_gather": complex_call("all_gather"),
        "complex_reduce_scatter_sum": complex_call("reduce_scatter"),
        "complex_conj_view": lambda: api.all_reduce(torch.ones(2, dtype=torch.complex64).conj()),
        "wait_timeout_zero_late_peer": waited(datetime.timedelta(0), late=0.5),
        "wait_timeout_str": waited("5"),
        # Rank 1 arrives late, so that torch's wait on rank 0 gives up before its collective
        # can complete (without it, torch's returned True where the peer came in first; the
        # test judges torch's reference on rank 0 alone).
        "wait_timeout_negative": waited(datetime.timedelta(seconds=-1), late=0.3),
        "wait_timeout_nan": waited(float("nan"), late=0.3),
        "async_op_str": lambda: repr(api.all_reduce(torch.ones(3), async_op="no")),
        "op_int": lambda: repr(api.all_reduce(torch.ones(3), op=0)),
        "band_float32": lambda: repr(api.all_reduce(torch.ones(3), op=api.ReduceOp.BAND)),
        "bor_float16": lambda: repr(api.all_reduce(torch.ones(3, dtype=torch.float16),
                                                   op=api.ReduceOp.BOR)),
        "bxor_bfloat16_reduce_scatter": lambda: repr(api.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.bfloat16), torch.ones(2 * world_size, dtype=torch.bfloat16),
            op=api.ReduceOp.BXOR)),
        "src_numpy_int": broadcast_from(src=np.int64(1)),
        "src_0dim_tensor": broadcast_from(src=torch.tensor(1)),
        "src_float": broadcast_from(src=0.5),
        "src_str": broadcast_from(src="1"),
        "group_src_float": broadcast_from(group_src=1.0),
        "new_group_ranks_int": lambda: repr(api.module.new_group(2)),
        "new_group_ranks_str": lambda: repr(api.module.new_group("01")),
        "init_again_same_backend": lambda: api.module.init_process_group("gloo") is not None,
        "init_again_other_timeout": lambda: repr(api.module.init_process_group(
            "gloo", timeout=datetime.timedelta(seconds=5))),
        "init_again_nccl": lambda: repr(api.module.init_process_group("nccl")),
    }
    results = {name: _outcome(call) for name, call in cases.items()}
    results["in_step"] = _in_step(api, world_size)
    if impl == "dptc":
        api.destroy_process_group()
    return results


def model_cases():
    """dptc's wrappers over models that differ between the two ranks (each refused on both
    ranks, before any training), and argument mistakes of theirs; then a matched model trains
    to the single-process numbers on the same group."""
    import dptc
    api = load_impl("dptc")
    rank, world_size = api.get_rank(), api.get_world_size()
    first = rank == 0

    def linear_transposed():
        return nn.Linear(4, 6, bias=False) if first else nn.Linear(6, 4, bias=False)

    def reordered():
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 4, bias=False)
        return nn.Sequential(a, b) if first else nn.Sequential(b, a)

    def partly_frozen():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[0].weight.requires_grad_(not first)
        return model

    def ddp(make):
        return lambda: repr(dptc.DistributedDataParallel(make()))

    def fully_shard(make):
        return lambda: repr(dptc.fully_shard(make()))

    def fsdp1(make):
        return lambda: repr(dptc.FullyShardedDataParallel(nn.Sequential(make())))

    cases = {
        "ddp_transposed": ddp(linear_transposed),
        "ddp_reordered": ddp(reordered),
        "ddp_extra_bias": ddp(lambda: nn.Linear(4, 4, bias=first)),
        "ddp_dtype": ddp(lambda: nn.Linear(4, 4).to(torch.float32 if first else torch.float64)),
        "ddp_frozen_on_one_rank": ddp(partly_frozen),
        "fully_shard_transposed": fully_shard(linear_transposed),
        "fully_shard_reordered": fully_shard(reordered),
        "fully_shard_extra_bias": fully_shard(lambda: nn.Linear(4, 4, bias=first)),
        "fsdp1_transposed": fsdp1(linear_transposed),
        "ddp_device_ids_int": lambda: repr(dptc.DistributedDataParallel(nn.Linear(4, 4),
                                                                        device_ids=0)),
        "fully_shard_param_dtype_str": lambda: repr(dptc.fully_shard(
            nn.Linear(4, 4), mp_policy=dptc.MixedPrecisionPolicy(param_dtype="bf16"))),
        "fully_shard_ignored_params_tensor": lambda: repr(dptc.fully_shard(
            nn.Linear(4, 4), ignored_params=nn.Linear(4, 4).weight)),
        "fsdp1_ignored_modules_module": lambda: repr(dptc.FullyShardedDataParallel(
            nn.Sequential(nn.Linear(4, 4)), ignored_modules=nn.Linear(4, 4))),
        "fsdp1_process_group_int": lambda: repr(dptc.FullyShardedDataParallel(
            nn.Sequential(nn.Linear(4, 4)), process_group=0)),
    }
    results = {name: _outcome(call) for name, call in cases.items()}
    results["in_step"] = _in_step(api, world_size)
    results["trained"] = _train_matched(dptc, rank, world_size)
    api.destroy_process_group()
    return results


def _train_matched(dptc, rank, world_size):
    """After the refusals: DDP and fully_shard over the same model on both ranks, one step
    each, against one process on the concatenated batch; max relative difference of the
    gradients."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    torch.manual_seed(1)
    batch = torch.randn(world_size * 3, 4, dtype=torch.float64)
    reference(batch).pow(2).mean().backward()
    expected = [p.grad for p in reference.parameters()]
    mine = batch[rank * 3:(rank + 1) * 3]
    out = {}
    for kind in ("ddp", "fully_shard"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
        wrapped = (dptc.DistributedDataParallel(model) if kind == "ddp"
                   else dptc.fully_shard(model))
        wrapped(mine).pow(2).mean().backward()
        grads = [p.grad.full_tensor() if kind == "fully_shard" else p.grad
                 for p in model.parameters()]
        out[kind] = max(float((g - e).abs().max() / e.abs().max())
                        for g, e in zip(grads, expected))
    return out


def gather_mismatch():
    """Rank 0 all-gathers 4 elements, rank 1 three; every rank raises, naming both sides."""
    api = load_impl("dptc")
    rank = api.get_rank()
    api.all_reduce(torch.ones(2))
    count = 4 if rank == 0 else 3
    api.all_gather_into_tensor(torch.empty(2 * count), torch.ones(count))
    return "completed"


def pieces_mismatch(shared: bool = False, by_node: bool = False):
    """all_gather_into_tensors with the same total on every rank but other pieces: rank 0
    gathers pieces of 2 and 4 elements, the others of 4 and 2 (with `by_node`, the ranks of
    the first half, one simulated node, 2 and 4).  Every rank must raise, naming both sides'
    pieces; with `shared` the input lies in a shared buffer (FSDP's path)."""
    import dptc
    api = load_impl("dptc")
    rank, world_size = api.get_rank(), api.get_world_size()
    api.all_reduce(torch.ones(2))
    first = rank < world_size // 2 if by_node else rank == 0
    pieces = [2, 4] if first else [4, 2]
    if shared:
        mine = dptc.group.default_group().empty_shared(6, torch.float32)
        mine.copy_(torch.arange(6.0) + 10 * rank)
    else:
        mine = torch.arange(6.0) + 10 * rank
    outputs = [torch.zeros(world_size * n) for n in pieces]
    api.module.all_gather_into_tensors(outputs, mine)
    return [out.tolist() for out in outputs]
