"""torchrun --max-restarts: a rank that fails is an error on every rank, and the restarted
workers resume from the last snapshot (tests/scripts/elastic_restart.py, 2 ranks, 6 steps).

Checks: with rank 1 failing at step 3 of the first attempt, torchrun exits 0, every rank
finishes in the second attempt having resumed at step 3, and the parameters are bit for bit
those of an uninterrupted run (a fresh copy the same processes train afterwards).  The restart meets torchrun's agent store again, whose keys of
the first attempt outlive its workers (see [Note: torchrun restarts] in dptc/group.py): dptc's
bootstrap and gloo's must read only the second attempt's.  torch's DDP is not run here: with
torch alone (elastic_restart.py --impl torch), gloo's connectFullMesh dialled a dead worker of
the first attempt and failed in 5 of 6 restarts here.
"""

import json

import pytest

from tests._launch import run_torchrun_nodes

SCRIPT = "tests/scripts/elastic_restart.py"
TIMEOUT_S = 120


def test_restart_resumes_from_the_snapshot(tmp_path):
    snapshot = tmp_path / "restarted.pt"
    [(code, out, err)] = run_torchrun_nodes(
        ["--max-restarts=1", SCRIPT, str(snapshot), "--fail-at", "3"],
        nnodes=1, nproc_per_node=2, timeout=TIMEOUT_S)
    assert code == 0, f"torchrun exited {code}:\n{out[-2000:]}\n{err[-4000:]}"
    for rank in (0, 1):
        result = json.loads(snapshot.with_name(f"{snapshot.name}.rank{rank}.json").read_text())
        assert result["attempt"] == 1 and result["start"] == 3, result
        assert result["params"] == result["uninterrupted"], rank


@pytest.mark.parametrize("lag", [0.0, 1.0])
def test_setup_cleanup_loop_under_torchrun(tmp_path, lag):
    """torch's DDP tutorial's setup() and cleanup() in a loop under torchrun
    (tests/scripts/reinit_loop.py: dptc.init_process_group, work on dptc's group and torch's,
    torch's destroy_process_group; three rounds, rank 0 `lag` seconds late to each cleanup).
    Every round's group works, on both ranks.

    Old behaviour: the second round failed on rank 0 in gloo's connectFullMesh ("Connection
    refused"): torchrun's agent store still held the first round's gloo addresses, and dptc
    handed torch that store as it was ([Note: torchrun restarts] in dptc/group.py).  torch alone
    runs the same loop (its ranks overwrite their addresses first)."""
    out = tmp_path / "reinit"
    [(code, stdout, stderr)] = run_torchrun_nodes(
        ["tests/scripts/reinit_loop.py", str(out), "--lag", str(lag)],
        nnodes=1, nproc_per_node=2, timeout=TIMEOUT_S)
    assert code == 0, f"torchrun exited {code}:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    for rank in (0, 1):
        result = json.loads(out.with_name(f"{out.name}.rank{rank}.json").read_text())
        assert result["rounds"] == [[3.0, 1, True]] * 3, (rank, result)

