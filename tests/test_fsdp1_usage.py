"""FullyShardedDataParallel (FSDP1's API) as training scripts use it: torch's "Getting
Started with FSDP" and "Advanced FSDP" tutorials, accelerate's and Lightning's FSDP plugins.

Layer: several ranks; rank-side code in tests/workers_fsdp1_usage.py.  Each test runs one body
under torch's own FullyShardedDataParallel (gloo, device_id="cpu"; judged by the results its
ranks report, see run_ranks' reference=True) and under dptc's, and compares the numbers.
"""

import math

from tests._compare import max_rel
from tests._launch import run_ranks

LAUNCH_TIMEOUT_S = 240


def _both(case, world_size=2, **args):
    """case's results per rank, under torch's FSDP1 and under dptc's."""
    theirs = run_ranks(f"tests.workers_fsdp1_usage:{case}", world_size,
                       args={"impl": "torch", **args}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    mine = run_ranks(f"tests.workers_fsdp1_usage:{case}", world_size,
                     args={"impl": "dptc", **args}, timeout=LAUNCH_TIMEOUT_S)
    return mine, theirs


def test_apply_initialises_the_full_parameters_as_torchs():
    """model.apply(init_weights) after wrapping, as scripts initialise a model they wrapped:
    fn sees every full weight (its full shape) and the normal_ draws are the full tensors'
    from the generator, so the parameters equal torch's FSDP1's and a single process's bit
    for bit on every rank, and apply returns the instance.  (dptc's apply was nn.Module's:
    fn drew into the local shards, every parameter it drew 0.02-scale values off torch's.)"""
    mine, theirs = _both("apply_case")
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert result["returns_self"] and reference["returns_self"]
        assert result["shapes"] == reference["shapes"], (rank, result["shapes"])
        assert list(result["params"]) == list(reference["params"]) == list(result["single"])
        assert max_rel(result["params"], reference["params"]) == 0.0, rank
        assert max_rel(result["params"], result["single"]) == 0.0, rank


def test_getting_started_tutorial_trains_as_torchs():
    """torch's "Getting Started with FSDP" script (its MNIST network on random images,
    size_based_auto_wrap_policy(min_num_params=100), use_orig_params=False, Adadelta and
    StepLR, dropout, the all-reduced loss log, the test pass under no_grad): the logged
    losses, the test outputs and the trained parameters are torch's bit for bit.  What
    differs by design (README): torch's parameters are one flat parameter per instance
    (`_flat_param`, 1-D), dptc's the module's own, in their full shapes."""
    for rank, (result, reference) in enumerate(zip(*_both("tutorial_case"))):
        for key in ("losses", "test", "params"):
            assert max_rel(result[key], reference[key]) == 0.0, (rank, key)
        assert all(name.endswith("._flat_param") for name in reference["names"])
        assert all(len(shape) == 1 for shape in reference["shapes"])
        assert [name.replace("_fsdp_wrapped_module.", "") for name in result["names"]] == \
            list(result["params"])
        assert [len(values) for values in result["params"].values()] == \
            [math.prod(shape) for shape in result["shapes"]]


def test_an_optimizer_built_before_wrapping_is_a_clear_error():
    """An optimizer made from model.parameters() before wrapping holds the parameters
    FullyShardedDataParallel replaced: its step() raises RuntimeError naming them (by their
    names in the model) and the remedy, and changes nothing; one made after wrapping steps
    to the single-process step (float64), one holding only ignored parameters steps too, and
    adding a replaced parameter to a good one (add_param_group) raises at its next step.
    (dptc's step changed nothing, silently: 0 parameters moved.  torch 2.13's FSDP1 dies
    with SIGSEGV, so this runs on dptc alone.)"""
    for rank, result in enumerate(run_ranks(
            "tests.workers_fsdp1_usage:optimizer_before_wrapping_case", 2,
            timeout=LAUNCH_TIMEOUT_S)):
        kind, message = result["before"]
        assert kind == "RuntimeError", result["before"]
        assert message.startswith("SGD.step(): the optimizer holds 14 parameters that "
                                  "FullyShardedDataParallel replaced"), message
        assert "(tok_emb.weight, blocks.0.ln_attn.weight, " in message, message
        assert "pos_emb" not in message, message
        assert "Construct the optimizer after wrapping" in message, message
        assert result["moved"] == 0, (rank, result["moved"])
        assert result["ignored"] is None and result["after"] is None, (rank, result)
        got, want = result["after_vs_reference"]
        assert max_rel(got, want) <= 1e-12, rank
        assert result["added"][0] == "RuntimeError" and \
            "holds 1 parameters" in result["added"][1], result["added"]
