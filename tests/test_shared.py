"""Shared buffers: memory every local rank maps, reduced in place without staging copies."""

import pytest

from tests._launch import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_on_shared_buffers(world_size):
    failures = run_ranks("tests.workers_shared:all_reduce_cases", world_size, timeout=180)
    for rank, rank_failures in enumerate(failures):
        assert rank_failures == [], f"rank {rank}: " + "\n".join(rank_failures)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_and_scatter_on_shared_buffers(world_size):
    failures = run_ranks("tests.workers_shared:gather_scatter_cases", world_size, timeout=180)
    for rank, rank_failures in enumerate(failures):
        assert rank_failures == [], f"rank {rank}: " + "\n".join(rank_failures)


def test_shared_against_plain_is_a_mismatch():
    results = run_ranks("tests.workers_shared:shared_against_plain", 2, expect_failure=True,
                        timeout=60)
    for result in results:
        assert result["error_type"] == "CollectiveMismatchError", result
        assert "shared buffer #0" in result["error"], result["error"]


def test_shared_tensor_outlives_group():
    results = run_ranks("tests.workers_shared:outlives_group", 2, timeout=60)
    assert results == [1000 * 4.0] * 2
