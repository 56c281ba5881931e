"""DistributedDataParallel equivalence, one test body for torch's DDP (gloo) and dptc's.

Each rank trains a small model for four AdamW steps on its slice of a global batch and, beside
it, a plain single-process copy on the whole batch (tests/workers_ddp.py). Checks, per scenario:
- parameters and gradients within a relative tolerance of the single-process reference
  (max over tensors of max|a - b| / max|b|), on every rank;
- every rank holds the same parameters (within 1e-6; in practice bit-identical);
- the parameters whose .grad is None, step by step, are those of the reference;
- the wrapper's surface (.module, "module."-prefixed state_dict keys) is torch's;
- dptc's numbers agree with torch DDP's for the same scenario and rank.

Several scenarios share one launch per (implementation, world size, group), since a launch
costs ~2 s of interpreter and torch start-up per rank; a scenario that fails is reported under
its own test id. dptc is launched both after the script initialised torch.distributed (gloo)
itself (group "a") and without it (groups "b" and "ws3": dptc initialises on first use).

Tolerances (measured, torch DDP on 2-3 ranks):
- float32 training, 1e-5: parameters within 4.2e-7 and gradients within 8.1e-7 of the reference
  (the all-reduce adds the ranks' gradients in another order than one process summing the whole
  batch; Adam turns that noise into a fraction of lr, hence lr=1e-3, see workers_ddp.LR).
- bf16 autocast (with or without GradScaler), 5e-2 against the reference: each rank's gradients
  come out of bf16 matmuls, rounded to 8 mantissa bits per rank instead of once for the whole
  batch (measured 1.1e-2 on parameters, 8.9e-3 on gradients at 3 ranks).
- fp16_compress_hook, 1e-2 against the reference: gradients are rounded to fp16 (11 bits) and
  summed in fp16 (measured 7.4e-4 on gradients, 4.2e-5 on parameters).
- bf16_compress_hook, 5e-2 against the reference (8 bits; measured 6.7e-3 / 1.1e-2).
- dptc against torch DDP, 1e-2 for autocast and compressed hooks: at 2 ranks both should give
  the same bits, but an implementation may round the low-precision sum at another point (f32
  accumulation, one rounding) than gloo does; one bf16 ulp is 4e-3 of a gradient element, and a
  wrong reduction (sum instead of mean, a bucket left unreduced) is off by O(1). 1e-5 for
  float32 scenarios.
torch refuses its own bf16_compress_hook on CPU (TypeError: it requires CUDA and NCCL); on the
torch side the bf16 scenarios use workers_ddp.cpu_bf16_compress_hook, the same steps under
another name. dptc must accept torch's hook itself (and provide dptc.comm_hooks).
"""

import dataclasses

import pytest
import torch

from tests._launch import once, run_ranks
from tests._compare import max_rel

IMPLS = ("torch", "dptc")
RANK_AGREEMENT = 1e-6
LAUNCH_TIMEOUT_S = 150


@dataclasses.dataclass(frozen=True)
class Tolerance:
    params: float = 1e-5   # against the single-process reference
    grads: float = 1e-5    # against the single-process reference
    peer: float = 1e-5     # dptc against torch DDP, same scenario and rank


FLOAT32 = Tolerance()
BF16 = Tolerance(params=5e-2, grads=5e-2, peer=1e-2)
FP16_HOOK = Tolerance(params=1e-2, grads=1e-2, peer=1e-2)

TOLERANCES = {
    "autocast_bf16": BF16,
    "amp_scaler": BF16,
    "hook_fp16": FP16_HOOK,
    "hook_fp16_own": FP16_HOOK,
    "hook_bf16": BF16,
    "hook_bf16_own": BF16,
}

ALL_SCENARIOS = [
    "default", "tiny_buckets", "bucket_view", "no_sync", "sync_attribute", "unused_global",
    "rank_branch", "rank_extra_head", "tied_gpt", "frozen", "channels_last", "odd_sizes",
    "zero_cap", "rank_init", "buffers", "static_unused", "set_static_unused",
    "static_rank_branch", "static_no_sync", "static_bucket_view", "static_reentrant_twice",
    "reentrant_head", "reentrant_head_unused", "penalty", "static_penalty", "autocast_bf16",
    "amp_scaler", "hook_allreduce", "hook_fp16", "hook_bf16", "hook_allreduce_own",
    "hook_fp16_own", "hook_bf16_own", "sparse", "sparse_no_sync", "sparse_only",
    "sparse_rank_unused",
]


# Scenarios torch 2.13's DDP fails: what it raises, or None where it trains to other numbers.
# static_no_sync: static_graph=True with a first step that begins with no_sync micro-batches
# (its first-iteration callback runs in a backward that does not sync). static_penalty:
# static_graph=True and a torch.autograd.grad through the outputs before backward (its
# first-iteration all-reduce runs at the end of that grad call, before the parameters have
# gradients). reentrant_head_unused: find_unused_parameters=True under reentrant activation
# checkpointing (its search of the graph at forward cannot see into the checkpoints).
# sparse_rank_unused: a parameter with sparse gradients that one rank leaves out (the rank
# raises; its peers wait in the all-reduce until it exits, so the scenario runs last).
BEYOND_TORCH = {"static_no_sync": "expect_autograd_hooks_ INTERNAL ASSERT FAILED",
                "static_penalty": None,
                "reentrant_head_unused": "Expected to mark a variable ready only once",
                "sparse_rank_unused": "Expected sparse gradient to be defined"}


@dataclasses.dataclass(frozen=True)
class Group:
    world_size: int
    init_torch: bool   # dptc only: the script calls torch.distributed.init_process_group first
    scenarios: tuple


GROUPS = {
    "a": Group(2, True, ("default", "tiny_buckets", "bucket_view", "no_sync", "sync_attribute",
                         "unused_global", "rank_branch", "rank_extra_head", "tied_gpt",
                         "static_unused", "set_static_unused", "static_rank_branch",
                         "static_no_sync", "static_bucket_view", "static_reentrant_twice",
                         "reentrant_head", "reentrant_head_unused", "penalty",
                         "static_penalty")),
    "b": Group(2, False, ("frozen", "channels_last", "odd_sizes", "zero_cap", "rank_init",
                          "buffers", "autocast_bf16", "amp_scaler", "hook_allreduce",
                          "hook_fp16", "hook_bf16",
                          "hook_allreduce_own", "hook_fp16_own", "hook_bf16_own")),
    # Last in torch's launch of 2 ranks: see BEYOND_TORCH.
    "sparse": Group(2, True, ("sparse", "sparse_no_sync", "sparse_only",
                              "sparse_rank_unused")),
    "ws3": Group(3, False, tuple(ALL_SCENARIOS)),
}

CASES = [pytest.param(group, name, id=f"ws{GROUPS[group].world_size}-{name}")
         for group in GROUPS for name in GROUPS[group].scenarios]


# ---------------------------------------------------------------------------------------------
# Launches, one per (impl, group), shared by the tests

_launches = {}


def _launch_plan(impl, group):
    """(cache key, world size, scenarios, init_torch) of the launch that runs `group`.

    torch's DDP always needs torch.distributed initialised first, so for torch the groups of
    one world size differ in nothing and share a launch (one ~10 s start-up less)."""
    spec = GROUPS[group]
    if impl == "torch":
        members = [g for g in GROUPS if GROUPS[g].world_size == spec.world_size]
        scenarios = [name for g in members for name in GROUPS[g].scenarios]
        return (impl, f"ws{spec.world_size}"), spec.world_size, scenarios, True
    return (impl, group), spec.world_size, list(spec.scenarios), spec.init_torch


def _group_results(impl, group):
    """Per-rank {scenario: result} for one launch, run on first use and cached for the module."""
    key, world_size, scenarios, init_torch = _launch_plan(impl, group)
    return once(_launches, key,
                lambda: run_ranks(
                    "tests.workers_ddp:train_cases", world_size,
                    args={"impl": impl, "scenarios": scenarios, "init_torch": init_torch},
                    timeout=LAUNCH_TIMEOUT_S, reference=impl == "torch"),
                f"the {impl} launch for group {group!r}")


def _scenario_results(impl, group, name):
    if impl == "torch" and name in BEYOND_TORCH:
        pytest.skip(f"torch's DDP fails {name} (test_beyond_torch)")
    per_rank = [ranks[name] for ranks in _group_results(impl, group)]
    for rank, result in enumerate(per_rank):
        assert result["ok"], f"{impl} {name} raised on rank {rank}:\n{result['error']}"
    return per_rank


def _params(result):
    return {name: torch.tensor(values, dtype=torch.float64)
            for name, values in result["params"].items()}


def _fmt(values):
    return "[" + ", ".join(f"{value:.2e}" for value in values) + "]"


# ---------------------------------------------------------------------------------------------
# Tests

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("group, name", CASES)
def test_matches_single_process(impl, group, name):
    per_rank = _scenario_results(impl, group, name)
    tolerance = TOLERANCES.get(name, FLOAT32)
    ref_rel = [result["ref_rel"] for result in per_rank]
    grad_rel = [result["grad_rel"] for result in per_rank]
    rank0 = _params(per_rank[0])
    spread = [max_rel(_params(result), rank0) for result in per_rank[1:]]
    print(f"{impl} ws={len(per_rank)} {name}: params vs reference {_fmt(ref_rel)}, "
          f"grads vs reference {_fmt(grad_rel)}, ranks vs rank 0 {_fmt(spread)}, "
          f"{per_rank[0]['seconds']:.2f} s")

    for rank, result in enumerate(per_rank):
        assert result["ref_rel"] <= tolerance.params, (
            f"rank {rank}: parameters differ from single-process training by "
            f"{result['ref_rel']:.3e} (tolerance {tolerance.params:.0e})")
        assert result["grad_rel"] <= tolerance.grads, (
            f"rank {rank}: gradients differ from single-process training by "
            f"{result['grad_rel']:.3e} (tolerance {tolerance.grads:.0e})")
        assert result["grad_none"] == result["ref_grad_none"], (
            f"rank {rank}: parameters with .grad None per step {result['grad_none']}, "
            f"single-process training has {result['ref_grad_none']}")
    assert max(spread, default=0.0) <= RANK_AGREEMENT, (
        f"ranks disagree with rank 0 by {_fmt(spread)}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["unused_global", "static_unused", "set_static_unused",
                                  "static_no_sync", "static_reentrant_twice"])
def test_unused_parameter_keeps_grad_none(impl, name):
    """find_unused_parameters=True, or static_graph=True, and a layer no rank uses: its .grad
    stays None (torch does not write the reduced zeros into it), so AdamW skips it, weight
    decay included."""
    for rank, result in enumerate(_scenario_results(impl, "a", name)):
        for step, names in enumerate(result["grad_none"]):
            assert names == ["unused.bias", "unused.weight"], (
                f"rank {rank}, step {step}: .grad None for {names}, expected only the unused "
                f"layer's")


@pytest.mark.parametrize("impl", IMPLS)
def test_buffers_follow_rank0(impl):
    """broadcast_buffers=True: each forward starts by broadcasting rank 0's buffers, so after
    training rank 0's running statistics are the reference's (other ranks still hold their own
    last update), and after one more forward every rank holds rank 0's."""
    per_rank = _scenario_results(impl, "b", "buffers")
    print(f"{impl} buffers vs reference before the eval forward "
          f"{_fmt(r['buffer_ref_rel'] for r in per_rank)}, after "
          f"{_fmt(r['eval_buffer_ref_rel'] for r in per_rank)}")
    assert per_rank[0]["buffer_ref_rel"] <= FLOAT32.params
    for rank, result in enumerate(per_rank):
        assert result["eval_buffer_ref_rel"] <= FLOAT32.params, (
            f"rank {rank}: buffers after the eval forward differ from rank 0's reference by "
            f"{result['eval_buffer_ref_rel']:.3e}")
        assert result["buffers"] == per_rank[0]["buffers"], (
            f"rank {rank}: buffers differ from rank 0's after the eval forward")


# Per case of workers_ddp.BUFFER_SYNC_CASES, which broadcasts from rank 0 happen under torch
# 2.13's reading of the arguments: (parameters at construction, buffers at construction,
# buffers at forward).  init_sync decides the construction's broadcast and forward_sync_buffers
# the forward's; the deprecated broadcast_buffers, given alone, decides both for the buffers,
# and is ignored next to forward_sync_buffers.
BUFFER_SYNCS = {
    "default": (True, True, True),
    "forward_sync_off": (True, True, False),
    "forward_sync_on": (True, True, True),
    "broadcast_off": (True, False, False),
    "broadcast_on": (True, True, True),
    "broadcast_off_forward_sync_on": (True, True, True),
    "broadcast_on_forward_sync_off": (True, True, False),
    "no_init_sync": (False, False, True),
    "positional_no_init_sync": (False, False, True),
    "positional_broadcast_off": (True, False, False),
    "attribute_off": (True, True, False),
}


@pytest.mark.parametrize("impl", IMPLS)
def test_buffer_broadcasts_follow_torchs_arguments(impl):
    """Each rank starts with its own weight and buffer (1 + rank), then, after construction,
    its own buffer again (10 + rank) before an eval forward: a value of 1 (10) on every rank
    means rank 0's was broadcast.  Both implementations match BUFFER_SYNCS, and so each
    other."""
    per_rank = run_ranks("tests.workers_ddp:buffer_sync_cases", 2, args={"impl": impl},
                         timeout=LAUNCH_TIMEOUT_S, reference=impl == "torch")
    problems = []
    for name, (params, buffers, forward) in BUFFER_SYNCS.items():
        for rank, results in enumerate(per_rank):
            got = results[name]
            expected = {"weight": 1.0 + (0 if params else rank),
                        "buffer": 1.0 + (0 if buffers else rank),
                        "forward_buffer": 10.0 + (0 if forward else rank),
                        "forward_sync_buffers": forward, "broadcast_buffers": forward}
            if got != expected:
                problems.append(f"{name}, rank {rank}: {got}, expected {expected}")
    assert not problems, "\n".join(problems)


def test_buffers_changed_after_wrapping_as_torchs():
    """As torch's DDP: the buffers found at construction decide whether forward syncs any; a
    module that had some has them found again before each sync (a replaced running_var, a
    buffer registered since), and one that had none is not walked at each forward, so a
    buffer registered on it later stays per rank."""
    mine = run_ranks("tests.workers_ddp:buffers_after_wrapping", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_ddp:buffers_after_wrapping", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        expected = {"counts": [3, 0], "replaced": 10.0, "added": 10.0,
                    "added_unbuffered": 10.0 + rank, "counts_after": [4, 0]}
        assert result == expected, (rank, result)
        assert reference == expected, (rank, "torch", reference)


def test_deepcopy_and_pickle_as_torchs():
    """copy.deepcopy(ddp) (an EMA copy) and torch.save/torch.load of a wrapper give wrappers
    that train over the default group on their own, 2 ranks: after the same 3 steps every
    copy holds the original's parameters, and torch's DDP's to the bit.  Over another group
    it raises, as torch's does."""
    mine = run_ranks("tests.workers_ddp:copied_wrappers", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_ddp:copied_wrappers", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert result["types"] == ["DistributedDataParallel"] * 2, result["types"]
        for name in ("original", "copied", "loaded"):
            assert result[name] == reference[name], (rank, name)
            assert result[name] == result["original"], (rank, name)
        assert "default process group" in result["subgroup_error"], result["subgroup_error"]


def test_complex_parameters_as_torchs():
    """complex64 and complex128 parameters next to float32 ones train as under torch's DDP,
    bit for bit at 2 ranks, with and without gradient_as_bucket_view."""
    mine = run_ranks("tests.workers_ddp:complex_params", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_ddp:complex_params", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        for name in ("view=False", "view=True"):
            assert result[name] == reference[name], (rank, name)
    assert mine[0] == mine[1]


def test_logging_data_as_torchs():
    """DDP._get_ddp_logging_data() describes the wrapper with torch's keys and values (the
    backend is dptc's), and _set_ddp_runtime_logging_sample_rate validates as torch's."""
    mine = run_ranks("tests.workers_ddp:logging_data", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_ddp:logging_data", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    keys = ("module_name", "world_size", "rank", "device_ids", "output_device",
            "broadcast_buffers", "bucket_cap_bytes", "find_unused_parameters",
            "gradient_as_bucket_view", "is_multi_device_module", "has_sync_bn",
            "num_parameter_tensors", "total_parameter_size_bytes", "dtypes", "bucket_sizes")
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert result["data"]["backend_name"] == "dptc", result["data"]
        for key in keys:
            assert result["data"][key] == reference["data"][key], (rank, key, result["data"])
        assert result["data"]["rank"] == rank
        assert result["error"] == reference["error"] is not None, result["error"]


@pytest.mark.parametrize("impl", IMPLS)
def test_wrapper_surface(impl):
    """.module is the wrapped module; state_dict keys are the module's with a "module." prefix,
    in torch DDP's order (buffers and tied weights included)."""
    for group in GROUPS:
        for name in GROUPS[group].scenarios:
            if impl == "torch" and name in BEYOND_TORCH:
                continue
            for rank, result in enumerate(_scenario_results(impl, group, name)):
                assert result["module_is_inner"], f"{name} rank {rank}: .module is not the model"
                expected = ["module." + key for key in result["inner_state_dict_keys"]]
                assert result["state_dict_keys"] == expected, (
                    f"{name} rank {rank}: state_dict keys {result['state_dict_keys']}, "
                    f"expected {expected}")
            if impl != "torch" and name not in BEYOND_TORCH:
                peer = _scenario_results("torch", group, name)[0]["state_dict_keys"]
                assert _scenario_results(impl, group, name)[0]["state_dict_keys"] == peer


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("group, name", [case for case in CASES if case.values[0] != "ws3"])
def test_agrees_with_peer(impl, group, name):
    """dptc against torch DDP on the same scenario, rank by rank (2 ranks)."""
    if impl == "torch":
        pytest.skip("torch DDP is the peer the other implementations are compared with")
    if name in BEYOND_TORCH:
        pytest.skip(f"torch's DDP fails {name} (test_beyond_torch)")
    mine = _scenario_results(impl, group, name)
    peer = _scenario_results("torch", group, name)
    tolerance = TOLERANCES.get(name, FLOAT32).peer
    diffs = [max_rel(_params(a), _params(b)) for a, b in zip(mine, peer)]
    print(f"{impl} vs torch {name}: parameters differ by {_fmt(diffs)} per rank")
    assert max(diffs) <= tolerance, (
        f"{impl} and torch DDP differ by {_fmt(diffs)} (tolerance {tolerance:.0e})")


@pytest.mark.parametrize("name", ["sparse", "sparse_no_sync", "sparse_only"])
def test_sparse_gradients_match_torch_bit_for_bit(name):
    """Embeddings with sparse=True: torch's DDP averages their sparse gradients over gloo;
    dptc does the same arithmetic over its engine (see dptc/_sparse.py), so the parameters
    after SparseAdam and AdamW steps are torch's to the bit, rank by rank."""
    mine = _scenario_results("dptc", "sparse", name)
    peer = _scenario_results("torch", "sparse", name)
    for rank, (a, b) in enumerate(zip(mine, peer)):
        differing = [key for key in b["params"] if a["params"][key] != b["params"][key]]
        assert not differing, f"rank {rank}: {differing} differ from torch's DDP"


@pytest.mark.parametrize("name", sorted(BEYOND_TORCH))
def test_beyond_torch(name):
    """Where torch's DDP raises or trains to other numbers (BEYOND_TORCH), dptc's trains to
    the single-process reference (test_matches_single_process checks it more closely)."""
    for group in GROUPS:
        if name in GROUPS[group].scenarios and GROUPS[group].world_size == 2:
            theirs = [ranks[name] for ranks in _group_results("torch", group)]
            if BEYOND_TORCH[name] is None:
                worst = max(r["ref_rel"] for r in theirs if r["ok"])
                print(f"torch {name}: parameters {worst:.2e} off the reference")
                assert worst > 100 * FLOAT32.params, theirs
            else:
                assert any(not r["ok"] and BEYOND_TORCH[name] in r["error"] for r in theirs), \
                    theirs
            for rank, result in enumerate(_scenario_results("dptc", group, name)):
                assert result["ref_rel"] <= FLOAT32.params, (rank, result["ref_rel"])


@pytest.mark.parametrize("impl", IMPLS)
def test_missing_gradient_raises(impl):
    """Without find_unused_parameters, a parameter that gets no gradient is an error naming
    find_unused_parameters, on every rank, soon (torch: at the next forward; dptc may already
    raise at the end of the backward), never a hang."""
    outcomes = run_ranks("tests.workers_ddp:missing_grad_case", 2,
                         args={"impl": impl, "init_torch": False}, timeout=60,
                         reference=impl == "torch")
    for rank, outcome in enumerate(outcomes):
        print(f"{impl} rank {rank}: {outcome}")
        assert outcome["raised"], f"rank {rank}: trained 3 steps without an error"
        assert "RuntimeError" in outcome["mro"], (
            f"rank {rank}: raised {outcome['type']}, expected a RuntimeError")
        assert "find_unused_parameters" in outcome["message"], (
            f"rank {rank}: the message does not mention find_unused_parameters: "
            f"{outcome['message']!r}")
        assert (outcome["step"], outcome["phase"]) in ((0, "backward"), (1, "forward")), (
            f"rank {rank}: raised in the {outcome['phase']} of step {outcome['step']}; expected "
            f"the backward of step 0 or the forward of step 1")
        # DPTC_TIMEOUT is 30 s: an error that took that long came from a timeout, not from
        # noticing the missing gradient.
        assert outcome["seconds"] < 20, f"rank {rank}: took {outcome['seconds']:.1f} s"
