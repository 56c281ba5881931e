"""Work.result() and Work.get_future() of async collectives, against torch's gloo Work.

Layer: several ranks.  Rank-side code is in tests/workers_work_future.py; the same bodies run
on torch.distributed (gloo, the reference, `reference=True`) and on dptc, and the test
compares what each reports:
- per collective, the future's value and result(): list length, shapes, dtypes, values, and
  where each tensor lies in the collective's output; the future completing with nobody
  waiting; `.then()` and done callbacks running exactly once;
- a DDP trained with a comm hook in torch's documented form,
  `all_reduce(..., async_op=True).get_future().then(lambda fut: fut.value()[0])`, under
  torch's DDP with torch.distributed.all_reduce and under dptc's with dptc.all_reduce;
- dptc only: a peer that dies while a future is pending makes future.wait() raise
  PeerLostError within the deadline; a future pending at exit, or a fork of the rank, leaves
  the processes to exit cleanly.
"""

import pytest

from tests._compare import max_rel
from tests._launch import once, run_ranks

WORLD = 2
LAUNCH_TIMEOUT_S = 150
CASES = ("all_reduce", "all_reduce_complex", "broadcast", "all_gather_into_tensor",
         "all_gather_into_tensor_2d", "barrier")
# A survivor must raise within DPTC_TIMEOUT; this is how much later the harness may see it.
KILL_TIMEOUT_S = 10
KILL_SLACK_S = 5

_runs = {}


def _values(impl):
    return once(_runs, ("values", impl),
                lambda: run_ranks("tests.workers_work_future:values", WORLD,
                                  args={"impl": impl}, timeout=LAUNCH_TIMEOUT_S,
                                  reference=impl == "torch"))


@pytest.mark.parametrize("case", CASES)
def test_future_and_result_hold_torchs_values(case):
    """all_reduce and broadcast: [the tensor itself]; a complex all_reduce: [its (real,
    imaginary) view]; all_gather_into_tensor: the output's per-rank pieces, shaped as the
    input (gloo chunks the output); barrier: [].  The future completes without a wait, its
    callbacks run once, result() gives the same list."""
    torch_runs, dptc_runs = _values("torch"), _values("dptc")
    for rank in range(WORLD):
        want, got = torch_runs[rank][case], dptc_runs[rank][case]
        assert "error_type" not in want["future"], (rank, want)   # the reference worked
        for key in ("future", "result", "same_object", "same_future_value"):
            assert got[key] == want[key], (rank, key, got[key], want[key])
        assert got["result"] == got["future"], rank
        assert got["done_by_itself"] and want["done_by_itself"], (rank, got, want)
        assert got["then_calls"] == want["then_calls"] == 1, (rank, got, want)
        assert got["done_calls"] == want["done_calls"] == 1, (rank, got, want)
        assert got["same_future_object"], rank   # dptc keeps one future per work


def test_reduce_scatter_future_holds_the_output():
    """torch's gloo implements neither get_future() nor result() for reduce_scatter_tensor
    (RuntimeError); dptc gives NCCL's value, [output], as its future and result()."""
    torch_runs, dptc_runs = _values("torch"), _values("dptc")
    for rank in range(WORLD):
        want, got = torch_runs[rank]["reduce_scatter_tensor"], \
            dptc_runs[rank]["reduce_scatter_tensor"]
        assert want["future"]["error_type"] == "RuntimeError", (rank, want)
        assert "not implemented" in want["future"]["error"], (rank, want)
        # Block `rank` of sum_r arange(3 * WORLD) * (r + 1).
        block = [float(i) * sum(r + 1 for r in range(WORLD))
                 for i in range(3 * rank, 3 * rank + 3)]
        assert got["future"] == {"type": "list", "items": [[[3], "torch.float32", block, 0]]}, \
            (rank, got)
        assert got["result"] == got["future"], (rank, got)
        assert got["same_object"] and got["then_calls"] == got["done_calls"] == 1, (rank, got)


def test_several_outputs_future_holds_the_outputs():
    """dptc's all_gather_into_tensors (no torch counterpart): [the outputs passed]."""
    for rank in range(WORLD):
        got = _values("dptc")[rank]["all_gather_into_tensors"]
        pieces = [[float(i + 10 * r) for r in range(WORLD) for i in range(lo, hi)]
                  for lo, hi in ((0, 2), (2, 5))]
        assert got["future"] == [[[2 * WORLD], "torch.float32", pieces[0], None],
                                 [[3 * WORLD], "torch.float32", pieces[1], None]], (rank, got)
        assert got["same_objects"] and got["result_same"], (rank, got)


def test_result_before_completion_raises_as_torch():
    """result() while the collective still waits for a peer: torch's RuntimeError."""
    want, got = _values("torch")[0]["result_early"], _values("dptc")[0]["result_early"]
    assert want["error_type"] == "RuntimeError", want
    assert got == want, (got, want)


def test_future_of_a_completed_work():
    """get_future() after wait(): already completed, a `.then()` runs at once in the caller."""
    for rank in range(WORLD):
        want, got = _values("torch")[rank]["late_future"], _values("dptc")[rank]["late_future"]
        assert got == want, (rank, got, want)
        assert got == {"done": True, "chained": [2.0, 2.0], "calls_in_caller": True}, got


def test_ddp_hook_in_torchs_get_future_then_form():
    """The hook of torch's DDP comm hook tutorial, each side with its own DDP and all_reduce:
    the same parameters bit for bit, the `.then()` callback once per hook call."""
    want = run_ranks("tests.workers_work_future:train_with_hook", WORLD,
                     args={"impl": "torch"}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    got = run_ranks("tests.workers_work_future:train_with_hook", WORLD,
                    args={"impl": "dptc"}, timeout=LAUNCH_TIMEOUT_S)
    for rank in range(WORLD):
        assert got[rank]["hook_calls"] == want[rank]["hook_calls"] > 0, (rank, got, want)
        assert got[rank]["then_calls"] == got[rank]["hook_calls"], (rank, got)
        assert want[rank]["then_calls"] == want[rank]["hook_calls"], (rank, want)
        assert max_rel(got[rank]["params"], want[rank]["params"]) == 0.0, rank


@pytest.mark.parametrize("when", ["before", "during"])
def test_peer_death_reaches_the_future(when):
    """A peer killed while futures are pending: future.wait() raises PeerLostError naming it
    on every survivor, within the deadline, with nobody waiting on the work."""
    world, victim = 3, 1
    results = run_ranks("tests.workers_work_future:peer_dies", world,
                        args={"impl": "dptc", "victim": victim, "when": when},
                        env={"DPTC_TIMEOUT": str(KILL_TIMEOUT_S)}, timeout=90,
                        expect_failure=True)
    assert results[victim]["exitcode"] == -9, results[victim]
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert result["error_type"] == "PeerLostError", (rank, result)
        assert f"rank {victim}" in result["error"], (rank, result)
        assert result["exitcode"] == 1, (rank, result)
        assert result["elapsed"] < KILL_TIMEOUT_S + KILL_SLACK_S, (rank, result)


def test_error_through_a_then_chain():
    """The callback's fut.value() raises the collective's PeerLostError; the chained future
    raises torch's RuntimeError naming it, as torch's chains report a callback's error."""
    results = run_ranks("tests.workers_work_future:chained_error", WORLD,
                        args={"impl": "dptc"}, env={"DPTC_TIMEOUT": str(KILL_TIMEOUT_S)},
                        timeout=90)
    got = results[0]
    assert got["future"]["error_type"] == "PeerLostError", got
    assert got["callback_saw"] == ["PeerLostError"], got
    assert got["chained"]["error_type"] == "RuntimeError", got
    assert "PeerLostError" in got["chained"]["error"], got


def test_future_pending_at_exit_leaves_a_clean_exit():
    """A rank leaves with a future pending, a daemon thread in its wait() and a callback
    attached: both ranks exit with status 0 (run_ranks fails the run otherwise)."""
    results = run_ranks("tests.workers_work_future:pending_at_exit", WORLD,
                        args={"impl": "dptc"}, env={"DPTC_TIMEOUT": str(KILL_TIMEOUT_S)},
                        timeout=90)
    assert results[0] == {"pending": True}, results


def test_forked_child_leaves_the_future_alone():
    """A child forked while a future is pending refuses the parent's work's future, exits
    cleanly, and the parent's future completes with the sum."""
    results = run_ranks("tests.workers_work_future:forked_child", WORLD,
                        args={"impl": "dptc"}, timeout=90)
    got = results[0]
    assert got["pending_at_fork"], got
    assert got["child_said"].startswith("RuntimeError: get_future() on a work of the process "
                                        "this one was forked from"), got
    assert got["child_exit"] == 0, got
    assert got["value"] == [3.0] * 4 and got["after"] == [2.0, 2.0], got
