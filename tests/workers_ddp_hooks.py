"""Rank-side bodies of tests/test_ddp_comm_hooks.py: Python communication hooks on DDP.

Every rank trains the same small GPT (rank 0's initialisation, which DDP broadcasts) for a few
SGD steps on its own batches, under torch's DistributedDataParallel ("torch", gloo) or dptc's,
with one communication hook per scenario.  A scenario's result, per rank (JSON):
    params   {name: flat list of floats}, the trained parameters
    trace    what the hook saw, call by call: [step, index, is_last, parameter names,
             buffer numel, buffer dtype, float64 sum of the buffer] (scenarios with a probe)
    grads    {name: flat list}, the gradients after the last backward (before the step)
    group    [is torch's WORLD, size(), rank(), backend] of the wrapper's process_group
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.gpt import build_gpt
from tests._rank import load_impl, start_clock

STEPS = 5
ROWS = 4
CTX = 16
VOCAB = 64
LR = 0.1


def _wrapper(impl):
    if impl == "dptc":
        import dptc
        return dptc.DistributedDataParallel
    return torch.nn.parallel.DistributedDataParallel


def _model():
    torch.manual_seed(0)
    return build_gpt(vocab=VOCAB, d_model=32, n_layer=2, n_head=2, ctx=CTX)


def _batch(rank, step, micro):
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    tokens = torch.randint(0, VOCAB, (ROWS, CTX + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _names(model):
    return {id(p): name for name, p in model.named_parameters()}


def _probe(names, trace, inner, step_box):
    """A hook that records what it is given, then averages as torch's default hook does."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def probe(state, bucket):
        buffer = bucket.buffer()
        views = bucket.gradients()
        for view, param in zip(views, bucket.parameters()):
            if view.shape != param.shape:
                raise AssertionError(f"gradients() view {tuple(view.shape)} for a parameter "
                                     f"of shape {tuple(param.shape)}")
        trace.append([step_box[0], bucket.index(), bucket.is_last(),
                      [names[id(p)] for p in bucket.parameters()], buffer.numel(),
                      str(buffer.dtype), float(buffer.double().sum())])
        return inner(state, bucket)

    return probe


def _scenario(name, model, trace, step_box):
    """(DDP kwargs, state, hook, micro-steps per step) of a scenario."""
    from torch.distributed.algorithms.ddp_comm_hooks import (debugging_hooks, default_hooks,
                                                             powerSGD_hook)
    names = _names(model)
    average = default_hooks.allreduce_hook
    small = {"bucket_cap_mb": 0.02}   # several buckets
    if name == "probe":
        return small, None, _probe(names, trace, average, step_box), 1
    if name == "probe_unused":
        return dict(small, find_unused_parameters=True), None, \
            _probe(names, trace, average, step_box), 1
    if name == "probe_view_no_sync":
        return dict(small, gradient_as_bucket_view=True), None, \
            _probe(names, trace, average, step_box), 2
    if name == "probe_fp16_wrapper":
        return small, None, _probe(names, trace, default_hooks.fp16_compress_wrapper(average),
                                   step_box), 1
    if name == "noop":
        return small, None, debugging_hooks.noop_hook, 1
    if name in ("powersgd", "fp16_powersgd"):
        # One bucket: PowerSGD's callbacks issue collectives from gloo's threads, and with
        # several buckets in flight the ranks may issue them in different orders (under
        # torch as under dptc); one bucket keeps one chain.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2, min_compression_rate=0.5,
                                            random_seed=7)
        hook = powerSGD_hook.powerSGD_hook
        if name == "fp16_powersgd":
            hook = default_hooks.fp16_compress_wrapper(hook)
        return {}, state, hook, 1
    if name == "powersgd_ddp_group":
        # The wrapper's own group as the hook's state, as scripts pass it: a torch group
        # (its size() and rank() are methods, the hook's collectives take it).
        def state(ddp):
            return powerSGD_hook.PowerSGDState(process_group=ddp.process_group,
                                               matrix_approximation_rank=2,
                                               start_powerSGD_iter=2, min_compression_rate=0.5,
                                               random_seed=7)
        return {}, state, powerSGD_hook.powerSGD_hook, 1
    if name == "post_local_sgd":
        # torch's local SGD: gradients averaged globally for 2 steps, then within each
        # rank's subgroup (here the rank alone: they stay local).
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
        subgroup, _ = dist.new_subgroups(group_size=1)
        state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=subgroup,
                                                     start_localSGD_iter=2)
        return small, state, _probe(names, trace, post_localSGD_hook.post_localSGD_hook,
                                    step_box), 1
    raise ValueError(f"unknown scenario {name!r}")


def _flat(named):
    return {name: t.detach().flatten().tolist() for name, t in named}


def train(impl, scenarios):
    """Runs each scenario; returns {scenario: {params, trace, grads}}."""
    load_impl(impl)
    if not dist.is_initialized():  # dptc initialises torch.distributed (gloo) for the hooks
        import dptc
        dptc.init_process_group()
    rank = dist.get_rank()
    results = {}
    for name in scenarios:
        model = _model()
        trace, step_box = [], [0]
        kwargs, state, hook, micro_steps = _scenario(name, model, trace, step_box)
        ddp = _wrapper(impl)(model, **kwargs)
        if callable(state):   # a state made from the wrapper
            state = state(ddp)
        ddp.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        grads = None
        for step in range(STEPS):
            step_box[0] = step
            for micro in range(micro_steps):
                inputs, targets = _batch(rank, step, micro)
                last = micro == micro_steps - 1
                ddp.require_backward_grad_sync = last
                logits = ddp(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / micro_steps
                loss.backward()
            grads = _flat((n, p.grad) for n, p in model.named_parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        group = ddp.process_group
        results[name] = {"params": _flat(model.named_parameters()), "trace": trace,
                         "grads": grads,
                         "group": [group is dist.group.WORLD, group.size(), group.rank(),
                                   dist.get_backend(group)]}
    return results


# ---------------------------------------------------------------------------------------------
# Failures (dptc only)

def failing(case):
    """A hook that goes wrong, by `case`; returns nothing (the test reads the error)."""
    import dptc
    rank = dptc.get_rank()
    model = _model()
    ddp = dptc.DistributedDataParallel(model, bucket_cap_mb=0.02)

    def not_a_future(state, bucket):
        return bucket.buffer()

    def list_value(state, bucket):
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def raises_on_rank_1(state, bucket):
        if rank == 1:
            raise ValueError("rank 1's hook fails on purpose")
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
            lambda fut: fut.value()[0])

    def never_completes(state, bucket):
        return torch.futures.Future()

    hook = {"not_a_future": not_a_future, "list_value": list_value,
            "raises_on_rank_1": raises_on_rank_1, "never_completes": never_completes}[case]
    ddp.register_comm_hook(None, hook)
    inputs, targets = _batch(rank, 0, 0)
    start_clock()
    F.cross_entropy(ddp(inputs).flatten(0, 1), targets.flatten()).backward()
