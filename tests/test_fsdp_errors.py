"""fully_shard's errors: refused arguments and modules, odd parameters, ranks that fail.

Layers (rank-side bodies in tests/workers_fsdp_errors.py; a launch costs ~5 s here, so each
layer is one launch whose results the tests share):
- two ranks, refusals: every call dptc.fully_shard refuses raises the error type below with a
  message naming the argument or value and the remedy, and leaves the module as it was.  The
  same calls run against torch 2.13's fully_shard in the same processes; what torch does is
  pinned beside dptc's (REFUSALS), so a difference is a decision, not an accident:
    parameters left on the meta device at the first forward   torch: RuntimeError as well
    applied twice        torch: AssertionError "can only be applied to a module once"
    child after parent   torch: TypeError "Invariant encountered: value was None" (an internal
                         assertion; at 1 rank the parent still trained after it)
    0-dim parameter      torch: ValueError "doesn't support scalar parameters"; both accept it
                         in ignored_params
    reshard_after_forward=0 / 5 / "yes" at 2 ranks   torch: ValueError as well
    shard_placement_fn returning no Shard, or a dim the parameter lacks   torch: ValueError,
                         AssertionError; Shard(1) of 3 columns at 2 ranks (uneven) torch
                         refuses (NotImplementedError), dptc shards as torch.chunk does
    mesh="cpu"           torch: AttributeError "'str' object has no attribute 'ndim'"
    set_custom_all_gather  torch: supported; dptc: NotImplementedError naming the method
    prefetch of a module fully_shard was not applied to   torch: ValueError as well
    non-contiguous parameter   torch: NotImplementedError; dptc accepts it and trains it to
                         the single-process numbers (float64, 2 ranks)
    a parameter tied to one an earlier unit shards (blocks.3 reusing blocks.0's weight, each
                         block a unit)   torch: ValueError "is shared with a parameter
                         already managed by another FSDP group"; dptc sharded the second
                         location apart before, silently untying the two
    a DTensor parameter on a 2-D mesh, with the default mesh   torch: TypeError "Invariant
                         encountered"; dptc: NotImplementedError naming what it takes (1-D
                         tensor-parallel DTensors, tests/test_fsdp_tp.py)
  The same launch checks that an exception raised on every rank alike, in forward or in
  backward, is recovered by reset_iter_state() without a trace in the numbers.
- four ranks: reshard_after_forward as an int against a shard group of 4: 1 and 4 mean False
  and True, 3 does not divide 4 (ValueError, torch too), 2 (resharding to a group of 2 after
  forward) both accept; dptc's blocks keep half their unsharded bytes after forward, none
  after backward or after set_reshard_after_forward(True) (the training, and torch's bytes:
  test_fsdp.py).
- failures, with DPTC_TIMEOUT=30: one rank raises inside a block's forward, diverges after
  catching that error, or is SIGKILLed there; every other rank raises a dptc.DistError within
  FAST_S seconds of the step's start (not at the timeout), every process exits by itself, and
  the harness finds nothing left in /dev/shm.
"""

import math

import pytest

from tests._launch import once, run_ranks

RUN_TIMEOUT_S = 120
DPTC_TIMEOUT_S = 30
# Survivors must raise this soon after the failing step began: a third of DPTC_TIMEOUT, so an
# error that only arrives by timing out fails.  Measured: 1.3 s when the failing rank raises
# (most of it the failing process's exit), 0.1 s when it diverges or is killed.
FAST_S = 10.0
# The same after an uncaught exception, which aborts the groups at once (measured 0.02-0.04 s).
UNCAUGHT_S = 0.8
FLOAT64_TOLERANCE = 1e-10

# case: (dptc's error, fragments of dptc's message, torch 2.13's error, fragment of torch's);
# None: the call is accepted.
REFUSALS = {
    "left_on_meta": ("RuntimeError", ["materialized from the meta device", "blocks.0.",
                                      "to_empty"],
                     "RuntimeError", "should be materialized from meta device"),
    "applied_twice": ("ValueError", ["already applied", "Block", "apply it once per module"],
                      "AssertionError", "can only be applied to a module once"),
    "child_after_parent": ("ValueError", ["bottom-up", "Block lies inside", "Net",
                                          "apply it to the blocks, then to their parents"],
                           "TypeError", "Invariant encountered"),
    "zero_dim": ("ValueError", ["Scalar.temperature", "0-dim", "make it shape (1,)",
                                "ignored_params"],
                 "ValueError", "doesn't support scalar parameters"),
    "reshard_after_forward_0": ("ValueError", ["reshard_after_forward", "got 0",
                                               "an int that divides the shard group size 2"],
                                "ValueError", "factor of 2, not 0"),
    "reshard_after_forward_5": ("ValueError", ["reshard_after_forward", "got 5",
                                               "an int that divides the shard group size 2"],
                                "ValueError", "factor of 2, not 5"),
    "reshard_after_forward_str": ("ValueError", ["reshard_after_forward", "got 'yes'",
                                                 "None, a bool, or an int"],
                                  "ValueError", "should be a bool or an int"),
    "shard_placement_not_a_shard": ("ValueError", ["shard_placement_fn must return a Shard "
                                                   "or None", "got 'x'", "Linear.weight"],
                                    "ValueError", "Invalid shard_placement_fn result"),
    "shard_placement_out_of_range": ("ValueError", ["Shard(2)", "Linear.weight (shape (4, 3))",
                                                    "-2 <= d < 2"],
                                     "AssertionError", "Shard dim 2 is invalid"),
    "shard_placement_uneven": (None, [], "NotImplementedError", "uneven sharding on dim 1"),
    "mesh_of_wrong_type": ("TypeError", ["mesh must be a torch DeviceMesh", "init_device_mesh",
                                         "got str"],
                           "AttributeError", "has no attribute 'ndim'"),
    "set_custom_all_gather": ("NotImplementedError",
                              ["FSDPModule.set_custom_all_gather", "not implemented by dptc"],
                              None, None),
    "forward_prefetch_of_plain_module": ("ValueError", ["modules[0]", "Block",
                                                        "not a module fully_shard was applied to"],
                                         "ValueError", "Expects FSDPModule"),
    "backward_prefetch_of_plain_module": ("ValueError", ["modules[0]", "Block",
                                                         "not a module fully_shard was applied "
                                                         "to"],
                                          "ValueError", "Expects FSDPModule"),
    "prefetch_not_a_list": ("TypeError", ["modules must be a list of fully_shard modules",
                                          "FSDPBlock"],
                            "TypeError", "not iterable"),
    "noncontiguous": (None, [], "NotImplementedError", "non-contiguous parameters"),
    "dtensor_on_2d_mesh": ("NotImplementedError", ["Linear.weight", "2-D mesh",
                                                   "tensor-parallel DTensors on a 1-D mesh"],
                           "TypeError", "Invariant encountered"),
    "tied_across_units": ("ValueError", ["Linear.weight is tied to Linear.weight",
                                         "earlier fully_shard call (on Block)",
                                         "fully_shard([module_a, module_b])"],
                          "ValueError", "is shared with a parameter already managed by "
                                        "another FSDP group"),
}

_launches = {}


def _launch(key, target, world_size, **kwargs):
    return once(_launches, key,
                lambda: run_ranks(target, world_size, timeout=RUN_TIMEOUT_S, **kwargs),
                f"the {key} launch")


def _validation():
    return _launch("validation", "tests.workers_fsdp_errors:validation_cases", 2)


def _check(outcome, error_type, fragments):
    assert outcome["type"] == error_type, outcome
    for fragment in fragments:
        assert fragment in outcome["message"], (fragment, outcome)


# ---------------------------------------------------------------------------------------------
# Two ranks: refusals

@pytest.mark.parametrize("impl", ["dptc", "torch"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal(case, impl):
    """The error type and the message (dptc: names the argument or value and the remedy;
    torch: the fragment that identifies its error), the same on both ranks."""
    dptc_type, dptc_fragments, torch_type, torch_fragment = REFUSALS[case]
    for result in _validation():
        outcome = result[impl][case]
        if impl == "dptc":
            _check(outcome, dptc_type, dptc_fragments)
        else:
            _check(outcome, torch_type, [torch_fragment] if torch_fragment else [])


def test_refusal_leaves_module_unchanged():
    """A refused fully_shard changes nothing: the module keeps its class and its plain
    parameters; after refusing a child, the parent's unit still trains (every gradient)."""
    for result in _validation():
        after = result["after"]
        assert after["zero_dim"] == {"class": "Scalar", "weight": "Tensor"}, after
        assert after["mesh_of_wrong_type"] == {"class": "Net"}, after
        child = after["child_after_parent"]
        assert (child["child_class"], child["parent_class"]) == ("Block", "FSDPNet"), child
        assert child["grads"] == child["params"] == 10 and math.isfinite(child["loss"]), child


@pytest.mark.parametrize("impl", ["dptc", "torch"])
def test_zero_dim_parameter_in_ignored_params_trains(impl):
    """The remedy works: with the 0-dim parameter in ignored_params, fully_shard shards the rest
    (DTensor parameter and gradient) and leaves the scalar a plain parameter with a gradient."""
    for result in _validation():
        outcome = result["zero_dim_ignored"][impl]
        assert outcome["type"] is None, outcome
        assert outcome["value"] == {"class": "FSDPScalar", "temperature": "Tensor",
                                    "temperature_grad": True, "weight": "DTensor",
                                    "weight_grad": "DTensor"}, outcome


def test_noncontiguous_parameters_match_single_process():
    """Weights that are transposed views (stride (1, out); dims 7 and 5 split unevenly over 2
    ranks) in the blocks and the root, and a permuted 3-dim parameter whose dim 0 is innermost:
    3 steps of clip_grad_norm_ and AdamW in float64 give the parameters and gradients of one
    process training on the whole batch (measured ~1e-15 apart)."""
    for rank, result in enumerate(_validation()):
        training = result["noncontiguous_training"]
        assert training["noncontiguous"] == ["mix", "blocks.0.fc.weight", "blocks.1.fc.weight",
                                             "blocks.2.fc.weight", "head.weight"], training
        assert training["shapes_match"], training
        assert training["param_rel"] <= FLOAT64_TOLERANCE, (rank, training)
        assert training["grad_rel"] <= FLOAT64_TOLERANCE, (rank, training)
        assert training["moved"] > 1e-3, (rank, training)  # the comparison compares something


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_exception_on_every_rank_is_recoverable(phase):
    """Every rank raises in the same place (forward: inside blocks.2, with blocks.3's gather
    prefetched; backward: at blocks.1's output, with the later blocks' reduce-scatters in
    flight), catches it and calls reset_iter_state(): training goes on with the group intact
    and matches a reference that skipped the failed step (float64)."""
    for rank, result in enumerate(_validation()):
        recovery = result["recovery"][phase]
        assert len(recovery["errors"]) == 1 and "injected" in recovery["errors"][0], recovery
        assert recovery["param_rel"] <= FLOAT64_TOLERANCE, (rank, recovery)


# ---------------------------------------------------------------------------------------------
# Four ranks: integer reshard_after_forward

def test_reshard_after_forward_int_at_four_ranks():
    expected = {
        "dptc_1": (None, []),
        "dptc_2": (None, []),
        "dptc_3": ("ValueError", ["reshard_after_forward", "got 3",
                                  "an int that divides the shard group size 4"]),
        "dptc_4": (None, []),
        "torch_1": (None, []),
        "torch_2": (None, []),
        "torch_3": ("ValueError", ["factor of 4, not 3"]),
        "torch_4": (None, []),
    }
    for result in _launch("four_ranks", "tests.workers_fsdp_errors:four_rank_cases", 4):
        for case, (error_type, fragments) in expected.items():
            _check(result[case], error_type, fragments)
        # After forward the blocks keep half their padded unsharded bytes, none once backward
        # gathered them; set_reshard_after_forward(True) reshards over all 4 ranks again.
        kept = result["dptc_2_kept"]
        assert kept["type"] is None, kept
        half = kept["value"]["padded_blocks"] // 2
        assert kept["value"]["kept"] == [half, 0, 0, 0], kept


# ---------------------------------------------------------------------------------------------
# Failures

def _fault(action, world_size, **args):
    return run_ranks("tests.workers_fsdp_errors:fault_case", world_size,
                     args={"action": action, **args}, timeout=RUN_TIMEOUT_S,
                     env={"DPTC_TIMEOUT": str(DPTC_TIMEOUT_S)}, expect_failure=True)


def _assert_dist_error(result, types=("PeerLostError", "DistTimeoutError",
                                      "CollectiveMismatchError")):
    assert result["exitcode"] == 1, result
    assert "DistError" in result["error_mro"] and result["error_type"] in types, result
    assert result["elapsed"] is not None and result["elapsed"] < FAST_S, result


def test_forward_exception_on_one_rank_fails_every_rank_fast():
    """Rank 1 raises ValueError inside blocks.2's forward in step 2 and exits with it; rank 0,
    which goes on into backward and waits there for a gather rank 1 never issues, raises a
    DistError naming rank 1 within FAST_S of the step's start (measured ~1.3 s, of which
    most is rank 1's interpreter exit), not after DPTC_TIMEOUT."""
    survivor, failing = _fault("raise", 2)
    assert failing["exitcode"] == 1, failing
    assert failing["error_type"] == "ValueError", failing
    assert failing["error"] == "injected failure in blocks.2 on rank 1", failing
    _assert_dist_error(survivor)
    assert "rank 1" in survivor["error"], survivor


def test_uncaught_exception_aborts_the_peers_at_once():
    """Rank 1's exception reaches sys.excepthook (uncaught, as in a torchrun script): dptc's
    hook aborts its groups before the process starts exiting, so rank 0 raises PeerLostError
    naming rank 1 and its exception within UNCAUGHT_S of the step's start (measured 0.02 to 0.04 s;
    without the hook it waited for rank 1's exit, 1-3 s)."""
    survivor, failing = _fault("raise", 2, on_error="uncaught")
    assert failing["error_type"] == "ValueError", failing
    _assert_dist_error(survivor, types=("PeerLostError",))
    assert "rank 1 stopped with an uncaught ValueError: injected failure" in survivor["error"]
    assert survivor["elapsed"] < UNCAUGHT_S, survivor


def test_rank_that_diverges_after_an_exception_fails_every_rank_fast():
    """Rank 1 catches its forward's ValueError, calls reset_iter_state() and trains the next
    step while rank 0 is still in the failed step's backward: the ranks' next all-gathers
    differ, and both raise CollectiveMismatchError naming what each issued (measured 0.1 s)."""
    results = _fault("raise", 2, on_error="continue", steps=4)
    for rank, result in enumerate(results):
        _assert_dist_error(result, types=("CollectiveMismatchError",))
        assert "all_gather_into_tensor" in result["error"], (rank, result)
        assert "global rank 0" in result["error"] and "global rank 1" in result["error"], result


def test_killed_rank_fails_survivors_fast():
    """Rank 1 of 3 SIGKILLs itself inside blocks.2's forward in step 2; ranks 0 and 2, in or
    entering an all-gather with it, raise PeerLostError naming rank 1 within FAST_S (measured
    under 0.1 s) and exit; no /dev/shm entry survives (run_ranks fails otherwise)."""
    results = _fault("kill", 3)
    assert results[1]["exitcode"] == -9 and results[1]["error_type"] is None, results[1]
    for rank in (0, 2):
        _assert_dist_error(results[rank], types=("PeerLostError",))
        assert "global rank 1" in results[rank]["error"], results[rank]


def test_failed_gather_keeps_its_storage():
    """Rank 1 of 2 SIGKILLs itself in blocks.2's forward; rank 0's gather of blocks.3 gives
    up with a DistError.  A cross-node gather blocked in gloo may still write into its outputs
    after that, so reshard() frees every unit's unsharded storage but that one: blocks.3 keeps
    its bytes (at least its parameters' own), every other unit holds none (before, the
    reshard freed it too, under a write that could still come).  Rank 0 exits cleanly."""
    results = run_ranks("tests.workers_fsdp_errors:failed_gather_case", 2,
                        timeout=RUN_TIMEOUT_S, env={"DPTC_TIMEOUT": str(DPTC_TIMEOUT_S)},
                        expect_failure=True)
    survivor = results[0]
    assert survivor["exitcode"] == 0, survivor
    value = survivor["value"]
    assert value["failure"] in ("PeerLostError", "DistTimeoutError"), value
    kept = value["kept"]
    assert kept["blocks.3"] >= value["full"]["blocks.3"] > 0, value
    assert all(nbytes == 0 for name, nbytes in kept.items() if name != "blocks.3"), value
