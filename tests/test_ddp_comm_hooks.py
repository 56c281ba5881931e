"""Python communication hooks on dptc's DistributedDataParallel, against torch's DDP (gloo).

Each side trains the same GPT for five SGD steps on 2 ranks with one hook per scenario
(tests/workers_ddp_hooks.py), in one launch per implementation.  Checks, per scenario and rank:
- what the hook is given, call by call, is what torch's DDP gives it: the bucket index and
  is_last(), the parameters in the bucket and their order, the buffer's size, dtype and
  contents (undivided gradients, as torch's), before and after the first backward's rebuild
  of the buckets, and only in synced backward passes;
- the trained parameters and the last gradients are torch's within 1e-6 (in practice
  bit-identical: the same hook runs the same arithmetic on the same buffers).
Scenarios: a probe hook over torch's allreduce_hook (with several buckets; with
find_unused_parameters, which keeps the first buckets; with gradient_as_bucket_view and no_sync
accumulation; under fp16_compress_wrapper), torch's noop_hook (gradients stay local), and
torch's powerSGD_hook, bare, under fp16_compress_wrapper and with the wrapper's own
process_group as its state's (one bucket, as PowerSGD needs on gloo; torch 2.13's
batched_powerSGD_hook fails its own shape check under torch's DDP too), and
torch's post_localSGD_hook (global averaging for two steps, then within one-rank subgroups).

Failures, dptc only: a hook that returns no future, or a future whose value is gloo's list, is
a TypeError naming the remedy on every rank; a hook that raises on one rank makes the other
raise within seconds, not at the timeout; a future that never completes is a timeout on every
rank.
"""

import pytest

from tests._compare import max_rel
from tests._launch import run_ranks

SCENARIOS = ("probe", "probe_unused", "probe_view_no_sync", "probe_fp16_wrapper", "noop",
             "powersgd", "fp16_powersgd", "powersgd_ddp_group", "post_local_sgd")
WORLD = 2
LAUNCH_TIMEOUT_S = 180
AGREEMENT = 1e-6
# The hook's future is waited for within DPTC_TIMEOUT; the other failures must be quicker.
PROMPT_S = 10.0


@pytest.fixture(scope="module")
def runs():
    args = {"scenarios": list(SCENARIOS)}
    torch_results = run_ranks("tests.workers_ddp_hooks:train", WORLD,
                              args=dict(args, impl="torch"), timeout=LAUNCH_TIMEOUT_S,
                              reference=True)
    dptc_results = run_ranks("tests.workers_ddp_hooks:train", WORLD,
                             args=dict(args, impl="dptc"), timeout=LAUNCH_TIMEOUT_S)
    return torch_results, dptc_results


def _trace_mismatch(got, want):
    if len(got) != len(want):
        return f"{len(got)} hook calls against torch's {len(want)}"
    for k, (a, b) in enumerate(zip(got, want)):
        if a[:6] != b[:6] or abs(a[6] - b[6]) > AGREEMENT * max(1.0, abs(b[6])):
            return f"call {k}: {a[:6]} sum {a[6]!r} against torch's {b[:6]} sum {b[6]!r}"
    return None


@pytest.mark.parametrize("name", SCENARIOS)
def test_hook_trains_as_under_torch(runs, name):
    torch_results, dptc_results = runs
    for rank in range(WORLD):
        want, got = torch_results[rank][name], dptc_results[rank][name]
        mismatch = _trace_mismatch(got["trace"], want["trace"])
        assert mismatch is None, f"rank {rank}: {mismatch}"
        assert max_rel(got["params"], want["params"]) <= AGREEMENT, rank
        assert max_rel(got["grads"], want["grads"]) <= AGREEMENT, rank


def test_process_group_is_torchs(runs):
    """ddp.process_group is the torch group, as under torch's DDP: scripts call its size()
    and rank() and hand it to torch's hooks (powersgd_ddp_group) and collectives."""
    torch_results, dptc_results = runs
    for rank in range(WORLD):
        for name in SCENARIOS:
            got, want = dptc_results[rank][name]["group"], torch_results[rank][name]["group"]
            assert got == want == [True, WORLD, rank, "gloo"], (rank, name, got, want)


def test_probes_see_several_buckets_and_the_rebuild(runs):
    """The probe scenarios test what they mean to: several buckets from the second step on,
    one bucket in the first (torch's, before the first backward's order is known), except
    with find_unused_parameters, whose first buckets stay; with no_sync, the hook runs only
    in the synced backward of each step."""
    _, dptc_results = runs
    for rank in range(WORLD):
        per_step = {}
        for step, *_ in dptc_results[rank]["probe"]["trace"]:
            per_step[step] = per_step.get(step, 0) + 1
        assert per_step[0] == 1 and min(per_step[s] for s in range(1, 5)) >= 3, per_step
        unused = [call[0] for call in dptc_results[rank]["probe_unused"]["trace"]]
        assert unused.count(0) == unused.count(4) >= 3, unused
        view = dptc_results[rank]["probe_view_no_sync"]["trace"]
        assert len(view) == len(dptc_results[rank]["probe"]["trace"]), len(view)


def test_noop_hook_leaves_gradients_local(runs):
    _, dptc_results = runs
    rank0, rank1 = (dptc_results[r]["noop"]["grads"] for r in range(WORLD))
    assert max_rel(rank0, rank1) > 1e-3   # each rank kept its own gradients
    # post_localSGD_hook: after its two global steps the gradients stay local too.
    rank0, rank1 = (dptc_results[r]["post_local_sgd"]["grads"] for r in range(WORLD))
    assert max_rel(rank0, rank1) > 1e-3


def _failure(case, env=None):
    return run_ranks("tests.workers_ddp_hooks:failing", WORLD, args={"case": case},
                     timeout=60, expect_failure=True, env=env)


@pytest.mark.parametrize("case, fragment", [
    ("not_a_future", "torch.futures.Future"),
    ("list_value", ".then(lambda fut: fut.value()[0])"),
])
def test_hook_without_a_tensor_future_is_a_type_error(case, fragment):
    for rank, result in enumerate(_failure(case)):
        assert result["error_type"] == "TypeError", (rank, result)
        assert fragment in result["error"] and "communication hook" in result["error"], result
        assert result["exitcode"] == 1, result


def test_hook_failing_on_one_rank_fails_the_other_promptly():
    r0, r1 = _failure("raises_on_rank_1")
    assert r1["error_type"] == "ValueError" and "on purpose" in r1["error"], r1
    assert r0["error_type"] == "PeerLostError", r0
    assert r0["elapsed"] < PROMPT_S, r0
    assert r0["exitcode"] == 1 and r1["exitcode"] == 1, (r0, r1)


def test_hook_future_that_never_completes_times_out():
    results = _failure("never_completes", env={"DPTC_TIMEOUT": "2"})
    types = [result["error_type"] for result in results]
    assert "DistTimeoutError" in types and set(types) <= {"DistTimeoutError", "PeerLostError"}, \
        results
    for result in results:
        assert "did not complete within the group's timeout" in result["error"], result
        assert 1.5 < result["elapsed"] < PROMPT_S, result
        assert result["exitcode"] == 1, result
