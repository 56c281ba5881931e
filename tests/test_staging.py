"""How a collective on one node stages its data in the shared segment's slots: cached or
streamed, fixed with DPTC_SHM_STAGING or chosen by local rank 0 from their timings ([Note:
staging] in csrc/shm.c).

Layer: several ranks (rank code in tests/workers_staging.py).  The suite's other collective
and DDP tests run under the automatic choice, which starts cached and rarely meets collectives
large enough to try the other; here each staging is forced, and the choice is made to switch,
with every result checked bit for bit.
"""

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")

import pytest

from tests._launch import run_ranks

SEED = 4321
TIMEOUT_S = 120


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_streamed_collectives_match_math(world_size):
    """Every op, dtype and size of tests/workers_collectives.py, the 64.8 MiB all-reduce and
    the async checks, with every staged collective streamed (4 ranks share the 2 cores of the
    development machine: rounds of a whole slot, waits that sleep)."""
    results = run_ranks("tests.workers_staging:sweep", world_size, args={"seed": SEED},
                        timeout=TIMEOUT_S, env={"DPTC_SHM_STAGING": "streamed"})
    failures = [f"rank {rank}: {line}" for rank, result in enumerate(results)
                for line in result["sync"] + result["async"]]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
    for rank, result in enumerate(results):
        for op in OPS:
            counts = result["stagings"][op]
            assert counts["cached"] == 0 and counts["streamed"] >= 10, (rank, op, counts)


@pytest.mark.parametrize("world_size", (2, 3))
def test_automatic_choice_is_the_same_on_every_rank(world_size):
    """Under the automatic choice local rank 0 tries the streamed staging of each kind of
    collective after two timed ones, then keeps whichever is cheaper: both stagings run for
    all_reduce, all_gather, reduce_scatter and broadcast, every rank stages each collective the
    same way (equal counts), and every result is the math's, bit for bit."""
    calls = 12
    results = run_ranks("tests.workers_staging:auto_choice", world_size,
                        args={"seed": SEED, "calls": calls}, timeout=TIMEOUT_S,
                        env={"DPTC_SHM_STAGING": None})
    failures = [f"rank {rank}: {line}" for rank, result in enumerate(results)
                for line in result["failures"]]
    assert not failures, "\n".join(failures)
    counts = [result["stagings"] for result in results]
    assert all(c == counts[0] for c in counts), counts
    for op in OPS:
        each = counts[0][op]
        assert each["cached"] >= 2 and each["streamed"] >= 1, (op, each)
        assert each["cached"] + each["streamed"] == calls, (op, each)


_trainings = {}


def _training(staging, world_size):
    key = (staging, world_size)
    if key not in _trainings:
        _trainings[key] = run_ranks("tests.workers_staging:ddp_training", world_size,
                                    args={"seed": SEED, "steps": 4}, timeout=TIMEOUT_S,
                                    env={"DPTC_SHM_STAGING": staging})
    return _trainings[key]


@pytest.mark.parametrize("world_size", (2, 3))
def test_ddp_trains_to_the_same_bits_either_way(world_size):
    """DDP's gradients, reduced in place as pieces: the parameters after 4 SGD steps are
    bit-identical under either staging, on every rank, and within 1e-5 of single-process
    training on the whole batch."""
    cached, streamed = _training("cached", world_size), _training("streamed", world_size)
    for rank in range(world_size):
        assert cached[rank]["stagings"]["all_reduce"]["streamed"] == 0, cached[rank]
        assert streamed[rank]["stagings"]["all_reduce"]["cached"] == 0, streamed[rank]
        assert streamed[rank]["stagings"]["all_reduce"]["streamed"] >= 4, streamed[rank]
        assert streamed[rank]["digest"] == cached[rank]["digest"] == cached[0]["digest"], rank
        assert cached[rank]["max_rel"] < 1e-5, cached[rank]


def test_bad_staging_names_the_variable():
    """DPTC_SHM_STAGING takes auto, cached or streamed; anything else is a ValueError naming
    the variable and the choices, on every rank."""
    results = run_ranks("tests.workers_staging:bad_staging", 2, timeout=TIMEOUT_S,
                        env={"DPTC_SHM_STAGING": "fast"})
    for result in results:
        assert result.startswith("ValueError: DPTC_SHM_STAGING must be one of auto, cached, "
                                 "streamed, got 'fast'"), result
