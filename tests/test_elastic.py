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
