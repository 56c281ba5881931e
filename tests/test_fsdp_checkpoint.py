"""Checkpointing fully_shard models: meta-device init, DCP save/load across world sizes, full
state dicts, and checkpoints exchanged with torch's own fully_shard.

Layer: several ranks.  Rank-side code is in tests/workers_fsdp_checkpoint.py (the model, data
and files are described there).  Four launches, shared by the tests below and run in this order
(each later one reads the checkpoints of the earlier ones from the test's temporary folder):
    dptc at 2 ranks    meta init, reset_parameters, K=3 AdamW steps, full state dicts,
                       dcp.save + dcp.async_save, M=2 more steps (uninterrupted), resumes from
                       the checkpoints and the full state dicts, a rollback into the trained model
    torch at 2 ranks   the same with torch.distributed.fsdp.fully_shard on gloo, then loads
                       dptc's checkpoint
    dptc at 3 ranks    K+M uninterrupted steps; loads the 2-rank checkpoints of dptc and torch
    dptc at 1 rank     the same

Everything trains in float64.  Two runs that are the same computation (a resume at the world
size of the save, a full-state-dict round trip, a rollback) must agree bit for bit and are
asserted equal.  Runs at different world sizes differ in summation order only (the
reduce-scatter adds 2 or 3 rank contributions, the ranks' losses are means over 6, 4 or 12
rows): measured after K+M=5 steps, a 3-rank (1-rank) run resumed from the 2-rank checkpoint is
6e-13 (3e-13) relative from the uninterrupted 3-rank (1-rank) run in its parameters and 3e-15
in its losses.  FLOAT64_TOLERANCE = 1e-10 leaves over two orders of margin, while a lost AdamW
state shows as 0.48 relative (test_adamw_state_is_needed), a wrong shard or stale value as
1e-3 to 1.
"""

import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from examples.gpt import build_gpt
from tests._launch import once, run_ranks
from tests._compare import max_rel
from tests.workers_fsdp_checkpoint import STEPS_AFTER, STEPS_BEFORE

LAUNCH_TIMEOUT_S = 240
FLOAT64_TOLERANCE = 1e-10
# What a checkpoint that lost information looks like: far above FLOAT64_TOLERANCE.
LOST_STATE = 1e-3

TARGET = "tests.workers_fsdp_checkpoint:checkpoint_cases"

# (impl, world size) -> (phases, launches that must have written their files first)
LAUNCHES = {
    ("dptc", 2): (["meta_full", "reset", "train_save", "resume_own", "resume_model_only",
                   "resume_full", "rollback"], []),
    ("torch", 2): (["meta_full", "reset", "train_save", "resume_own", "resume_full",
                    "rollback", "resume_dptc"], [("dptc", 2)]),
    ("dptc", 3): (["uninterrupted", "resume_dptc", "resume_torch", "resume_shard_last"],
                  [("dptc", 2), ("torch", 2)]),
    ("dptc", 1): (["uninterrupted", "resume_dptc", "resume_torch"], [("dptc", 2), ("torch", 2)]),
}

class _Launches:
    """The launches of one test module run, in the folder they share; each runs once."""

    def __init__(self, root):
        self.root = root
        self.outcomes = {}

    def get(self, impl, world_size):
        def launch():
            phases, needs = LAUNCHES[(impl, world_size)]
            for need in needs:
                try:
                    self.get(*need)
                except AssertionError:
                    pass    # its files are missing: the phases that read them say so
            return run_ranks(TARGET, world_size, args={"impl": impl, "root": str(self.root),
                                                       "phases": phases},
                             timeout=LAUNCH_TIMEOUT_S, reference=impl == "torch")
        return once(self.outcomes, (impl, world_size), launch,
                    f"the {impl} launch at {world_size} ranks")

    def phase(self, impl, world_size, name):
        """The phase's result on every rank; fails with the rank's traceback if it raised."""
        per_rank = [ranks[name] for ranks in self.get(impl, world_size)]
        for rank, result in enumerate(per_rank):
            assert result["ok"], f"{impl} at {world_size} ranks, phase {name}, rank {rank}:\n" \
                                 f"{result['error']}"
        return per_rank

    def load(self, name):
        return torch.load(self.root / name)


@pytest.fixture(scope="module")
def launches():
    root = Path(tempfile.mkdtemp(prefix="dptc-ckpt-"))
    try:
        yield _Launches(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check_resumed(result, tolerance, rank):
    """A resume's numbers on one rank: the loaded state is the checkpoint's, bit for bit (rank
    0 measures it against the full state dicts the saving run wrote); the continued run matches
    the uninterrupted one of the same launch within `tolerance`."""
    assert result["ok"], result["error"]
    if rank == 0:
        assert result["loaded_model_diff"] == 0.0, result
        assert result["loaded_optim_diff"] == 0.0, result
        assert result["loaded_optim_keys"], result
    assert result["tied"], "tok_emb.weight and head.weight are no longer one parameter"
    assert result["loss_diff"] <= tolerance, result
    assert result["param_rel"] <= tolerance, result


IMPLS = ["dptc", "torch"]


# ---------------------------------------------------------------------------------------------
# 1. Meta-device initialisation

def test_plain_to_empty_unties_weights():
    """No process group.  On a plain module, to_empty gives each of tok_emb and head its own new
    parameter: the tie is lost (the fully_shard tests below show it is kept there)."""
    with torch.device("meta"):
        model = build_gpt(vocab=64, d_model=32, n_layer=2, n_head=4, ctx=16, bias=False)
    assert model.tok_emb.weight is model.head.weight
    model.to_empty(device="cpu")
    assert model.tok_emb.weight is not model.head.weight


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", ["broadcast", "every_rank", "no_to_empty"])
def test_meta_init_full_state_dict(launches, impl, variant):
    """GPT built on the meta device, fully_shard on the blocks and the root, to_empty("cpu"),
    then set_model_state_dict with a full state dict: from rank 0 (broadcast_from_rank0), from
    every rank (full_state_dict), or into the still-meta model (torch assigns, the first forward
    adopts).  The full parameters equal the eager model's bit for bit, each rank's local piece
    is torch.chunk's, and the tied tok_emb/head weight stays one parameter: fully_shard's
    to_empty re-registers a shared parameter at each of its places, in torch's fully_shard and
    in dptc's, so the GPT keeps tie_weights=True and needs no re-tying."""
    results = [r[variant] for r in launches.phase(impl, 2, "meta_full")]
    for rank, result in enumerate(results):
        assert result["full_diff"] == 0.0, (rank, result)
        assert result["local_diff"] == 0.0, (rank, result)
        assert result["tied_after_to_empty"] and result["tied_after_load"], (rank, result)
        assert result["is_dtensor"] and result["devices"] == ["cpu"], (rank, result)
        # torch.chunk rows of dim 0 over 2 ranks: tok_emb 64 -> 32, qkv 96 -> 48, ...
        assert result["local_rows"]["tok_emb.weight"] == 32
        assert result["local_rows"]["blocks.0.attn.qkv.weight"] == 48
    if impl == "dptc":
        theirs = [r[variant] for r in launches.phase("torch", 2, "meta_full")]
        assert [r["local_rows"] for r in results] == [r["local_rows"] for r in theirs]


def test_meta_init_reset_parameters(launches):
    """Meta init, to_empty, then nn.Linear/Embedding/LayerNorm.reset_parameters() on every
    module under one seed.  DTensor's random ops on a CPU mesh draw each rank's piece from the
    rank's own generator (torch warns "may not have complete support on cpu device mesh"), so
    the random weights cannot equal an eager model's draw, in torch's fully_shard as in dptc's;
    so: dptc's values equal torch fully_shard's bit for bit, the deterministic LayerNorm weights
    equal the eager model's (ones), and 2 training steps from the re-initialised shards match
    an eager model loaded with the same full values (measured 7e-14), which shows the values
    reset_parameters wrote are the ones forward gathers."""
    mine = launches.load("reset_dptc_ws2.pt")
    theirs = launches.load("reset_torch_ws2.pt")
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
        if "ln" in name:
            assert torch.equal(mine[name], torch.ones_like(mine[name])), name
        else:
            assert mine[name].std().item() > 1e-3, name    # re-initialised, not left at zero
    for impl in IMPLS:
        for result in launches.phase(impl, 2, "reset"):
            assert result["trained_rel"] <= FLOAT64_TOLERANCE, (impl, result)
            assert result["tied"]
    dptc = launches.phase("dptc", 2, "reset")
    torch_ = launches.phase("torch", 2, "reset")
    for a, b in zip(dptc, torch_):
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= FLOAT64_TOLERANCE
    # The two ranks' losses are means over halves of the batch; their mean is the eager loss.
    for step in range(2):
        mean = sum(r["losses"][step] for r in dptc) / len(dptc)
        assert math.isclose(mean, dptc[0]["eager_losses"][step], rel_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# 2. DCP save at 2 ranks, load at 2, 3 and 1

@pytest.mark.parametrize("impl", IMPLS)
def test_uninterrupted_run_matches_single_process(launches, impl):
    """The run the resumed runs are compared with is itself right: K + M steps at 2 ranks
    equal a single-process model trained on the global batches (measured 3e-13)."""
    for result in launches.phase(impl, 2, "train_save"):
        assert result["ref_rel"] <= FLOAT64_TOLERANCE, result
        assert len(result["losses"]) == STEPS_BEFORE + STEPS_AFTER


@pytest.mark.parametrize("impl", IMPLS)
def test_dcp_resume_same_world_size(launches, impl):
    """dcp.save of {"model": get_model_state_dict, "optim": get_optimizer_state_dict} after
    K=3 AdamW steps at 2 ranks; a fresh meta-initialised model and a fresh AdamW at 2 ranks
    load it (dcp.load, set_model_state_dict, set_optimizer_state_dict) and train M=2 steps:
    the same computation as the uninterrupted run, so losses and parameters are bit-identical
    (measured 0.0)."""
    for rank, result in enumerate(launches.phase(impl, 2, "resume_own")):
        resumed = result[f"{impl}_sync"]
        _check_resumed(resumed, 0.0, rank)
        assert resumed["param_abs"] == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_dcp_load_into_trained_model(launches, impl):
    """Rolling back: step K's checkpoint loads into the model that went on training (forward
    has run, AdamW holds step K + M's state) and the M steps repeat bit for bit."""
    for rank, result in enumerate(launches.phase(impl, 2, "rollback")):
        _check_resumed(result, 0.0, rank)
        assert result["param_abs"] == 0.0


def test_checkpoint_files_match_torchs(launches):
    """dptc's shards are views into one flat buffer per unit; DCP writes only their own bytes:
    the 2-rank checkpoint's data files have the sizes of torch's fully_shard's, byte for byte
    (measured 408286 and 447457 bytes: parameters and two AdamW moments in float64)."""
    launches.get("torch", 2)

    def sizes(name):
        folder = launches.root / name
        return sorted((path.name, path.stat().st_size) for path in folder.glob("*.distcp"))

    assert sizes("dptc_sync") == sizes("torch_sync") != []


def test_adamw_state_is_needed(launches):
    """The comparisons can see a lost state: loading the model but not AdamW's moments and
    step counts, the continued run is off by ~0.5 relative (measured 0.48; loss 2e-2)."""
    for rank, result in enumerate(launches.phase("dptc", 2, "resume_model_only")):
        if rank == 0:
            assert result["loaded_model_diff"] == 0.0, result
            assert result["loaded_optim_diff"] > 0.0, result    # a fresh AdamW: step 1, not 3
        assert result["param_rel"] > LOST_STATE, result
        assert result["loss_diff"] > LOST_STATE / 10, result


@pytest.mark.parametrize("world_size", [3, 1])
def test_dcp_resume_other_world_size(launches, world_size):
    """dptc's 2-rank checkpoint loads into dptc at 3 ranks (uneven pieces: 64 rows -> 22, 22,
    20) and at 1 rank: the loaded full state equals the saved one bit for bit, and M more steps
    match an uninterrupted K + M step run at that world size within FLOAT64_TOLERANCE
    (measured: see the module docstring), and the 2-rank run's final parameters too."""
    final_ws2 = launches.load("dptc_ws2_final.pt")
    for rank, result in enumerate(launches.phase("dptc", world_size, "resume_dptc")):
        _check_resumed(result["dptc_sync"], FLOAT64_TOLERANCE, rank)
    resumed = launches.load(f"dptc_ws{world_size}_from_dptc_sync.pt")
    uninterrupted = launches.load(f"dptc_ws{world_size}_final.pt")
    assert max_rel(resumed, uninterrupted) <= FLOAT64_TOLERANCE
    assert max_rel(resumed, final_ws2) <= FLOAT64_TOLERANCE
    assert max_rel(uninterrupted, final_ws2) <= FLOAT64_TOLERANCE


def test_dcp_resume_into_other_placements(launches):
    """dptc's 2-rank checkpoint (Shard(0) everywhere) loads at 3 ranks into a model whose
    matrices shard_placement_fn puts on their last dim (32 columns -> 11, 11, 10): the loaded
    state is the saved one bit for bit, and M more steps match the uninterrupted Shard(0) run
    at 3 ranks within FLOAT64_TOLERANCE."""
    for rank, result in enumerate(launches.phase("dptc", 3, "resume_shard_last")):
        _check_resumed(result, FLOAT64_TOLERANCE, rank)
    resumed = launches.load("dptc_ws3_from_dptc_shard_last.pt")
    assert max_rel(resumed, launches.load("dptc_ws3_final.pt")) <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("impl", ["dptc", "torch"])
def test_dcp_async_save(launches, impl):
    """dcp.async_save (its own gloo group for the upload thread) at step K, with step K+1
    running while the upload is in flight; after waiting on the future, the checkpoint holds
    step K's state: resumed at 2 ranks it is bit-identical to the uninterrupted run, and
    dptc's loads at 3 and 1 ranks as the synchronous one does.  (dptc's shards are pieces of
    one buffer per unit; each is wrapped in a tensor whose storage starts at it, since the
    async stager copies a tensor's storage by its data pointer.)"""
    for result in launches.phase(impl, 2, "train_save"):
        assert result["async_ok"], result.get("async_error", "")
    for rank, result in enumerate(launches.phase(impl, 2, "resume_own")):
        _check_resumed(result[f"{impl}_async"], 0.0, rank)
    if impl == "dptc":
        for world_size in (3, 1):
            for rank, result in enumerate(launches.phase("dptc", world_size, "resume_dptc")):
                _check_resumed(result["dptc_async"], FLOAT64_TOLERANCE, rank)


# ---------------------------------------------------------------------------------------------
# 3. Full state dicts

@pytest.mark.parametrize("impl", IMPLS)
def test_full_state_dict_rank0_cpu_offload(launches, impl):
    """get_model_state_dict / get_optimizer_state_dict with full_state_dict=True and
    cpu_offload=True after K steps: rank 0 gets every key as a plain CPU tensor equal to the
    single-process reference model and AdamW state (measured 3e-13 and 8e-14), rank 1 gets
    empty dicts (torch's semantics, ranks_only=(0,)).  Without cpu_offload every rank gets the
    full tensors.  dptc's ranks get what torch's fully_shard's ranks get."""
    results = launches.phase(impl, 2, "train_save")
    rank0 = results[0]["rank0_only"]
    assert rank0["model_keys"] == 16 and rank0["optim_keys"] == 2, rank0
    assert rank0["model_types"] == ["Tensor"] and rank0["model_devices"] == ["cpu"], rank0
    assert rank0["optim_types"] == ["Tensor"] and rank0["optim_key_match"], rank0
    assert rank0["model_rel"] <= FLOAT64_TOLERANCE and rank0["optim_rel"] <= FLOAT64_TOLERANCE
    assert rank0["param_groups"][0]["lr"] == 1e-2
    assert rank0["param_groups"][0]["weight_decay"] == 0.1
    for result in results[1:]:
        assert result["rank0_only"]["model_keys"] == 0, result["rank0_only"]
        assert result["rank0_only"]["optim_keys"] == 0, result["rank0_only"]
    for result in results:
        every = result["every_rank"]
        assert every["model_keys"] == 16 and every["model_types"] == ["Tensor"], every
        assert every["model_key_match"], every
        assert every["model_rel"] <= FLOAT64_TOLERANCE, every
        assert every["optim_rel"] <= FLOAT64_TOLERANCE, every
        sharded = result["sharded"]
        assert sharded["model_types"] == ["DTensor"], sharded
        assert sharded["optim_types"] == ["DTensor", "Tensor"], sharded   # step is plain
        assert sharded["local_diff"] <= FLOAT64_TOLERANCE, sharded
    if impl == "dptc":
        theirs = launches.phase("torch", 2, "train_save")
        for mine, other in zip(results, theirs):
            for key in ("model_keys", "optim_keys", "model_types", "optim_types"):
                assert mine["rank0_only"][key] == other["rank0_only"][key], key


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", ["broadcast", "every_rank"])
def test_full_state_dict_resume(launches, impl, variant):
    """The full model and optimizer state dicts of step K go back into a fresh meta-initialised
    model and AdamW with set_model_state_dict / set_optimizer_state_dict (full_state_dict=True;
    "broadcast": only rank 0 passes them, broadcast_from_rank0=True): M more steps are
    bit-identical to the uninterrupted run (measured 0.0)."""
    for rank, result in enumerate(launches.phase(impl, 2, "resume_full")):
        resumed = result[variant]
        _check_resumed(dict(resumed, ok=True), 0.0, rank)
        assert resumed["param_abs"] == 0.0


# ---------------------------------------------------------------------------------------------
# 4. Checkpoints exchanged with torch's fully_shard

@pytest.mark.parametrize("world_size", [3, 1])
def test_torch_checkpoint_loads_into_dptc(launches, world_size):
    """A DCP checkpoint written by torch's fully_shard at 2 ranks (gloo) after K steps loads
    into dptc's fully_shard at 3 and 1 ranks: the loaded state is torch's bit for bit, and M
    more steps match dptc's uninterrupted run at that world size and torch's own uninterrupted
    2-rank run within FLOAT64_TOLERANCE."""
    for rank, result in enumerate(launches.phase("dptc", world_size, "resume_torch")):
        _check_resumed(result["torch_sync"], FLOAT64_TOLERANCE, rank)
    resumed = launches.load(f"dptc_ws{world_size}_from_torch_sync.pt")
    assert max_rel(resumed, launches.load("torch_ws2_final.pt")) <= FLOAT64_TOLERANCE
    assert max_rel(resumed, launches.load(f"dptc_ws{world_size}_final.pt")) \
        <= FLOAT64_TOLERANCE


def test_dptc_checkpoint_loads_into_torch(launches):
    """dptc's 2-rank DCP checkpoint loads into torch's fully_shard at 2 ranks: the loaded state
    is dptc's bit for bit, and M more steps match torch's uninterrupted run and dptc's
    (measured 0.0: at 2 ranks the two fully_shards compute the same bits)."""
    for rank, result in enumerate(launches.phase("torch", 2, "resume_dptc")):
        _check_resumed(result["dptc_sync"], FLOAT64_TOLERANCE, rank)
    resumed = launches.load("torch_ws2_from_dptc_sync.pt")
    assert max_rel(resumed, launches.load("dptc_ws2_final.pt")) <= FLOAT64_TOLERANCE
    assert max_rel(resumed, launches.load("torch_ws2_final.pt")) <= FLOAT64_TOLERANCE


def test_state_dict_after_eval_forward_is_sharded():
    """After an evaluation forward under no_grad the root stays unsharded; state_dict() and
    get_model_state_dict() still give DTensor shards, and load_state_dict() (of the state
    before it, halved) takes effect: 2 more steps give torch's losses and parameters (bit for
    bit at 2 ranks; before the fix dptc gave the root's plain unsharded tensors, and the load
    into them was lost at the next gather)."""
    results = {impl: run_ranks("tests.workers_fsdp_checkpoint:state_dict_after_eval_case", 2,
                               args={"impl": impl}, timeout=LAUNCH_TIMEOUT_S,
                               reference=impl == "torch")
               for impl in IMPLS}
    for mine, torchs in zip(results["dptc"], results["torch"]):
        for result in (mine, torchs):
            assert result["state_dict_types"] == ["DTensor"], result["state_dict_types"]
            assert result["get_model_state_dict_types"] == ["DTensor"], result
        assert mine["losses"] == torchs["losses"], (mine["losses"], torchs["losses"])
        for name, values in torchs["params"].items():
            scale = max(abs(v) for v in values)
            assert max(abs(a - b) for a, b in zip(mine["params"][name], values)) <= \
                FLOAT64_TOLERANCE * scale, name
