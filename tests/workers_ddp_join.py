"""Rank-side bodies of tests/test_ddp_join.py: DDP's join() on uneven inputs.

Every rank trains the same small network (seed 0) with SGD for as many steps as it has
batches (BATCHES[rank] unless a scenario says otherwise: rank 0 runs out first, rank 1 last),
inside ``ddp.join()`` or torch's ``Join``, under torch's DistributedDataParallel ("torch",
gloo) or dptc's.  A scenario's result, per rank (JSON):
    params     {name: flat list}, parameters and floating buffers after the join context
    reference  the same names from one process replaying every step on the batches of the
               ranks still training (None where the scenario has no such reference)
    error      [exception type, message] raised out of the join context, or None
    steps      the steps this rank completed
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests._rank import load_impl, start_clock

BATCHES = (2, 5, 3)
ROWS = 4
LR = 0.1


class Net(nn.Module):
    """A trunk, optional batch norm, a head and, optionally, a second head used only when
    the caller says so."""

    def __init__(self, batch_norm=False, extra_head=False):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32) if batch_norm else nn.Identity()
        self.head_a = nn.Linear(32, 8)
        self.head_b = nn.Linear(32, 8) if extra_head else None

    def forward(self, x, use_b=False):
        hidden = torch.tanh(self.norm(self.trunk(x)))
        out = self.head_a(hidden)
        return out + self.head_b(hidden) if use_b else out


SCENARIOS = {
    # name: options (see _options for the defaults)
    "default": {"ddp": {"bucket_cap_mb": 0.001}},
    "effective": {"ddp": {"bucket_cap_mb": 0.001}, "divide": False},
    "unused": {"ddp": {"find_unused_parameters": True, "bucket_cap_mb": 0.001},
               "extra_head": True},
    "view_no_sync": {"ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
                     "micro": 2},
    "fp16_hook": {"hook": "fp16", "reference": False},
    "python_hook": {"hook": "python", "ddp": {"bucket_cap_mb": 0.001}},
    "buffers": {"batch_norm": True, "reference": False},
    "torch_join": {"join": "torch", "ddp": {"bucket_cap_mb": 0.001}},
    "zero": {"join": "torch", "zero": True, "reference": False},
    "late_start": {"batches": (0, 3, 2), "ddp": {"bucket_cap_mb": 0.001}},
    "static_graph": {"ddp": {"static_graph": True, "bucket_cap_mb": 0.001}},
    "throw": {"throw": True, "reference": False},
    # A parameter DDP ignores (torch's _set_params_and_buffers_to_ignore_for_model): its
    # gradient stays local, and the final sync leaves it alone.
    "ignored": {"ignore": ["head_a.weight"], "batch_norm": True, "reference": False},
    # A forward without grad at every step (an evaluation): torch's joined ranks then wait
    # for the buckets of a backward that never comes (torch's DDP sends
    # require_backward_grad_sync alone), so this one runs under dptc only.
    "eval_forward": {"eval": True, "ddp": {"bucket_cap_mb": 0.001}},
}


def _options(name):
    options = {"ddp": {}, "divide": True, "extra_head": False, "micro": 1, "hook": None,
               "batch_norm": False, "reference": True, "join": "ddp", "zero": False,
               "batches": BATCHES, "throw": False, "eval": False, "ignore": None}
    options.update(SCENARIOS[name])
    return options


def _batch(rank, step, micro):
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return (torch.randn(ROWS, 16, generator=generator),
            torch.randint(0, 8, (ROWS,), generator=generator))


def _uses_b(options, rank, step):
    # Varies by rank and step; at some steps no rank that trains uses head_b.
    return options["extra_head"] and (rank + step) % 3 == 0


def _loss(model, options, rank, step, micro):
    inputs, labels = _batch(rank, step, micro)
    logits = model(inputs, use_b=_uses_b(options, rank, step))
    return F.cross_entropy(logits, labels) / options["micro"]


def _state(model):
    return {name: t.detach().flatten().tolist()
            for name, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_floating_point()}


def _reference(options, world):
    """One process: at step i, the gradient DDP's join() makes of the ranks still training."""
    torch.manual_seed(0)
    model = Net(options["batch_norm"], options["extra_head"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = options["batches"]
    for step in range(max(batches)):
        training = [r for r in range(world) if step < batches[r]]
        divisor = world if options["divide"] else len(training)
        loss = sum(_loss(model, options, r, step, m) for r in training
                   for m in range(options["micro"])) / divisor
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _state(model)


def _hook(options):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if options["hook"] == "fp16":
        return default_hooks.fp16_compress_hook

    def averaging_hook(state, bucket):   # not one dptc runs natively: it runs in Python
        return default_hooks.allreduce_hook(state, bucket)
    return averaging_hook


def _run(impl, name, wrapper, rank, world):
    options = _options(name)
    torch.manual_seed(0)
    model = Net(options["batch_norm"], options["extra_head"])
    if options["ignore"]:
        wrapper._set_params_and_buffers_to_ignore_for_model(model, options["ignore"])
    ddp = wrapper(model, **options["ddp"])
    if options["hook"]:
        ddp.register_comm_hook(None, _hook(options))
    if options["zero"]:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                            lr=LR)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    if options["join"] == "torch":
        from torch.distributed.algorithms.join import Join
        joinables = [ddp, optimizer] if options["zero"] else [ddp]
        context = Join(joinables, divide_by_initial_world_size=options["divide"])
    else:
        context = ddp.join(divide_by_initial_world_size=options["divide"],
                           throw_on_early_termination=options["throw"])
    steps, error = 0, None
    try:
        with context:
            for step in range(options["batches"][rank]):
                for micro in range(options["micro"]):
                    sync = micro == options["micro"] - 1
                    with (ddp.no_sync() if not sync else contextlib.nullcontext()):
                        _loss(ddp, options, rank, step, micro).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if options["eval"]:
                    with torch.no_grad():
                        _loss(ddp, options, rank, step, 0)
                steps += 1
    except RuntimeError as caught:
        if not options["throw"]:
            raise
        error = [type(caught).__name__, str(caught)]
    if options["eval"]:
        # After the context, rank 0 evaluates alone (as a script that reports on rank 0
        # does), and then every rank meets at a barrier.
        if rank == 0:
            with torch.no_grad():
                _loss(ddp, options, rank, 0, 0)
        dist.barrier() if impl == "torch" else __import__("dptc").barrier()
    return {"params": _state(model), "error": error, "steps": steps,
            "reference": _reference(options, world) if options["reference"] else None}


def train(impl, scenarios):
    """Runs each scenario; returns {scenario: result}."""
    load_impl(impl)
    if impl == "dptc":
        import dptc
        wrapper = dptc.DistributedDataParallel
        dptc.init_process_group()
    else:
        wrapper = torch.nn.parallel.DistributedDataParallel
    rank, world = dist.get_rank(), dist.get_world_size()
    return {name: _run(impl, name, wrapper, rank, world) for name in scenarios}


def dies_inside(case):
    """dptc only: rank 0 joins after one step; rank 1 fails at its third ("raises") or dies
    there ("exits"); rank 2 trains on.  Returns nothing: the test reads the errors."""
    import os
    import dptc
    rank = dptc.get_rank()
    torch.manual_seed(0)
    ddp = dptc.DistributedDataParallel(Net())
    options = _options("default")
    start = None
    with ddp.join():
        for step in range(1 if rank == 0 else 6):
            if rank == 1 and step == 2:
                if case == "exits":
                    os._exit(3)
                raise ValueError("rank 1 fails inside join on purpose")
            _loss(ddp, options, rank, step, 0).backward()
        start_clock()
        start = step
    return start
