"""Rank-side bodies of tests/test_ddp.py: DDP training against a single-process reference.

Every rank runs the same scenarios, in the same order, with torch's
DistributedDataParallel ("torch", on gloo) or dptc's ("dptc"). A scenario trains a small
model for a few AdamW steps on its slice of a global batch that every rank draws from the
same seeded generator; beside it, each rank trains a plain copy of the model in-process on
the whole global batch (the reference). DDP averages gradients over ranks and each rank's
loss is the mean over its slice, so the reference's loss is the mean over the global batch;
where the ranks run different code (a rank-dependent branch, BatchNorm's per-batch
statistics) the reference runs each rank's slice through that rank's code and averages the
losses instead.

A scenario's result, per rank (JSON), keyed by scenario name:
    ok            False when the scenario raised; then "error" holds the traceback
    ref_rel       max over parameters of max|p - p_ref| / max|p_ref| (per-tensor, inf-norm)
    params        {name: flat list of floats}, the trained parameters (for cross-rank checks)
    buffers       {name: flat list}, read after one more forward in eval mode, which makes
                  DDP broadcast rank 0's buffers (broadcast_buffers=True)
    buffer_ref_rel  like ref_rel, for the buffers as training left them (before that forward)
    grad_rel      like ref_rel for the gradients before each optimizer step (max over steps;
                  GradScaler: both sides scaled alike)
    grad_none / ref_grad_none   per step, names whose .grad is None before the optimizer step
    state_dict_keys / inner_state_dict_keys / module_is_inner   the wrapper's surface
    losses        the rank's local loss per step
"""

import contextlib
import dataclasses
import os
import sys
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests._rank import load_impl, start_clock

# The tiny GPT comes from the example, so the tests exercise the model the project ships.
from examples.gpt import GPT, build_gpt
from tests._compare import max_rel

__all__ = ["SCENARIOS", "BUFFER_SYNC_CASES", "train_cases", "missing_grad_case",
           "buffer_sync_cases"]

SEED = 1234
# Adam normalises every gradient element, so rounding noise (the all-reduce sums in another
# order than the single-process reference) in a small gradient becomes a difference of a
# fraction of lr in its update. Parameter differences therefore scale with lr: lr=1e-2 gave
# up to 8e-6 (tiny GPT, 3 ranks), lr=1e-3 gives <5e-7, well inside the 1e-5 tolerance, while
# four steps still move the weights by ~4e-3 (a wrong gradient shows as ~1e-2). Weights whose
# gradient is mathematically zero are worse (pure noise, scaled by lr/eps): the models have
# none (see BatchNormNet and tiny_gpt).
# Adam is also blind to the gradient's scale (sum instead of mean gives the same update), so
# the gradients themselves are compared too, before each optimizer step.
LR = 1e-3
WEIGHT_DECAY = 0.01
ADAM_EPS = 1e-8
ROWS_PER_RANK = 8


# ---------------------------------------------------------------------------------------------
# Models

class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, classes=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class MLPWithUnused(MLP):
    """An MLP with one layer that no rank ever calls."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)


class BranchMLP(nn.Module):
    """A shared trunk and two heads; the caller picks the head, or "both" (rank-dependent in
    the tests)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.head_a = nn.Linear(32, 8)
        self.head_b = nn.Linear(32, 8)

    def forward(self, x, branch):
        hidden = torch.tanh(self.trunk(x))
        if branch == "both":
            return self.head_a(hidden) + self.head_b(hidden)
        return self.head_a(hidden) if branch == 0 else self.head_b(hidden)


class OddSizes(nn.Module):
    """Parameters of awkward sizes: 7x13, 13, a zero-size one, 13x5, 5 and a scalar."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.empty = nn.Parameter(torch.empty(0))
        self.fc2 = nn.Linear(13, 5)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        # empty.sum() is 0 but puts the zero-size parameter in the graph, so it gets a
        # (zero-size) gradient every step like any used parameter.
        hidden = torch.tanh(self.fc1(x)) + self.empty.sum()
        return self.fc2(hidden) * self.scale


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before batch norm: it would only receive rounding noise (the normalisation
        # subtracts it again), which Adam amplifies into differences of up to lr.
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


class ConvNet(nn.Module):
    """A 3x3 convolution and a linear layer; see channels_last_convnet."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 8)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class ReentrantTwice(nn.Module):
    """A block called twice, each time under reentrant activation checkpointing: each nested
    backward accumulates into the block's .grad on its own, so its hooks fire twice per
    backward, which static_graph=True allows (torch's DDP raises without it). Plus a layer no
    rank uses."""

    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 32)
        self.block = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        hidden = torch.tanh(self.fc_in(x))
        hidden = torch.tanh(checkpoint(self.block, hidden, use_reentrant=True))
        hidden = torch.tanh(checkpoint(self.block, hidden, use_reentrant=True))
        return self.head(hidden)


class ReentrantHead(nn.Module):
    """Reentrant activation checkpointing down to the head: the first gradients of a backward
    arrive inside a nested backward, which ends long before fc_in's gradient exists."""

    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(16, 32)
        self.block = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        hidden = torch.tanh(self.fc_in(x))
        hidden = torch.tanh(checkpoint(self.block, hidden, use_reentrant=True))
        return checkpoint(self.head, hidden, use_reentrant=True)


class SparseEmbeddings(nn.Module):
    """Token and bag embeddings with sparse gradients under a dense head (the recommender
    model's shape). With branch 1 the bag is left out (rank-dependent in the tests)."""

    def __init__(self, vocab=32, dim=8, classes=8):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim, sparse=True)
        self.bag = nn.EmbeddingBag(vocab, dim, mode="sum", sparse=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, branch=0):
        hidden = self.tokens(x).mean(1)
        if branch != 1:
            hidden = hidden + self.bag(x)
        return self.head(torch.tanh(hidden))


class SparseOnly(nn.Module):
    """A model whose only parameter gets sparse gradients."""

    def __init__(self, vocab=32, classes=8):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, classes, mode="mean", sparse=True)

    def forward(self, x):
        return self.bag(x)


def channels_last_convnet():
    """The convolution's weight is channels_last, so its gradient is not contiguous: one bucket
    holds pieces reduced where autograd left them (the linear layer's) and a piece copied into
    the bucket and back (the convolution's)."""
    return ConvNet().to(memory_format=torch.channels_last)


def frozen_mlp():
    model = MLP()
    model.fc2.requires_grad_(False)  # frozen middle layer: gradients flow through, not into it
    return model


def tiny_gpt():
    # bias=False: see GPT's docstring (the attention key bias only ever sees rounding noise).
    return build_gpt(vocab=32, d_model=16, n_layer=1, n_head=2, ctx=8, tie_weights=True,
                     bias=False)


# ---------------------------------------------------------------------------------------------
# Data and losses

def classification_batch(generator, rows, d_in=16, classes=8):
    return (torch.randn(rows, d_in, generator=generator),
            torch.randint(classes, (rows,), generator=generator))


def image_batch(generator, rows):
    return (torch.randn(rows, 3, 4, 4, generator=generator),
            torch.randint(8, (rows,), generator=generator))


def odd_batch(generator, rows):
    return classification_batch(generator, rows, d_in=7, classes=5)


def token_batch(generator, rows, vocab=32, ctx=8):
    tokens = torch.randint(vocab, (rows, ctx + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def sparse_batch(generator, rows, vocab=32, ctx=6, classes=8):
    """Tokens drawn from the first half of the vocabulary: rows of the tables stay unused,
    and the ranks' gradients overlap in the rows they share."""
    return (torch.randint(vocab // 2, (rows, ctx), generator=generator),
            torch.randint(classes, (rows,), generator=generator))


def classification_loss(model, batch, rank):
    inputs, labels = batch
    return F.cross_entropy(model(inputs).float(), labels)


def branch_loss(model, batch, rank):
    inputs, labels = batch
    return F.cross_entropy(model(inputs, branch=rank % 2), labels)


def extra_head_loss(model, batch, rank):
    """Rank 0 uses every parameter, the others leave head_b out: a rank with nothing unused
    meets ranks with unused parameters."""
    inputs, labels = batch
    return F.cross_entropy(model(inputs, branch="both" if rank == 0 else 0), labels)


def penalty_loss(model, batch, rank):
    """Cross-entropy plus the squared gradient of it with respect to the inputs (a gradient
    penalty): a torch.autograd.grad through the model's outputs runs before the backward
    that reaches the parameters."""
    inputs, labels = batch
    inputs = inputs.clone().requires_grad_()
    loss = F.cross_entropy(model(inputs), labels)
    grad, = torch.autograd.grad(loss, inputs, create_graph=True)
    return loss + grad.square().sum()


def gpt_loss(model, batch, rank):
    inputs, targets = batch
    return GPT.loss(model(inputs), targets)


# ---------------------------------------------------------------------------------------------
# Scenarios

@dataclasses.dataclass(frozen=True)
class Scenario:
    build: Callable[[], nn.Module]
    batch: Callable = classification_batch
    loss: Callable = classification_loss  # (model, local batch, rank) -> mean over the batch
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    steps: int = 4
    micro_steps: int = 1                 # > 1: gradient accumulation
    accumulate: str = "no_sync"          # or "attribute": set require_backward_grad_sync
    per_rank_reference: bool = False     # reference averages each rank's own loss
    seed_by_rank: bool = False           # ranks initialise differently; DDP must broadcast
    autocast: bool = False               # bf16 autocast (CPU)
    scaler: bool = False                 # torch.amp.GradScaler("cpu")
    hook: Optional[str] = None           # "allreduce", "fp16_compress", "bf16_compress"
    hook_source: str = "torch"           # "torch": torch's default_hooks; "impl": the impl's own
    eval_forward: bool = False           # one more forward in eval mode after training
    set_static_graph: bool = False       # ddp._set_static_graph() after construction
    optimizer: str = "adamw"             # "sparse": SparseAdam for sparse gradients, else AdamW


SCENARIOS = {
    "default": Scenario(MLP),
    "tiny_buckets": Scenario(MLP, ddp_kwargs={"bucket_cap_mb": 0.001}),
    # A bucket per parameter once rebuilt, the zero-size one too, as torch's.
    "zero_cap": Scenario(OddSizes, batch=odd_batch, ddp_kwargs={"bucket_cap_mb": 0}),
    "bucket_view": Scenario(MLP, ddp_kwargs={"gradient_as_bucket_view": True}),
    "no_sync": Scenario(MLP, micro_steps=3),
    "sync_attribute": Scenario(MLP, micro_steps=3, accumulate="attribute"),
    "unused_global": Scenario(MLPWithUnused, ddp_kwargs={"find_unused_parameters": True}),
    "rank_branch": Scenario(BranchMLP, loss=branch_loss, per_rank_reference=True,
                            ddp_kwargs={"find_unused_parameters": True}),
    "rank_extra_head": Scenario(BranchMLP, loss=extra_head_loss, per_rank_reference=True,
                                ddp_kwargs={"find_unused_parameters": True,
                                            "bucket_cap_mb": 0.001}),
    "tied_gpt": Scenario(tiny_gpt, batch=token_batch, loss=gpt_loss),
    # static_graph=True: unused parameters need no find_unused_parameters.
    "static_unused": Scenario(MLPWithUnused, ddp_kwargs={"static_graph": True}),
    "static_rank_branch": Scenario(BranchMLP, loss=branch_loss, per_rank_reference=True,
                                   ddp_kwargs={"static_graph": True, "bucket_cap_mb": 0.001}),
    "static_no_sync": Scenario(MLPWithUnused, micro_steps=3, ddp_kwargs={"static_graph": True}),
    # The older spelling, DDP._set_static_graph() before the first step.
    "set_static_unused": Scenario(MLPWithUnused, set_static_graph=True),
    "static_bucket_view": Scenario(BranchMLP, loss=extra_head_loss, per_rank_reference=True,
                                   ddp_kwargs={"static_graph": True,
                                               "gradient_as_bucket_view": True}),
    "static_reentrant_twice": Scenario(ReentrantTwice, ddp_kwargs={"static_graph": True}),
    "reentrant_head": Scenario(ReentrantHead),
    "reentrant_head_unused": Scenario(ReentrantHead,
                                      ddp_kwargs={"find_unused_parameters": True}),
    "penalty": Scenario(MLP, loss=penalty_loss, per_rank_reference=True),
    "static_penalty": Scenario(MLPWithUnused, loss=penalty_loss, per_rank_reference=True,
                               ddp_kwargs={"static_graph": True}),
    "frozen": Scenario(frozen_mlp),
    "channels_last": Scenario(channels_last_convnet, batch=image_batch),
    "odd_sizes": Scenario(OddSizes, batch=odd_batch),
    "rank_init": Scenario(MLP, seed_by_rank=True),
    "buffers": Scenario(BatchNormNet, per_rank_reference=True, eval_forward=True,
                        ddp_kwargs={"broadcast_buffers": True}),
    "autocast_bf16": Scenario(MLP, autocast=True),
    "amp_scaler": Scenario(MLP, autocast=True, scaler=True),
    "hook_allreduce": Scenario(MLP, hook="allreduce"),
    "hook_fp16": Scenario(MLP, hook="fp16_compress"),
    "hook_bf16": Scenario(MLP, hook="bf16_compress"),
    "hook_allreduce_own": Scenario(MLP, hook="allreduce", hook_source="impl"),
    "hook_fp16_own": Scenario(MLP, hook="fp16_compress", hook_source="impl"),
    "hook_bf16_own": Scenario(MLP, hook="bf16_compress", hook_source="impl"),
    # Sparse gradients (nn.Embedding/EmbeddingBag with sparse=True).
    "sparse": Scenario(SparseEmbeddings, batch=sparse_batch, optimizer="sparse"),
    "sparse_no_sync": Scenario(SparseEmbeddings, batch=sparse_batch, optimizer="sparse",
                               micro_steps=3),
    "sparse_only": Scenario(SparseOnly, batch=sparse_batch, optimizer="sparse"),
    # Beyond torch, which raises: a sparse parameter that one rank leaves out.
    "sparse_rank_unused": Scenario(SparseEmbeddings, batch=sparse_batch, loss=branch_loss,
                                   per_rank_reference=True, optimizer="sparse",
                                   ddp_kwargs={"find_unused_parameters": True}),
}


# ---------------------------------------------------------------------------------------------
# Helpers

def _log(message):
    print(f"[rank {os.environ.get('RANK')}] {message}", file=sys.stderr, flush=True)


def _wrapper_class(impl):
    if impl == "dptc":
        import dptc
        return dptc.DistributedDataParallel
    return torch.nn.parallel.DistributedDataParallel


def _hook(impl, kind, source):
    if impl == "torch" and kind == "bf16_compress":
        return cpu_bf16_compress_hook
    if source == "impl" and impl == "dptc":
        import dptc.comm_hooks as hooks
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks
    return getattr(hooks, f"{kind}_hook")


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)


def _optimizers(kind, model):
    """AdamW over every parameter, or (kind "sparse") SparseAdam over those of modules with
    sparse=True and AdamW over the rest."""
    if kind == "adamw":
        return [_adamw(model.parameters())]
    sparse = [p for m in model.modules() if getattr(m, "sparse", False)
              for p in m.parameters(recurse=False)]
    dense = [p for p in model.parameters() if all(p is not q for q in sparse)]
    optimizers = [torch.optim.SparseAdam(sparse, lr=LR, eps=ADAM_EPS)]
    return optimizers + ([_adamw(dense)] if dense else [])


def _dense(grad):
    return grad.to_dense() if grad.is_sparse else grad


def cpu_bf16_compress_hook(process_group, bucket):
    """What torch's bf16_compress_hook does, for the torch side on CPU.

    torch's DDP refuses its own bf16_compress_hook unless CUDA and NCCL are there (TypeError:
    "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+"), and it recognises
    that hook by name; this one has the same steps under another name: cast the bucket to
    bfloat16, divide by the group size in bfloat16, all-reduce (sum) over gloo, and copy the
    result back into the float32 bucket.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    flat = bucket.buffer()
    compressed = flat.to(torch.bfloat16).div_(group.size())

    def write_back(future):
        flat.copy_(future.value()[0])
        return flat

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(write_back)


def _batch_generator(step, micro):
    return torch.Generator().manual_seed(SEED * 7919 + 100 * step + micro)


def _rows(rank):
    return slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)


def _take(batch, rows):
    return tuple(part[rows] for part in batch)


def _flat(tensors):
    return {name: tensor.detach().flatten().tolist() for name, tensor in tensors}


def _autocast(enabled):
    if enabled:
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _reference_loss(scenario, model, global_batch, world_size):
    """A loss whose gradient, in one process, is what DDP's averaged gradient should be."""
    if not scenario.per_rank_reference:
        return scenario.loss(model, global_batch, None)
    # Each rank's slice through that rank's code. Buffers follow DDP's broadcast_buffers:
    # every rank's forward starts from rank 0's buffers, and rank 0's update is what lasts.
    # Buffers are swapped for fresh tensors rather than overwritten: batch norm keeps its
    # running statistics for backward, and an in-place copy would invalidate them.
    start = dict(model.named_buffers())
    after_rank0 = None
    total = 0.0
    for rank in range(world_size):
        _set_buffers(model, {name: buf.clone() for name, buf in start.items()})
        total = total + scenario.loss(model, _take(global_batch, _rows(rank)), rank)
        if rank == 0:
            after_rank0 = dict(model.named_buffers())
    _set_buffers(model, after_rank0)
    return total / world_size


def _set_buffers(model, buffers):
    for name, tensor in buffers.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, tensor)


def _sync_context(scenario, ddp, micro):
    last = micro == scenario.micro_steps - 1
    if scenario.micro_steps == 1:
        return contextlib.nullcontext()
    if scenario.accumulate == "attribute":
        ddp.require_backward_grad_sync = last  # the nanoGPT way
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else ddp.no_sync()


# ---------------------------------------------------------------------------------------------
# One scenario

def run_scenario(name, impl, rank, world_size):
    scenario = SCENARIOS[name]
    wrapper = _wrapper_class(impl)

    torch.manual_seed(SEED + (rank if scenario.seed_by_rank else 0))
    inner = scenario.build()
    torch.manual_seed(SEED)  # rank 0's initialisation, which DDP broadcasts
    reference = scenario.build()

    ddp = wrapper(inner, **scenario.ddp_kwargs)
    if scenario.set_static_graph:
        ddp._set_static_graph()
    if scenario.hook is not None:
        ddp.register_comm_hook(None, _hook(impl, scenario.hook, scenario.hook_source))
    optimizers = _optimizers(scenario.optimizer, inner)
    ref_optimizers = _optimizers(scenario.optimizer, reference)
    scaler = torch.amp.GradScaler("cpu") if scenario.scaler else None
    ref_scaler = torch.amp.GradScaler("cpu") if scenario.scaler else None

    losses = []
    grad_rel = 0.0
    grad_none, ref_grad_none = [], []   # per step: names whose .grad is None
    for step in range(scenario.steps):
        step_loss = 0.0
        for micro in range(scenario.micro_steps):
            global_batch = scenario.batch(_batch_generator(step, micro),
                                          ROWS_PER_RANK * world_size)
            with _sync_context(scenario, ddp, micro):
                with _autocast(scenario.autocast):
                    loss = scenario.loss(ddp, _take(global_batch, _rows(rank)), rank)
                loss = loss / scenario.micro_steps
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.item()

            with _autocast(scenario.autocast):
                ref_loss = _reference_loss(scenario, reference, global_batch, world_size)
            ref_loss = ref_loss / scenario.micro_steps
            (ref_scaler.scale(ref_loss) if ref_scaler else ref_loss).backward()
        losses.append(step_loss)

        grads = {n: _dense(p.grad) for n, p in inner.named_parameters() if p.grad is not None}
        ref_grads = {n: _dense(p.grad) for n, p in reference.named_parameters()
                     if p.grad is not None}
        grad_none.append(sorted(n for n, p in inner.named_parameters() if p.grad is None))
        ref_grad_none.append(sorted(n for n, p in reference.named_parameters()
                                    if p.grad is None))
        common = grads.keys() & ref_grads.keys()
        grad_rel = max(grad_rel, max_rel({n: grads[n] for n in common},
                                              {n: ref_grads[n] for n in common}))
        for opts, scale in ((optimizers, scaler), (ref_optimizers, ref_scaler)):
            for opt in opts:
                if scale is not None:
                    scale.step(opt)
                else:
                    opt.step()
                opt.zero_grad(set_to_none=True)
            if scale is not None:
                scale.update()

    result = {
        "ok": True,
        "ref_rel": max_rel(dict(inner.named_parameters()),
                                dict(reference.named_parameters())),
        "params": _flat(inner.named_parameters()),
        "grad_rel": grad_rel,
        "grad_none": grad_none,
        "ref_grad_none": ref_grad_none,
        "losses": losses,
        "module_is_inner": ddp.module is inner,
        "state_dict_keys": list(ddp.state_dict().keys()),
        "inner_state_dict_keys": list(inner.state_dict().keys()),
    }
    if scenario.eval_forward:
        # Training leaves each rank with its own last update of the buffers; rank 0's is the
        # one the reference follows. The next forward starts by broadcasting rank 0's.
        result["buffer_ref_rel"] = max_rel(dict(inner.named_buffers()),
                                                dict(reference.named_buffers()))
        ddp.eval()
        with torch.no_grad():
            ddp(scenario.batch(_batch_generator(scenario.steps, 0), ROWS_PER_RANK)[0])
        result["buffers"] = _flat(inner.named_buffers())
        result["eval_buffer_ref_rel"] = max_rel(dict(inner.named_buffers()),
                                                     dict(reference.named_buffers()))
    return result


# ---------------------------------------------------------------------------------------------
# Rank entry points (tests._rank calls these with the JSON kwargs)

def _start(impl, init_torch):
    """Initialises the way a user script would: torch's DDP always needs torch.distributed;
    dptc is tried both after the script initialised torch.distributed (gloo) itself and
    without it (dptc then initialises on first use, in the wrapper's constructor)."""
    if impl == "torch" or init_torch:
        load_impl("torch")
    if impl == "dptc":
        load_impl("dptc")


def _finish(impl):
    if impl == "dptc":
        import dptc
        if dptc.is_initialized():
            dptc.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


def train_cases(impl, scenarios, init_torch=True):
    """Runs the named scenarios in order; returns {name: result}. A scenario that raises is
    reported as {"ok": False, "error": traceback} and the next one still runs."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _start(impl, init_torch)
    results = {}
    for name in scenarios:
        began = time.perf_counter()
        _log(f"{impl} {name}: start")
        try:
            results[name] = run_scenario(name, impl, rank, world_size)
        except Exception:  # noqa: BLE001 - reported per scenario, the run goes on
            results[name] = {"ok": False, "error": traceback.format_exc()}
            _log(f"{impl} {name}: raised\n{results[name]['error']}")
        results[name]["seconds"] = time.perf_counter() - began
        _log(f"{impl} {name}: done in {results[name]['seconds']:.2f} s")
    _finish(impl)
    return results


def missing_grad_case(impl, init_torch=True, steps=3):
    """A parameter that never gets a gradient, without find_unused_parameters: DDP must raise
    a RuntimeError that names find_unused_parameters (torch: at the next forward), not hang.
    Returns where and what was raised, or {"raised": False}."""
    rank = int(os.environ["RANK"])
    _start(impl, init_torch)
    torch.manual_seed(SEED)
    ddp = _wrapper_class(impl)(MLPWithUnused())
    optimizer = _adamw(ddp.parameters())
    outcome = {"raised": False}
    start_clock()
    began = time.perf_counter()
    for step in range(steps):
        inputs, labels = classification_batch(_batch_generator(step, 0), ROWS_PER_RANK)
        phase = "forward"
        try:
            output = ddp(inputs)
            phase = "backward"
            F.cross_entropy(output, labels).backward()
            phase = "step"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except Exception as error:  # noqa: BLE001 - the error is the result
            outcome = {
                "raised": True, "step": step, "phase": phase,
                "type": type(error).__name__,
                "mro": [cls.__name__ for cls in type(error).__mro__],
                "message": str(error),
                "seconds": time.perf_counter() - began,
                "rank": rank,
            }
            break
    _finish(impl)
    return outcome


# Constructor arguments that decide which broadcasts the buffers get: (positional arguments
# after the module, keyword arguments, a value set to ddp.broadcast_buffers after construction).
BUFFER_SYNC_CASES = {
    "default": ((), {}, None),
    "forward_sync_off": ((), {"forward_sync_buffers": False}, None),
    "forward_sync_on": ((), {"forward_sync_buffers": True}, None),
    "broadcast_off": ((), {"broadcast_buffers": False}, None),
    "broadcast_on": ((), {"broadcast_buffers": True}, None),
    "broadcast_off_forward_sync_on": ((), {"broadcast_buffers": False,
                                           "forward_sync_buffers": True}, None),
    "broadcast_on_forward_sync_off": ((), {"broadcast_buffers": True,
                                           "forward_sync_buffers": False}, None),
    "no_init_sync": ((), {"init_sync": False}, None),
    # torch 2.13's positional order: device_ids, output_device, dim, broadcast_buffers,
    # init_sync.
    "positional_no_init_sync": ((None, None, 0, None, False), {}, None),
    "positional_broadcast_off": ((None, None, 0, False, True), {}, None),
    "attribute_off": ((), {}, False),
}


def buffer_sync_cases(impl):
    """Per case of BUFFER_SYNC_CASES, on a BatchNorm1d whose weight and running_var are
    1 + rank: the weight and running_var right after construction, running_var after one eval
    forward that began at 10 + rank, and the wrapper's forward_sync_buffers and
    broadcast_buffers."""
    import warnings
    rank = int(os.environ["RANK"])
    _start(impl, init_torch=False)
    wrapper = _wrapper_class(impl)
    results = {}
    for name, (args, kwargs, attribute) in BUFFER_SYNC_CASES.items():
        layer = nn.BatchNorm1d(2)
        with torch.no_grad():
            layer.weight.fill_(1 + rank)
            layer.running_var.fill_(1 + rank)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated
            ddp = wrapper(layer, *args, **kwargs)
        if attribute is not None:
            ddp.broadcast_buffers = attribute
        result = {"weight": layer.weight[0].item(), "buffer": layer.running_var[0].item()}
        with torch.no_grad():
            layer.running_var.fill_(10 + rank)
            ddp.eval()(torch.zeros(3, 2))
        result.update(forward_buffer=layer.running_var[0].item(),
                      forward_sync_buffers=ddp.forward_sync_buffers,
                      broadcast_buffers=ddp.broadcast_buffers)
        results[name] = result
    _finish(impl)
    return results


def buffers_after_wrapping(impl):
    """Buffers changed after construction, each set to 10 + rank before an eval forward:
    a BatchNorm1d's running_var replaced by a new tensor, a buffer registered on it, and a
    buffer registered on a Linear that had none when wrapped.  Returns each one's first value
    on this rank after the forward (10 where rank 0's was broadcast) and the wrapper's
    modules_buffers count."""
    rank = int(os.environ["RANK"])
    _start(impl, init_torch=False)
    wrapper = _wrapper_class(impl)
    norm, linear = nn.BatchNorm1d(2), nn.Linear(2, 2)
    with_buffers, without = wrapper(norm), wrapper(linear)
    results = {"counts": [len(with_buffers.modules_buffers), len(without.modules_buffers)]}
    norm.running_var = torch.full((2,), 10.0 + rank)
    norm.register_buffer("added", torch.full((1,), 10.0 + rank))
    linear.register_buffer("added", torch.full((1,), 10.0 + rank))
    with torch.no_grad():
        with_buffers.eval()(torch.zeros(3, 2))
        without(torch.zeros(3, 2))
    results.update(replaced=norm.running_var[0].item(), added=norm.added.item(),
                   added_unbuffered=linear.added.item(),
                   counts_after=[len(with_buffers.modules_buffers),
                                 len(without.modules_buffers)])
    _finish(impl)
    return results


def copied_wrappers(impl):
    """copy.deepcopy of a DDP wrapper (an EMA copy) and a torch.save / torch.load round trip
    of one: each copy trains as a DDP of its own (3 SGD steps on rank-dependent data) next to
    the original.  Returns every model's parameters after training, and what pickling a
    wrapper over a subgroup raised."""
    import copy
    import io
    rank = int(os.environ["RANK"])
    _start(impl, init_torch=False)
    wrapper = _wrapper_class(impl)
    torch.manual_seed(SEED)
    original = wrapper(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    copied = copy.deepcopy(original)
    buffer = io.BytesIO()
    torch.save(original, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    results = {"types": [type(m).__name__ for m in (copied, loaded)]}
    for name, model in (("original", original), ("copied", copied), ("loaded", loaded)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results[name] = [p.detach().flatten().tolist() for p in model.parameters()]
    if impl == "dptc":
        import dptc
        sub = wrapper(nn.Linear(2, 2), process_group=dptc.new_group([0, 1]))
        try:
            copy.deepcopy(sub)
            results["subgroup_error"] = None
        except RuntimeError as error:
            results["subgroup_error"] = str(error)
    _finish(impl)
    return results


class _ToDouble(nn.Module):
    def forward(self, x):
        return x.double()


def logging_data(impl):
    """DDP._get_ddp_logging_data() after 2 synced steps of a float32 model with a float64
    head (find_unused_parameters, a 1 MiB bucket cap), with
    _set_ddp_runtime_logging_sample_rate(2) set first; returns the data and what a sample
    rate of 0 raised."""
    _start(impl, init_torch=False)
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2).double())
    model.insert(2, _ToDouble())
    ddp = _wrapper_class(impl)(model, bucket_cap_mb=1, find_unused_parameters=True)
    ddp._set_ddp_runtime_logging_sample_rate(2)
    for step in range(2):
        ddp(torch.randn(3, 4)).sum().backward()
    data = ddp._get_ddp_logging_data()
    try:
        ddp._set_ddp_runtime_logging_sample_rate(0)
        error = None
    except ValueError as caught:
        error = str(caught)
    _finish(impl)
    return {"data": {k: v for k, v in data.items() if isinstance(v, (int, str))},
            "error": error}


class _ComplexNet(nn.Module):
    """A real layer into complex64 and complex128 weights (complex parameters train under
    torch's DDP: their gradients are averaged as real pairs)."""

    def __init__(self):
        super().__init__()
        self.real = nn.Linear(4, 6)
        self.w64 = nn.Parameter(torch.randn(6, 3, dtype=torch.complex64))
        self.w128 = nn.Parameter(torch.randn(3, 2, dtype=torch.complex128))

    def forward(self, x):
        h = self.real(x).to(torch.complex64) @ self.w64
        return (h.to(torch.complex128) @ self.w128).abs()


def complex_params(impl):
    """3 SGD steps of _ComplexNet on rank-dependent data, plain and with
    gradient_as_bucket_view; returns each run's parameters as real pairs."""
    rank = int(os.environ["RANK"])
    _start(impl, init_torch=False)
    results = {}
    for view in (False, True):
        torch.manual_seed(SEED + rank)   # different on each rank: DDP broadcasts rank 0's
        model = _ComplexNet()
        ddp = _wrapper_class(impl)(model, gradient_as_bucket_view=view)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results[f"view={view}"] = [torch.view_as_real(p.detach()).flatten().tolist()
                                   if p.is_complex() else p.detach().flatten().tolist()
                                   for p in model.parameters()]
    _finish(impl)
    return results
