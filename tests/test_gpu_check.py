"""benchmarks/gpu_check.py on a machine without a GPU.

The script is the one prepared check for a lent GPU machine (issue 8 §3), run there once and
unattended.  Here it must still import, run and end cleanly: exit 0, every GPU section one SKIP
row that gives the reason, the table printed last, the same rows in $OUT/gpu_check.json.
CUDA_VISIBLE_DEVICES="" makes the same hold on a machine that has a GPU.
"""

import json
import os
import subprocess
import sys

from tests._launch import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_check.py"
GPU_SECTIONS = ("collectives", "ddp", "fsdp", "drill")
# A hang guard, not a timing threshold: the run takes a few seconds.
TIMEOUT_S = 60
# Variables torchrun sets: with them the script would think it runs under torchrun.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "MASTER_ADDR", "MASTER_PORT")


def _env(out):
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC")}
    env.update(OUT=str(out), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def test_without_cuda_every_gpu_section_is_skipped(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert [row["section"] for row in rows] == ["env", *GPU_SECTIONS]
    environment = rows[0]
    assert environment["outcome"] == "ok", environment["detail"]
    assert environment["dptc_info"]["dptc"]["version"]        # python -m dptc.info --json
    for row in rows[1:]:
        assert row["outcome"] == "SKIP", row
        assert row["detail"].startswith("no CUDA device: "), row["detail"]
    assert not (tmp_path / "gpu_check_logs").exists()          # no section was launched

    # The table comes last: a header, one line per row, a line of counts.
    lines = done.stdout.rstrip().splitlines()
    assert lines[-1] == "ok 1  SKIP 4"
    table = lines[-(len(rows) + 2):-2]
    assert table[0].split()[:2] == ["environment", "ok"]
    for line, section in zip(table[1:], GPU_SECTIONS):
        assert line.split()[:5] == [section, "SKIP", "no", "CUDA", "device:"], line
    assert lines[-(len(rows) + 4)].split() == ["check", "outcome", "detail"]
