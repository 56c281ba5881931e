"""Training-script patterns around DDP, against torch's DDP (gloo), on 2 ranks.

Each case (tests/workers_ddp_patterns.py) is a loop written as PyTorch's DDP material and
common scripts write it, where only the DDP class differs.  Checks, per case and rank, that
dptc's losses and parameters are torch's bit for bit:
GANs, each network its own DDP and optimizer (the discriminator step on detached fakes, the
generator step through both; the DCGAN example's order, a backward per discriminator forward;
WGAN-GP, whose gradient penalty runs torch.autograd.grad(create_graph=True) through the critic
before the one backward of three critic forwards); an encoder and a decoder, two DDPs under one
loss and one backward; ZeroRedundancyOptimizer, also with parameters_as_bucket_view over
bucket-view gradients; an EMA through torch.optim.swa_utils.AveragedModel over the wrapper;
forward returning a dict, a namedtuple, a dataclass or a tuple with non-tensors, with only some
outputs in the loss (find_unused_parameters) or all of them; two forwards (two views of the
batch) before one backward; a no_grad or inference_mode evaluation in eval mode between steps,
and one with grad enabled and no backward, with BatchNorm buffers (broadcast_buffers on and
off); DistributedSampler with set_epoch and drop_last; model.module and the state_dict keys; a
backbone frozen after wrapping (with find_unused_parameters) and a layer unfrozen after
wrapping (its gradients stay local under both); clip_grad_norm_, also over gradients that are
bucket views (gradient_as_bucket_view, zero_grad with and without set_to_none, momentum);
weight_norm and spectral_norm parametrizations; a module called twice in forward; the
tutorial's checkpoint (rank 0 saves ddp.state_dict(), a barrier, every rank loads it with
map_location and trains on); a forward with keyword arguments; after a synced backward,
torch.autograd.grad through the outputs and a local term through ddp.module; a top-1 mixture of
experts with find_unused_parameters, its load-balancing loss kept on the module and added
outside forward.

Beyond torch: a dataclass output with find_unused_parameters=True, where torch's DDP cannot see
the tensors and raises, trains to torch's numbers for the same model returning a namedtuple.

Errors, dptc against torch:
- a second backward through the outputs of one forward (a backward per output, or twice over
  one loss with retain_graph=True) raises RuntimeError on every rank, naming the parameter
  and the remedy.  torch raises for the first (an internal error under
  find_unused_parameters) and silently leaves the second backward's gradients unaveraged, so
  its replicas drift apart (checked: over 0.1 relative);
- a parameter frozen after wrapping, without find_unused_parameters, raises RuntimeError (as
  torch's does, one step later) naming it and saying that its requires_grad changed after
  construction.
"""

import pytest

from tests._compare import max_rel
from tests._launch import run_ranks, run_torch_then_dptc

WORLD = 2
LAUNCH_TIMEOUT_S = 180
TRAINING = ["gan", "zero", "out_dict_aux", "out_dict_fu", "out_dict_fu_aux",
            "out_namedtuple_aux", "out_namedtuple_fu", "out_namedtuple_fu_aux",
            "out_dataclass_aux", "out_dataclass_fu_aux", "out_tuple_aux", "out_tuple_fu",
            "out_tuple_fu_aux", "two_views", "eval_between", "eval_between_nobcast",
            "eval_grad", "inference", "sampler", "module_access", "freeze_after_fu",
            "unfreeze_after", "clip", "normed", "used_twice", "checkpoint", "kwargs_forward",
            "local_after_step", "encoder_decoder", "clip_view", "clip_view_zeros", "dcgan",
            "wgan_gp", "swa_ema", "zero_bucket_view", "moe"]
BEYOND_TORCH = ["out_dataclass_fu"]
# Cases where dptc raises; torch's outcome is checked in test_torch_reference_of_the_errors.
FAILING = ["two_backwards_fu", "retain_twice", "retain_twice_fu", "freeze_after",
           "two_backwards"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ddp_patterns"))
    return run_torch_then_dptc("tests.workers_ddp_patterns:run_cases", WORLD,
                               {"cases": TRAINING + FAILING, "tmpdir": path}, LAUNCH_TIMEOUT_S,
                               dptc_args={"cases": TRAINING + BEYOND_TORCH, "tmpdir": path})


@pytest.mark.parametrize("name", TRAINING)
def test_trains_as_torch(runs, name):
    torch_results, dptc_results = runs
    for rank in range(WORLD):
        want, got = torch_results[rank][name], dptc_results[rank][name]
        assert "error" not in want, want["error"]
        assert "error" not in got, got["error"]
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        assert max_rel(got["params"], want["params"]) == 0.0, rank
        for key in set(want) - {"losses", "params"}:
            assert got[key] == want[key], (rank, key, got[key], want[key])


def test_dataclass_output_with_unused_parameters_beyond_torch(runs):
    torch_results, dptc_results = runs
    for rank in range(WORLD):
        got = dptc_results[rank]["out_dataclass_fu"]
        assert "error" not in got, got["error"]
        same_model = torch_results[rank]["out_namedtuple_fu"]
        assert got["losses"] == same_model["losses"], rank
        assert max_rel(got["params"], same_model["params"]) == 0.0, rank
        assert got["aux_grad_none"] is True, got   # the head left out keeps .grad None


def test_torch_reference_of_the_errors(runs):
    torch_results, _ = runs
    for rank in range(WORLD):
        results = torch_results[rank]
        assert "RuntimeError" in results["two_backwards_fu"]["error"], results["two_backwards_fu"]
        assert "marked as ready twice" in results["two_backwards"]["error"]
        assert "Expected to have finished reduction" in results["freeze_after"]["error"]
    for name in ("retain_twice", "retain_twice_fu"):   # torch trains, but each rank its own way
        assert max_rel(torch_results[0][name]["params"], torch_results[1][name]["params"]) > 0.1


def _failure(case):
    return run_ranks("tests.workers_ddp_patterns:failing", WORLD,
                     args={"impl": "dptc", "case": case}, timeout=60, expect_failure=True)


@pytest.mark.parametrize("case, parameter", [
    ("two_backwards_fu", "aux.bias"),
    ("retain_twice", "2.bias"),
    ("retain_twice_fu", "2.bias"),
])
def test_second_backward_through_one_forward_raises(case, parameter):
    for rank, result in enumerate(_failure(case)):
        assert result["error_type"] == "RuntimeError", (rank, result)
        assert (f"parameter '{parameter}' received a gradient in a second backward pass "
                f"through the outputs of one forward") in result["error"], result
        assert "Run backward() once per forward" in result["error"], result
        assert result["exitcode"] == 1, result


def test_parameter_frozen_after_wrapping_is_named():
    for rank, result in enumerate(_failure("freeze_after")):
        assert result["error_type"] == "RuntimeError", (rank, result)
        assert (f"did not receive a gradient in this backward pass on rank {rank}: "
                f"0.weight, 0.bias.  Of these, 0.weight, 0.bias had requires_grad=True when "
                f"DistributedDataParallel was constructed and have requires_grad=False now"
                ) in result["error"], result
        assert "Freeze parameters before wrapping the module" in result["error"], result
        assert result["exitcode"] == 1, result


def test_loss_split_over_backward_calls_is_named():
    for rank, result in enumerate(_failure("two_backwards")):
        assert result["error_type"] == "RuntimeError", (rank, result)
        assert "aux.weight, aux.bias" in result["error"], result
        assert ("If the loss is split over several backward() calls for one forward, sum the "
                "losses and call backward() once") in result["error"], result
        assert result["exitcode"] == 1, result
