"""DDP's errors: argument validation, unused parameters, interrupted backward passes.

Layers:
- no process group: the bucket policy and the bucket assignment (pure functions);
- one rank: every constructor argument that dptc refuses or checks, and register_comm_hook;
- two ranks: a parameter without a gradient (on every rank, or on one rank only) must raise a
  RuntimeError naming the parameter and find_unused_parameters=True on every rank, quickly
  (well under DPTC_TIMEOUT), not hang; a backward pass interrupted on one rank must make every
  rank raise too; processes of a launch that never initialised a process group
  (torch.multiprocessing.spawn's environment) must raise ValueError, as under torch.

The rank-side bodies are the functions at the bottom of this file (run by tests/_rank.py).
"""

import os
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._launch import run_ranks

# The harness sets DPTC_TIMEOUT=30; errors must arrive long before that.
FAST_S = 10.0
RUN_TIMEOUT_S = 120


# ---------------------------------------------------------------------------------------------
# Layer 1: no process group

def test_constructor_signature_is_torchs():
    """torch 2.13's parameters, names, kinds and defaults, in its order: a positional call
    (``DDP(m, None, None, 0, None, False)``, init_sync sixth) binds as under torch."""
    import inspect

    import dptc

    def parameters(cls):
        return [(p.name, p.kind, p.default)
                for p in inspect.signature(cls.__init__).parameters.values()]
    assert parameters(dptc.DistributedDataParallel) == \
        parameters(torch.nn.parallel.DistributedDataParallel)


def test_bucket_policy_validates_bucket_cap_mb():
    from dptc._buckets import BucketPolicy
    for bad in (-1, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bucket_cap_mb must be >= 0"):
            BucketPolicy.create(bad)
    for bad in ("25", True, [25]):
        with pytest.raises(TypeError, match="bucket_cap_mb"):
            BucketPolicy.create(bad)
    with pytest.raises(ValueError, match="bucket_cap_mb_list entry"):
        BucketPolicy.create(None, [1, -1])


def test_zero_bucket_cap_is_a_bucket_per_parameter_as_torchs():
    """bucket_cap_mb=0, which torch's DDP trains with: every parameter (a zero-size one too)
    closes its bucket, in torch's bucket assignment as in dptc's."""
    import torch.distributed as dist

    from dptc._buckets import BucketPolicy, assign_buckets
    tensors = [torch.zeros(10), torch.zeros(0), torch.zeros(20),
               torch.zeros(3, dtype=torch.float64)]
    order = [3, 2, 1, 0]
    policy = BucketPolicy.create(0)
    assert (policy.limit(0), policy.limit(1)) == (0, 0)
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [0], [False] * 4, order)
    mine = assign_buckets([t.numel() * t.element_size() for t in tensors],
                          [t.dtype for t in tensors], order, policy)
    assert mine == theirs == [[3], [2], [1], [0]]


def test_bucket_policy_first_bucket_is_small_only_by_default():
    from dptc._buckets import BucketPolicy
    default = BucketPolicy.create(None)
    assert (default.limit(0), default.limit(1), default.limit(5)) == (1 << 20, 25 << 20, 25 << 20)
    chosen = BucketPolicy.create(4)
    assert (chosen.limit(0), chosen.limit(1)) == (4 << 20, 4 << 20)
    per_bucket = BucketPolicy.create(None, [1, 2, 3])
    assert [per_bucket.limit(k) for k in range(5)] == [1 << 20, 2 << 20, 3 << 20, 3 << 20, 3 << 20]


def test_assign_buckets_orders_by_readiness_and_splits_dtypes():
    from dptc._buckets import BucketPolicy, assign_buckets
    policy = BucketPolicy(bucket_bytes=100, first_bucket_bytes=40)
    nbytes = [30, 30, 30, 60, 60, 8]
    dtypes = [torch.float32] * 5 + [torch.float64]
    order = [5, 4, 3, 2, 1, 0]
    buckets = assign_buckets(nbytes, dtypes, order, policy)
    # float32: [4] closes at 60 >= 40 (first), then [3, 2, 1] at 120 >= 100, then [0];
    # the lone float64 parameter is its own bucket, ready first.
    assert buckets == [[5], [4], [3, 2, 1], [0]]
    assert sorted(i for bucket in buckets for i in bucket) == list(range(6))
    assert all(len({dtypes[i] for i in bucket}) == 1 for bucket in buckets)


def test_first_buckets_are_torchs():
    """Before the first backward, torch's DDP fills buckets in definition order and launches
    them last-defined first; by default (no find_unused_parameters) one bucket per dtype."""
    from dptc._buckets import BucketPolicy, first_buckets
    policy = BucketPolicy(bucket_bytes=100, first_bucket_bytes=40)
    nbytes = [30, 30, 30, 60, 60, 8]
    dtypes = [torch.float32] * 5 + [torch.float64]
    # float32: [0, 1] closes at 60 >= 40 (first), then [2, 3, 4] at 150 >= 100; float64: [5].
    # Launched by their first member, highest first, members in definition order.
    assert first_buckets(nbytes, dtypes, policy) == [[5], [2, 3, 4], [0, 1]]
    assert first_buckets(nbytes, dtypes, policy.first_backward(True, False)) == \
        [[5], [2, 3, 4], [0, 1]]
    assert first_buckets(nbytes, dtypes, policy.first_backward(False, False)) == \
        [[5], [0, 1, 2, 3, 4]]
    assert first_buckets(nbytes, dtypes, policy.first_backward(True, True)) == \
        [[5], [0, 1, 2, 3, 4]]


# ---------------------------------------------------------------------------------------------
# Layer 2: one rank

def test_constructor_validation():
    results = run_ranks("tests.test_ddp_errors:validation_cases", 1, timeout=RUN_TIMEOUT_S)[0]
    expected = {
        "bucket_cap_mb_negative": ("ValueError", "bucket_cap_mb must be >= 0, got -5"),
        "bucket_cap_mb_string": ("TypeError", "bucket_cap_mb"),
        "device_ids_on_cpu": ("ValueError", "device_ids"),
        "output_device_on_cpu": ("ValueError", "output_device"),
        "mixed_precision": ("NotImplementedError", "torch.autocast"),
        "delay_all_reduce_alone": ("ValueError", "set at the same time"),
        "delay_all_reduce": ("NotImplementedError", "delay_all_reduce_named_params"),
        "device_mesh": ("TypeError", "device_mesh"),
        "process_group_and_device_mesh": ("RuntimeError", "process_group and device_mesh"),
        "bad_process_group": ("TypeError", "process_group"),
        "no_trainable_parameters": ("RuntimeError", "doesn't have any parameter"),
        "not_a_module": ("TypeError", "torch.nn.Module"),
        "unsupported_dtype": ("TypeError", "float8_e4m3fn"),
        "comm_hook_annotation": ("ValueError", "annotate it dist.GradBucket"),
        "comm_hook_return_annotation": ("ValueError", "torch.futures.Future[torch.Tensor]"),
        "builtin_comm_hook_type": ("ValueError", "BuiltinCommHookType"),
        "comm_hook_twice": ("RuntimeError", "only be called once"),
        "comm_hook_foreign_state": ("TypeError", "state"),
        "check_reduction_warns": ("FutureWarning", "check_reduction"),
        # torch 2.13's deprecation warnings, word for word.
        "broadcast_buffers_warns": ("FutureWarning", "`broadcast_buffers` is deprecated. Use "
                                                     "`forward_sync_buffers` instead."),
        "both_buffer_flags_warn": ("FutureWarning", "Both `broadcast_buffers` and "
                                                    "`forward_sync_buffers` were specified."),
        "sparse_comm_hook": ("NotImplementedError", "sparse=True"),
        "sparse_join": ("NotImplementedError", "sparse=True"),
        "converted_after_wrapping": ("RuntimeError", "before wrapping"),
        # torch's DDP refuses them on CPU with the same ValueError.
        "sync_batch_norm_on_cpu": ("ValueError", "SyncBatchNorm layers only work with GPU "
                                                 "modules: '1' is a SyncBatchNorm"),
    }
    problems = []
    for case, (error_type, fragment) in expected.items():
        got = results.get(case)
        if got is None:
            problems.append(f"{case}: not run")
        elif got["type"] != error_type or fragment not in got["message"]:
            problems.append(f"{case}: expected {error_type} mentioning {fragment!r}, got "
                            f"{got['type']}: {got['message']}")
    assert not problems, "\n".join(problems)
    # Accepted as torch accepts them.
    for case in ("static_graph", "skip_all_reduce_unused_params", "torch_default_group",
                 "torch_hooks_by_identity", "bucket_cap_mb_list", "init_sync_false",
                 "builtin_comm_hooks", "sparse_only", "sparse_allreduce_hook",
                 "bucket_cap_mb_zero", "forward_sync_buffers_quiet"):
        assert results[case] == {"type": None, "message": ""}, (case, results[case])


def test_dropped_wrapper_unregisters_its_hooks():
    """A DDP that is garbage must stop reducing: its hooks leave the parameters, and the module
    trains on its own (or under a new wrapper) without it."""
    counts = run_ranks("tests.test_ddp_errors:lifecycle_case", 1, timeout=RUN_TIMEOUT_S)[0]
    assert counts == {"wrapped": 1, "dropped": 0, "rewrapped": 1}, counts


# ---------------------------------------------------------------------------------------------
# Layer 3: two ranks

@pytest.mark.parametrize("impl", ["dptc", "torch"])
def test_unused_parameter_on_every_rank_raises(impl):
    """Same model code everywhere: torch raises at the next forward, dptc at the end of the
    backward; both a RuntimeError naming find_unused_parameters=True, on every rank."""
    results = run_ranks("tests.test_ddp_errors:unused_case", 2,
                        args={"impl": impl, "unused_on": [0, 1]}, timeout=RUN_TIMEOUT_S,
                        reference=impl == "torch")
    for rank, outcome in enumerate(results):
        assert outcome["raised"], f"rank {rank} did not raise: {outcome}"
        assert outcome["type"] == "RuntimeError", outcome
        assert "find_unused_parameters=True" in outcome["message"], outcome
        assert outcome["seconds"] < FAST_S, outcome
        if impl == "dptc":
            assert (outcome["step"], outcome["phase"]) == (0, "backward"), outcome
            assert "unused.weight" in outcome["message"], outcome


def test_unused_parameter_on_one_rank_raises_everywhere():
    """Rank 1 skips a layer that rank 0 uses: rank 0 launches a bucket that rank 1 never will.
    Rank 1 names the parameter; rank 0, blocked in that all-reduce, raises a DistError carrying
    rank 1's message — within seconds, not after DPTC_TIMEOUT."""
    results = run_ranks("tests.test_ddp_errors:unused_case", 2,
                        args={"impl": "dptc", "unused_on": [1]}, timeout=RUN_TIMEOUT_S)
    detector, waiter = results[1], results[0]
    assert detector["raised"] and detector["type"] == "RuntimeError", detector
    assert "unused.weight" in detector["message"], detector
    assert "find_unused_parameters=True" in detector["message"], detector
    assert waiter["raised"], waiter
    assert "DistError" in waiter["mro"] and "RuntimeError" in waiter["mro"], waiter
    assert "find_unused_parameters=True" in waiter["message"], waiter
    for outcome in results:
        assert outcome["step"] == 0 and outcome["seconds"] < FAST_S, outcome


@pytest.mark.parametrize("change", ["more", "fewer"])
def test_static_graph_change_raises_everywhere(change):
    """static_graph=True, and rank 1's graph changes after the first step: "more", a layer it
    left out of the first step runs in the second (a gradient beyond its count); "fewer", a
    layer it ran stops (a count the end of backward has not reached). Rank 1 raises a
    RuntimeError naming the layer and static_graph; rank 0, whose buckets wait for rank 1's,
    raises a DistError carrying that message, both in the second step's backward and within
    seconds."""
    results = run_ranks("tests.test_ddp_errors:static_change_case", 2,
                        args={"change": change}, timeout=RUN_TIMEOUT_S)
    waiter, detector = results
    assert detector["raised"] and detector["type"] == "RuntimeError", detector
    assert "maybe." in detector["message"], detector
    assert "static_graph" in detector["message"], detector
    assert waiter["raised"], waiter
    assert "DistError" in waiter["mro"], waiter
    assert "static_graph" in waiter["message"], waiter
    for outcome in results:
        assert (outcome["step"], outcome["phase"]) == (1, "backward"), outcome
        assert outcome["seconds"] < FAST_S, outcome


def test_dense_gradient_of_a_sparse_parameter_raises_everywhere():
    """An embedding with sparse=True whose weight is also used densely gets a dense gradient:
    every rank raises a RuntimeError naming the parameter at the end of the first backward
    (torch: "Expected variable to have sparse gradient"), none hangs."""
    results = run_ranks("tests.test_ddp_errors:sparse_dense_case", 2, timeout=RUN_TIMEOUT_S)
    for rank, outcome in enumerate(results):
        assert outcome["raised"] and outcome["type"] == "RuntimeError", (rank, outcome)
        assert "'emb.weight'" in outcome["message"], (rank, outcome)
        assert "dense gradient" in outcome["message"], (rank, outcome)
        assert (outcome["step"], outcome["phase"]) == (0, "backward"), (rank, outcome)
        assert outcome["seconds"] < FAST_S, (rank, outcome)


@pytest.mark.parametrize("impl", ["dptc", "torch"])
def test_spawned_processes_without_init_raise(impl):
    """Processes started as torch.multiprocessing.spawn starts them (MASTER_ADDR and
    MASTER_PORT set by the script, no RANK, WORLD_SIZE or torchrun's other variables) by a
    script that never initialised a process group: the wrapper raises ValueError, as torch's
    does ("Default process group has not been initialized"), where each process used to become
    a world of one rank that trains alone; dptc's message says what to call."""
    unset = {name: None for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                     "GROUP_RANK")}
    results = run_ranks("tests.test_ddp_errors:spawned_without_init_case", 2,
                        args={"impl": impl}, env=unset, timeout=RUN_TIMEOUT_S,
                        reference=impl == "torch")
    for rank, outcome in enumerate(results):
        assert outcome["type"] == "ValueError", (rank, outcome)
        if impl == "dptc":
            assert "dptc.init_process_group(backend, rank=..., world_size=...)" in \
                outcome["message"], (rank, outcome)


def test_interrupted_backward_raises_everywhere():
    """An exception on rank 1 in the middle of a synced backward (after some buckets were
    launched): rank 1 sees it, and its next forward refuses to go on; rank 0, waiting for
    buckets rank 1 will never launch, fails fast instead of timing out."""
    results = run_ranks("tests.test_ddp_errors:interrupted_case", 2, timeout=RUN_TIMEOUT_S)
    waiter, failing = results
    assert failing["first"]["message"] == "injected failure", failing
    assert failing["second"]["type"] == "RuntimeError", failing
    assert "interrupted" in failing["second"]["message"], failing
    assert "DistError" in waiter["first"]["mro"], waiter
    for outcome in results:
        assert outcome["seconds"] < FAST_S, outcome


# ---------------------------------------------------------------------------------------------
# Rank side

class _MaybeUnused(nn.Module):
    """fc -> out, plus a layer `unused` that runs only on the ranks not in `skip_on`."""

    def __init__(self, skip_on=()):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.unused = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.skip_on = tuple(skip_on)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if int(os.environ["RANK"]) not in self.skip_on:
            h = h + self.unused(h)
        return self.out(h)


def _ddp_class(impl):
    if impl == "dptc":
        import dptc
        return dptc.DistributedDataParallel
    return torch.nn.parallel.DistributedDataParallel


def _init(impl):
    from tests._rank import load_impl
    if impl == "torch":
        load_impl("torch")
    else:
        import dptc
        dptc.init_process_group()


def _finish():
    import dptc
    if dptc.is_initialized():
        dptc.destroy_process_group()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _describe(error):
    return {"type": type(error).__name__, "message": str(error),
            "mro": [cls.__name__ for cls in type(error).__mro__]}


def validation_cases():
    """Runs each refused/checked constructor argument; returns {case: {type, message}}."""
    import warnings

    import dptc
    import dptc.comm_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dptc.init_process_group()
    DDP = dptc.DistributedDataParallel

    def model():
        return nn.Linear(4, 4)

    def annotated_hook(state, bucket: int):
        return bucket.buffer()

    def return_annotated_hook(state, bucket) -> torch.Tensor:
        return bucket.buffer()

    def builtin_hooks():
        for kind in (torch.distributed.BuiltinCommHookType.ALLREDUCE,
                     torch.distributed.BuiltinCommHookType.FP16_COMPRESS):
            DDP(model())._register_builtin_comm_hook(kind)

    def hook_twice():
        ddp = DDP(model())
        ddp.register_comm_hook(None, dptc.comm_hooks.allreduce_hook)
        ddp.register_comm_hook(None, dptc.comm_hooks.fp16_compress_hook)

    def check_reduction():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            DDP(model(), check_reduction=True)

    def warns_with(**kwargs):
        def case():
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                DDP(model(), **kwargs)
        return case

    def torch_hooks():
        for hook in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook,
                     default_hooks.bf16_compress_hook):
            DDP(model()).register_comm_hook(None, hook)

    def converted_after_wrapping():
        ddp = DDP(model()).double()
        ddp(torch.randn(2, 4, dtype=torch.float64)).sum().backward()

    def sparse_join():
        with DDP(nn.Embedding(10, 4, sparse=True)).join():
            pass

    frozen = model().requires_grad_(False)
    cases = {
        "bucket_cap_mb_zero": lambda: DDP(model(), bucket_cap_mb=0),
        "sync_batch_norm_on_cpu": lambda: DDP(nn.Sequential(model(), nn.SyncBatchNorm(4))),
        "bucket_cap_mb_negative": lambda: DDP(model(), bucket_cap_mb=-5),
        "bucket_cap_mb_string": lambda: DDP(model(), bucket_cap_mb="25"),
        "device_ids_on_cpu": lambda: DDP(model(), device_ids=[0]),
        "output_device_on_cpu": lambda: DDP(model(), output_device=0),
        "mixed_precision": lambda: DDP(model(), mixed_precision=object()),
        "delay_all_reduce_alone": lambda: DDP(model(), delay_all_reduce_named_params=[]),
        "delay_all_reduce": lambda: DDP(model(), delay_all_reduce_named_params=[],
                                        param_to_hook_all_reduce=object()),
        "device_mesh": lambda: DDP(model(), device_mesh=object()),
        "process_group_and_device_mesh": lambda: DDP(model(), process_group=object(),
                                                     device_mesh=object()),
        "bad_process_group": lambda: DDP(model(), process_group="world"),
        "no_trainable_parameters": lambda: DDP(frozen),
        "not_a_module": lambda: DDP(lambda x: x),
        "unsupported_dtype": lambda: DDP(nn.Linear(2, 2).to(torch.float8_e4m3fn)),
        "comm_hook_annotation": lambda: DDP(model()).register_comm_hook(None, annotated_hook),
        "comm_hook_return_annotation": lambda: DDP(model()).register_comm_hook(
            None, return_annotated_hook),
        "builtin_comm_hook_type": lambda: DDP(model())._register_builtin_comm_hook("fp16"),
        "builtin_comm_hooks": builtin_hooks,
        "comm_hook_twice": hook_twice,
        "comm_hook_foreign_state": lambda: DDP(model()).register_comm_hook(
            "not a group", dptc.comm_hooks.allreduce_hook),
        "check_reduction_warns": check_reduction,
        "broadcast_buffers_warns": warns_with(broadcast_buffers=True),
        "both_buffer_flags_warn": warns_with(broadcast_buffers=True, forward_sync_buffers=False),
        "forward_sync_buffers_quiet": warns_with(forward_sync_buffers=False),
        "sparse_only": lambda: DDP(nn.Embedding(10, 4, sparse=True)),
        "sparse_allreduce_hook": lambda: DDP(nn.Embedding(10, 4, sparse=True)).register_comm_hook(
            None, dptc.comm_hooks.allreduce_hook),
        "sparse_comm_hook": lambda: DDP(nn.Embedding(10, 4, sparse=True)).register_comm_hook(
            None, dptc.comm_hooks.fp16_compress_hook),
        "sparse_join": sparse_join,
        "static_graph": lambda: DDP(model(), static_graph=True),
        "skip_all_reduce_unused_params": lambda: DDP(model(), find_unused_parameters=True,
                                                     skip_all_reduce_unused_params=True),
        "torch_default_group": lambda: DDP(model(),
                                           process_group=torch.distributed.group.WORLD),
        "torch_hooks_by_identity": torch_hooks,
        "bucket_cap_mb_list": lambda: DDP(model(), bucket_cap_mb_list=[1, 4]),
        "init_sync_false": lambda: DDP(model(), init_sync=False),
        # Last: a failure inside backward aborts the group (so peers raise instead of
        # hanging), and every later collective, a new wrapper's included, fails.
        "converted_after_wrapping": converted_after_wrapping,
    }
    results = {}
    for name, case in cases.items():
        try:
            case()
            results[name] = {"type": None, "message": ""}
        except Exception as error:  # noqa: BLE001 - the error is the result
            results[name] = {"type": type(error).__name__, "message": str(error)}
    _finish()
    return results


def spawned_without_init_case(impl):
    """Wraps a module without initialising a process group; returns what was raised, or the
    wrapper's world size."""
    try:
        ddp = _ddp_class(impl)(nn.Linear(2, 2))
    except Exception as error:  # noqa: BLE001 - the error is the result
        return _describe(error)
    return {"type": None, "world_size": torch.distributed.get_world_size(),
            "rank": torch.distributed.get_rank(), "module": type(ddp.module).__name__}


def lifecycle_case():
    """Hooks per parameter while wrapped, after the wrapper is dropped, and after rewrapping."""
    import gc

    import dptc
    dptc.init_process_group()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def hooks():
        return max(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())

    ddp = dptc.DistributedDataParallel(model)
    ddp(torch.randn(3, 4)).sum().backward()
    counts = {"wrapped": hooks()}
    del ddp
    gc.collect()
    counts["dropped"] = hooks()
    model(torch.randn(3, 4)).sum().backward()
    ddp = dptc.DistributedDataParallel(model)
    ddp(torch.randn(3, 4)).sum().backward()
    counts["rewrapped"] = hooks()
    _finish()
    return counts


def unused_case(impl, unused_on, steps=3):
    """Trains _MaybeUnused (skipping `unused` on the ranks in unused_on) without
    find_unused_parameters; returns the first error: step, phase, type, message, seconds."""
    _init(impl)
    torch.manual_seed(0)
    ddp = _ddp_class(impl)(_MaybeUnused(skip_on=unused_on))
    return _train_until_error(ddp, steps)


def _train_until_error(ddp, steps, before_step=lambda step: None):
    """SGD steps on random batches until one raises; returns where and what (step, phase,
    seconds since the clock started, type, message, mro), or {"raised": False}."""
    from tests._rank import start_clock
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    outcome = {"raised": False}
    start_clock()
    began = time.perf_counter()
    for step in range(steps):
        before_step(step)
        phase = "forward"
        try:
            output = ddp(torch.randn(4, 8))
            phase = "backward"
            output.square().mean().backward()
            phase = "step"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        except Exception as error:  # noqa: BLE001 - the error is the result
            outcome = {"raised": True, "step": step, "phase": phase,
                       "seconds": time.perf_counter() - began, **_describe(error)}
            break
    _finish()
    return outcome


class _Changing(nn.Module):
    """fc -> out, plus a layer `maybe` that rank 0 always runs and rank 1 runs in the steps
    `uses(step)` allows."""

    def __init__(self, uses):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.maybe = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.uses = uses
        self.step = 0

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if int(os.environ["RANK"]) == 0 or self.uses(self.step):
            h = h + self.maybe(h)
        return self.out(h)


def static_change_case(change, steps=3):
    """Trains _Changing under static_graph=True; returns the first error as unused_case does."""
    _init("dptc")
    torch.manual_seed(0)
    model = _Changing((lambda step: step >= 1) if change == "more" else (lambda step: step == 0))
    ddp = _ddp_class("dptc")(model, static_graph=True)
    return _train_until_error(ddp, steps, before_step=lambda step: setattr(model, "step", step))


class _TiedSparse(nn.Module):
    """An embedding with sparse=True whose weight also scales the output (a dense use)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.emb = nn.Embedding(10, 4, sparse=True)

    def forward(self, x):
        tokens = torch.arange(x.shape[0]) % 10
        return (self.fc(x) + self.emb(tokens)) * self.emb.weight.mean()


def sparse_dense_case(steps=2):
    _init("dptc")
    torch.manual_seed(0)
    return _train_until_error(_ddp_class("dptc")(_TiedSparse()), steps)


def interrupted_case():
    """Rank 1's backward raises after its last layer's gradient bucket was launched."""
    import dptc
    dptc.init_process_group()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    # One bucket per parameter: the last layer's buckets launch before the failure.
    ddp = dptc.DistributedDataParallel(model, bucket_cap_mb=1e-6)
    began = time.perf_counter()
    result = {}

    def fail(grad):
        raise ValueError("injected failure")

    for attempt in ("first", "second"):
        try:
            output = ddp(torch.randn(4, 8))
            if rank == 1 and attempt == "first":
                # A hook on the first layer's weight gradient runs after the later layers'.
                ddp.module[0].weight.register_hook(fail)
            output.square().mean().backward()
            result[attempt] = {"type": None, "message": "", "mro": []}
        except Exception as error:  # noqa: BLE001 - the error is the result
            result[attempt] = _describe(error)
    result["seconds"] = time.perf_counter() - began
    _finish()
    return result
