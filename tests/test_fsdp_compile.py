"""fully_shard with torch.compile and activation checkpointing as torchtitan and the FSDP2
documentation compose them, dptc's against torch's (gloo), 2 ranks, float64 GPT, 3 steps of
AdamW (tests/workers_fsdp_compile.py; tests/test_compile.py has the plain block.compile() and
compiled-root cases beside DDP's).

Scenarios: checkpoint_wrapper on each block, torch.compile(block, fullgraph=True) put back in
its place, fully_shard on each block and the root (torchtitan's order); the same with
block.compile(fullgraph=True) in place, so that fully_shard's hooks run inside the compiled
call; torch.compile(model) of the sharded model; model.compile() of the sharded model with
checkpointed blocks; a compiled training step (forward, loss and backward in one compiled
function, so that autograd runs fully_shard's backward hooks inside it).  All run with
torch._dynamo.config.error_on_recompile.  Checks, per scenario and rank:
- losses and trained parameters are torch's bit for bit, and within 1e-9 of one process
  training the plain eager model on the whole batch (measured 1.0e-11 under aot_eager, 1.7e-11
  under inductor, which compiles torchtitan's order; every scenario under inductor, run by hand
  with COMPILE_BACKEND=inductor, also equals torch's bit for bit);
- dynamo made as many graphs and broke them as often and where torch's run does, traced no
  more frames (2 against torch's 4 under a compiled root), and traced and made nothing after
  the first step.  Before dptc's forward hooks were frames dynamo skips, as torch's are,
  block.compile(fullgraph=True) raised dynamo's Unsupported at dptc's pre-forward hook, and
  under model.compile() and torch.compile(model) dynamo traced each hook's wrapper as a frame
  of its own (6 frames) and again for every new kind of call (4 versions of it here: a
  RecompileError under error_on_recompile); see [Note: torch.compile] in dptc/_compile.py.
  Before the backward hooks were such frames too, the compiled step traced them (112 frames
  against torch's 61 in one process) and recompiled the post-accumulate-grad hook at its
  second parameter (RecompileError).
"""

import os
import shutil

import pytest

from tests._compare import max_rel
from tests._launch import run_torch_then_dptc
from tests.workers_fsdp_compile import SCENARIOS

NAMES = list(SCENARIOS)
WORLD = 2
LAUNCH_TIMEOUT_S = 300
REFERENCE = 1e-9
# Where dynamo, tracing a module's call inline, meets a fully_shard forward hook and breaks:
# dptc's names the hook, torch's the torch._dynamo.disable its hook calls.
HOOK_BREAKS = ("qualname: State._pre_forward,", "qualname: State._post_forward,",
               "qualname: disable,")


def _break_sites(breaks):
    """{reason: count} with the breaks at a fully_shard forward hook counted as one site."""
    sites = {}
    for reason, count in breaks.items():
        key = "fully_shard hook" if any(h in reason for h in HOOK_BREAKS) else reason
        sites[key] = sites.get(key, 0) + count
    return sites

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="torch.compile's CPU backend needs a C++ compiler ($CXX or g++), and none is here")


@pytest.fixture(scope="module")
def runs():
    return run_torch_then_dptc("tests.workers_fsdp_compile:train_cases", WORLD,
                               {"scenarios": NAMES}, LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_fully_shard_matches_torch(runs, name):
    torch_results, dptc_results = runs
    for rank in range(WORLD):
        mine, theirs = dptc_results[rank][name], torch_results[rank][name]
        assert theirs["ok"], theirs.get("error")
        assert mine["ok"], mine.get("error")
        assert mine["losses"] == theirs["losses"], (name, rank)
        assert max_rel(mine["params"], theirs["params"]) == 0.0, (name, rank)
        assert mine["ref_rel"] <= REFERENCE, (name, rank, mine["ref_rel"])
        assert theirs["ref_rel"] <= REFERENCE, (name, rank, theirs["ref_rel"])
        for key in ("graphs", "frames"):
            assert mine[key] == theirs[key], (name, rank, key, mine[key], theirs[key])
        assert _break_sites(mine["breaks"]) == _break_sites(theirs["breaks"]), \
            (name, rank, mine["breaks"], theirs["breaks"])
        # torch's hooks open two more frames dynamo looks at and skips (functools' wraps
        # and update_wrapper, as they make their torch._dynamo.disable wrapper at each call).
        assert all(a <= b for a, b in zip(mine["traced"], theirs["traced"])), \
            (name, rank, mine["traced"], theirs["traced"])
        for key in ("frames", "traced"):
            assert mine[key][-1] == mine[key][0], (name, rank, key, mine[key])
        assert mine["graphs"] >= 1, (name, rank)
