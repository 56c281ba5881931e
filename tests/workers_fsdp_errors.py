"""Rank-side bodies of tests/test_fsdp_errors.py: fully_shard's refusals, and ranks that fail.

- ``validation_cases`` (2 ranks): every refused call, against dptc.fully_shard and, in the same
  process on the gloo group dptc set up, against torch.distributed.fsdp.fully_shard; then the
  accepted odd inputs: a 0-dim parameter passed in ignored_params (one training step, both
  implementations) and non-contiguous parameters (dptc, 3 steps against a single-process
  reference); last, an exception on every rank in forward or backward, recovered with
  reset_iter_state(), against a reference that skips the failed step.
- ``four_rank_cases`` (4 ranks): integer reshard_after_forward against a shard group of 4.
- ``fault_case`` (2 or 3 ranks): trains a small model; in one step one rank raises inside a
  block's forward, or kills itself there.  Every rank calls start_clock() as that step begins,
  so the harness's "elapsed" is the time from the step's start to the rank's error.

A case's outcome is {"type": exception class name or None, "message": str}.
"""

import os
import signal
import sys

import torch
import torch.nn as nn

from tests._compare import max_rel

__all__ = ["validation_cases", "four_rank_cases", "fault_case"]

SEED = 1234
WIDTH = 8
ROWS_PER_RANK = 4
LR = 1e-2


class Block(nn.Module):
    """Linear + tanh; ``fault`` ("raise" or "kill") makes the next forward fail after
    fully_shard's pre-forward gathered the block (peers are in or entering the gathers of the
    blocks after it); "raise_in_backward" makes the backward raise when the gradient reaches
    this block's output (the later blocks' reduce-scatters are in flight)."""

    def __init__(self, fan_in, fan_out, index, transposed=False):
        super().__init__()
        self.fc = nn.Linear(fan_in, fan_out, dtype=torch.float64)
        if transposed:
            # The same shape (fan_out, fan_in), laid out column-major: stride (1, fan_out).
            weight = torch.randn(fan_in, fan_out, dtype=torch.float64) / fan_in ** 0.5
            self.fc.weight = nn.Parameter(weight.t())
        self.index = index
        self.fault = None

    def forward(self, x):
        if self.fault == "raise":
            raise ValueError(f"injected failure in blocks.{self.index} on rank "
                             f"{os.environ['RANK']}")
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        out = torch.tanh(self.fc(x))
        if self.fault == "raise_in_backward" and out.requires_grad:
            out.register_hook(self._fail_backward)
        return out

    def _fail_backward(self, grad):
        raise ValueError(f"injected backward failure at blocks.{self.index}")


class Net(nn.Module):
    """Blocks of the given widths and a linear head, in float64."""

    def __init__(self, widths=(WIDTH,) * 5, transposed=False):
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(a, b, i, transposed) for i, (a, b) in enumerate(zip(widths, widths[1:])))
        self.head = nn.Linear(widths[-1], 2, dtype=torch.float64)
        self.mix = None
        if transposed:
            self.head.weight = nn.Parameter(
                torch.randn(widths[-1], 2, dtype=torch.float64).t() / widths[-1] ** 0.5)
            # Shape (3, 2, widths[-1]), strides (1, 3, 6): dim 0 is the innermost.
            self.mix = nn.Parameter(torch.randn(widths[-1], 2, 3, dtype=torch.float64)
                                    .permute(2, 1, 0) / widths[-1])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        if self.mix is not None:
            out = out + torch.einsum("bk,ijk->bj", x, self.mix)
        return out


class Scalar(nn.Module):
    """A Linear and a 0-dim temperature (torch's fully_shard refuses it too)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, 2, dtype=torch.float64)
        self.temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        return self.fc(x) * self.temperature


def _net(**kwargs):
    torch.manual_seed(SEED)
    return Net(**kwargs)


def _outcome(case):
    try:
        case()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": ""}


def _fsdp(impl):
    if impl == "dptc":
        import dptc
        return dptc
    import torch.distributed.fsdp as fsdp
    return fsdp


def _step(model, world, rank, generator):
    """One forward + backward on this rank's rows of a seeded global batch; the loss."""
    x = torch.randn(ROWS_PER_RANK * world, WIDTH, dtype=torch.float64, generator=generator)
    mine = x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
    loss = model(mine).square().mean()
    loss.backward()
    return loss.item()


# ---------------------------------------------------------------------------------------------
# 2 ranks: refused calls, then the accepted odd inputs

def _refusals(impl, after):
    """{case: outcome} for `impl`; `after` collects dptc's state after some refusals."""
    fs = _fsdp(impl)
    dptc_run = impl == "dptc"

    def applied_twice():
        model = _net()
        fs.fully_shard(model.blocks[0])
        fs.fully_shard(model.blocks[0])

    def child_after_parent():
        model = _net()
        fs.fully_shard(model)
        try:
            fs.fully_shard(model.blocks[0])
        finally:
            if dptc_run:
                # The refusal changed nothing: the child is still a plain Block, and the
                # parent's unit still trains (both ranks run this, so its collectives match).
                generator = torch.Generator().manual_seed(SEED)
                after["child_after_parent"] = {
                    "child_class": type(model.blocks[0]).__name__,
                    "parent_class": type(model).__name__,
                    "loss": _step(model, 2, int(os.environ["RANK"]), generator),
                    "grads": sum(p.grad is not None for p in model.parameters()),
                    "params": sum(1 for _ in model.parameters()),
                }

    def zero_dim():
        module = Scalar()
        try:
            fs.fully_shard(module)
        finally:
            if dptc_run:
                after["zero_dim"] = {"class": type(module).__name__,
                                     "weight": type(module.fc.weight.data).__name__}

    def reshard(value):
        return lambda: fs.fully_shard(_net(), reshard_after_forward=value)

    from torch.distributed.tensor import Shard

    def placement(place):
        return lambda: fs.fully_shard(nn.Linear(3, 4), shard_placement_fn=place)

    def mesh_of_wrong_type():
        module = _net()
        try:
            fs.fully_shard(module, mesh="cpu")
        finally:
            if dptc_run:
                after["mesh_of_wrong_type"] = {"class": type(module).__name__}

    def set_custom_all_gather():
        fs.fully_shard(_net()).set_custom_all_gather(None)

    def forward_prefetch_of_plain_module():
        model = _net()
        fs.fully_shard(model.blocks[0])
        model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])

    def backward_prefetch_of_plain_module():
        model = _net()
        fs.fully_shard(model.blocks[0])
        model.blocks[0].set_modules_to_backward_prefetch([model.blocks[1]])

    def prefetch_not_a_list():
        model = _net()
        fs.fully_shard(model.blocks[0])
        fs.fully_shard(model.blocks[1])
        model.blocks[0].set_modules_to_forward_prefetch(model.blocks[1])

    def noncontiguous():
        fs.fully_shard(_net(transposed=True).blocks[0])

    def dtensor_on_2d_mesh():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
        module = nn.Linear(3, 4)
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh,
                                                       [Replicate(), Shard(0)]))
        fs.fully_shard(module)

    def tied_across_units():
        # blocks.3 reuses blocks.0's weight (both WIDTH x WIDTH), as a language model ties its
        # output to its embedding; then each block is a unit, blocks.0 first.
        # torch refuses at the first forward, dptc in fully_shard(model.blocks[3]).
        model = _net()
        model.blocks[3].fc.weight = model.blocks[0].fc.weight
        for block in model.blocks:
            fs.fully_shard(block)
        fs.fully_shard(model)
        model(torch.randn(ROWS_PER_RANK, WIDTH, dtype=torch.float64))

    def left_on_meta():
        with torch.device("meta"):
            model = _net()
        for block in model.blocks:
            fs.fully_shard(block)
        fs.fully_shard(model)
        model(torch.randn(ROWS_PER_RANK, WIDTH, dtype=torch.float64)).sum().backward()

    cases = {
        "applied_twice": applied_twice,
        "left_on_meta": left_on_meta,
        "child_after_parent": child_after_parent,
        "zero_dim": zero_dim,
        "reshard_after_forward_0": reshard(0),
        "reshard_after_forward_5": reshard(5),
        "reshard_after_forward_str": reshard("yes"),
        "shard_placement_not_a_shard": placement(lambda param: "x"),
        "shard_placement_out_of_range": placement(lambda param: Shard(2)),
        "shard_placement_uneven": placement(lambda param: Shard(param.dim() - 1)),
        "mesh_of_wrong_type": mesh_of_wrong_type,
        "set_custom_all_gather": set_custom_all_gather,
        "forward_prefetch_of_plain_module": forward_prefetch_of_plain_module,
        "backward_prefetch_of_plain_module": backward_prefetch_of_plain_module,
        "prefetch_not_a_list": prefetch_not_a_list,
        "noncontiguous": noncontiguous,
        "dtensor_on_2d_mesh": dtensor_on_2d_mesh,
        "tied_across_units": tied_across_units,
    }
    return {name: _outcome(case) for name, case in cases.items()}


def _zero_dim_ignored(impl, rank):
    """fully_shard(Scalar(), ignored_params={temperature}) and one training step."""
    fs = _fsdp(impl)
    torch.manual_seed(SEED)
    module = Scalar()
    fs.fully_shard(module, ignored_params={module.temperature})
    _step(module, 2, rank, torch.Generator().manual_seed(SEED))
    return {"class": type(module).__name__,
            "temperature": type(module.temperature.data).__name__,
            "temperature_grad": module.temperature.grad is not None,
            "weight": type(module.fc.weight.data).__name__,
            "weight_grad": type(module.fc.weight.grad).__name__}


def _noncontiguous_training(rank, world, steps=3):
    """Net with transposed (stride (1, out)) weights, dims 8 -> 6 -> 7 -> 5 (7 and 5 split
    unevenly over 2 ranks) and a permuted 3-dim parameter (dim 0 of 3 rows) in the root, blocks
    and root sharded, clip_grad_norm_ and AdamW in float64, against the same model trained in
    one process on the whole batch."""
    import dptc
    widths = (WIDTH, 6, 7, 5)
    model, ref = _net(widths=widths, transposed=True), _net(widths=widths, transposed=True)
    noncontiguous = [n for n, p in model.named_parameters() if not p.is_contiguous()]
    for block in model.blocks:
        dptc.fully_shard(block)
    dptc.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED + 1)
    grad_rel = 0.0
    for _ in range(steps):
        x = torch.randn(ROWS_PER_RANK * world, WIDTH, dtype=torch.float64, generator=generator)
        model(x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]).square().mean().backward()
        ref(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        grad_rel = max(grad_rel, max_rel([p.grad.full_tensor() for p in model.parameters()],
                                          [r.grad for r in ref.parameters()]))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = [p.full_tensor() for p in model.parameters()]
    return {
        "noncontiguous": noncontiguous,
        "shapes_match": all(f.shape == r.shape for f, r in zip(full, ref.parameters())),
        "param_rel": max_rel([f.detach() for f in full], [r.detach() for r in ref.parameters()]),
        "grad_rel": grad_rel,
        "moved": max_rel([f.detach() for f in full],
                          [r.detach() for r in _net(widths=widths, transposed=True)
                           .parameters()]),
    }


def _recovery(rank, world, fault, fail_block, steps=3, fail_step=1):
    """Every rank's step `fail_step` raises (the same ValueError everywhere); each rank catches
    it, calls reset_iter_state() on the root and trains on.  The reference skips that step
    too; the rest must match it, so the failed step left nothing behind (no gradient, no
    unsharded parameter, no collective out of step)."""
    import dptc
    model, ref = _net(), _net()
    for block in model.blocks:
        dptc.fully_shard(block)
    dptc.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED + 2)
    errors = []
    for step in range(steps):
        x = torch.randn(ROWS_PER_RANK * world, WIDTH, dtype=torch.float64, generator=generator)
        model.blocks[fail_block].fault = fault if step == fail_step else None
        try:
            model(x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]).square().mean().backward()
        except ValueError as error:
            errors.append(str(error))
            model.reset_iter_state()
            opt.zero_grad()
            continue
        ref(x).square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return {"errors": errors,
            "param_rel": max_rel([p.full_tensor().detach() for p in model.parameters()],
                                  [r.detach() for r in ref.parameters()])}


def validation_cases():
    """{"dptc": {case: outcome}, "torch": {case: outcome}, "after": dptc's modules after some
    refusals, "zero_dim_ignored": {impl: outcome with value}, "noncontiguous_training": ...,
    "recovery": {"forward": ..., "backward": ...}}.
    Every rank runs the same calls in the same order, so the collectives of the calls that
    succeed match."""
    import dptc
    dptc.init_process_group()
    rank, world = dptc.get_rank(), dptc.get_world_size()
    after = {}
    result = {
        "dptc": _refusals("dptc", after),
        "torch": _refusals("torch", {}),
        "after": after,
        "zero_dim_ignored": {impl: _outcome_value(lambda: _zero_dim_ignored(impl, rank))
                             for impl in ("dptc", "torch")},
        "noncontiguous_training": _noncontiguous_training(rank, world),
        "recovery": {"forward": _recovery(rank, world, "raise", fail_block=2),
                     "backward": _recovery(rank, world, "raise_in_backward", fail_block=1)},
    }
    dptc.destroy_process_group()
    return result


def _outcome_value(case):
    try:
        return {"type": None, "message": "", "value": case()}
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"type": type(error).__name__, "message": str(error), "value": None}


# ---------------------------------------------------------------------------------------------
# 4 ranks: integer reshard_after_forward

def four_rank_cases():
    """reshard_after_forward as an int against a shard group of 4, for dptc and torch."""
    import dptc
    dptc.init_process_group()
    result = {}
    for impl in ("dptc", "torch"):
        fs = _fsdp(impl)
        for value in (1, 2, 3, 4):
            def case(value=value):
                model = _net()
                fs.fully_shard(model, reshard_after_forward=value)
            result[f"{impl}_{value}"] = _outcome(case)
    result["dptc_2_kept"] = _outcome_value(_kept_after_forward)
    dptc.destroy_process_group()
    return result


def _kept_after_forward():
    """Bytes the blocks keep after a forward with reshard_after_forward=2, then after
    set_reshard_after_forward(True) (the whole shard group again), and the padded unsharded
    bytes of the blocks."""
    import dptc
    model = _net()
    for block in model.blocks:
        dptc.fully_shard(block, reshard_after_forward=2)
    dptc.fully_shard(model)
    units = [block._fsdp_state().unit for block in model.blocks]
    generator = torch.Generator().manual_seed(SEED)
    world, rank = dptc.get_world_size(), dptc.get_rank()
    kept = []
    for reshard in (2, True):
        if reshard is True:
            model.set_reshard_after_forward(True)
        x = torch.randn(ROWS_PER_RANK * world, WIDTH, dtype=torch.float64, generator=generator)
        loss = model(x[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]).square().mean()
        kept.append(sum(unit.kept_bytes() for unit in units))
        loss.backward()
        kept.append(sum(unit.kept_bytes() for unit in units))
    padded = sum(world * -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * p.element_size()
                 for p in model.blocks.parameters())
    return {"kept": kept, "padded_blocks": padded}


# ---------------------------------------------------------------------------------------------
# 2 or 3 ranks: one rank fails inside a block's forward

def _sharded_net():
    """dptc's default group, and Net with its 4 blocks and the root fully sharded: (model,
    rank, world size)."""
    import dptc
    dptc.init_process_group()
    model = _net()
    for block in model.blocks:
        dptc.fully_shard(block)
    dptc.fully_shard(model)
    return model, dptc.get_rank(), dptc.get_world_size()


def fault_case(action, fail_rank=1, fail_step=1, fail_block=2, steps=3, on_error="propagate"):
    """Trains Net (4 blocks and the root sharded) with AdamW; at step `fail_step`,
    rank `fail_rank`'s block `fail_block` raises ValueError ("raise") or SIGKILLs its own
    process ("kill") in its forward.  Errors propagate: every rank raises what it saw, except
    that with on_error="continue" the failing rank catches its ValueError, calls
    reset_iter_state() and goes on to the next step (a rank that diverged), and with
    on_error="uncaught" it runs sys.excepthook first, as Python does for an exception nobody
    catches (the harness itself catches everything to report it)."""
    import dptc
    from tests._rank import start_clock
    model, rank, world = _sharded_net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(SEED)
    for step in range(steps):
        if step == fail_step:
            start_clock()
            if rank == fail_rank:
                model.blocks[fail_block].fault = action
        try:
            _step(model, world, rank, generator)
        except ValueError:
            if on_error == "uncaught":
                sys.excepthook(*sys.exc_info())
            if on_error != "continue":
                raise
            # What a script that logs the error and goes on would do: recover the FSDP state
            # and train the next step.  The peers are still in this step's collectives.
            model.blocks[fail_block].fault = None
            model.reset_iter_state()
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    dptc.destroy_process_group()
    return {"steps": steps}


def failed_gather_case():
    """2 ranks, Net with its 4 blocks and the root sharded: rank 1 SIGKILLs itself in
    blocks.2's forward in step 1; rank 0 catches the DistError its next gather raises,
    reshards every unit (reshard(), public) and reports each unit's unsharded storage bytes.
    A gather whose wait gave up may still be writing into its outputs (see
    _abandon_on_failure in dptc/fsdp/_unit.py), so that unit's storage must stay allocated,
    where every other unit's is freed."""
    import dptc
    model, rank, world = _sharded_net()
    generator = torch.Generator().manual_seed(SEED)
    _step(model, world, rank, generator)
    if rank == 1:
        model.blocks[2].fault = "kill"
    try:
        _step(model, world, rank, generator)
    except dptc.DistError as error:
        failure = type(error).__name__
    else:
        failure = None
    units = {"root": model, **{f"blocks.{i}": block for i, block in enumerate(model.blocks)}}
    kept = {}
    for name, module in units.items():
        module.reshard()
        unit = module.__dict__["_dptc_fsdp_state"].unit
        kept[name] = sum(p.padded.untyped_storage().nbytes() for p in unit.params)
    full = {name: sum(p.numel() * p.element_size()
                      for key, p in module.named_parameters()
                      if module is not model or not key.startswith("blocks"))
            for name, module in units.items()}
    dptc.destroy_process_group()
    return {"failure": failure, "kept": kept, "full": full}
