"""Copies of sharded models as users make them (an EMA, a "best model"), and what copying the
wrapped model itself raises: fully_shard and FullyShardedDataParallel against torch's on gloo.

Layer: several ranks (2).  Rank-side code is in tests/workers_fsdp_copies.py.  torch 2.13
refuses copy.deepcopy and torch.save of a sharded model (fully_shard: AssertionError and
PicklingError; FSDP1: TypeError for both); dptc raises the same types with messages naming
the remedy (see [Note: copies of a sharded module] in dptc/fsdp/_fully_shard.py), and the
remedies they name, a copy taken before sharding and a second model loaded from the state
dict, train to torch's numbers and the single process's.
"""

import functools

import pytest
import torch

from tests._launch import run_ranks
from tests._compare import max_rel

LAUNCH_TIMEOUT_S = 240
# float64 GPT, 2 ranks: the ranks sum gradients in another order than the single process.
REF_TOLERANCE = 1e-12


@functools.lru_cache(maxsize=None)
def _runs(kind):
    mine = run_ranks("tests.workers_fsdp_copies:copies_case", 2,
                     args={"impl": "dptc", "kind": kind}, timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp_copies:copies_case", 2,
                       args={"impl": "torch", "kind": kind}, timeout=LAUNCH_TIMEOUT_S,
                       reference=True)
    return mine, theirs


REMEDIES = {
    "fully_shard": ("copy.deepcopy(model) before sharding", "AveragedModel(model) before",
                    "second.load_state_dict(model.state_dict())",
                    "get_model_state_dict", "torch.distributed.checkpoint"),
    "fsdp1": ("copy.deepcopy(module), then FullyShardedDataParallel(ema", "AveragedModel(module)",
              "second.load_state_dict(model.state_dict())",
              "StateDictType.FULL_STATE_DICT", "torch.distributed.checkpoint"),
}


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp1"])
def test_copying_raises_torchs_types_naming_the_remedy(kind):
    """copy.deepcopy, torch.save and AveragedModel (which deep-copies) of the sharded model,
    before the first forward and after two steps (and for fully_shard on the root alone
    without resharding after forward): dptc raises the type torch raises each time, its
    message naming the remedy."""
    mine, theirs = _runs(kind)
    deepcopy_remedy, averaged_remedy, load_remedy, save_remedy, dcp_remedy = REMEDIES[kind]
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert result["raised"].keys() == reference["raised"].keys(), rank
        for when, raised in result["raised"].items():
            for how, got, torchs in zip(("deepcopy", "save", "averaged"), raised,
                                        reference["raised"][when]):
                assert torchs is not None, (rank, when, how)
                assert got[0] == torchs[0], (rank, when, how, got, torchs)
            copied, saved, averaged = raised
            assert averaged == copied, (rank, when)
            assert all(remedy in copied[1]
                       for remedy in (deepcopy_remedy, averaged_remedy, load_remedy)), copied[1]
            assert save_remedy in saved[1] and dcp_remedy in saved[1], saved[1]
        expected = {"fully_shard": ("AssertionError", "PicklingError"),
                    "fsdp1": ("TypeError", "TypeError")}[kind]
        assert tuple(t for t, _ in result["raised"]["trained"][:2]) == expected


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp1"])
def test_remedies_train_as_torchs(kind):
    """The copies the messages name: an EMA (torch's AveragedModel) made before sharding,
    its module sharded the same way and updated with update_parameters (lerp_ over the
    DTensor parameters), and a "best model" built, sharded and loaded from the
    trained model's state_dict(), then trained beside it for 3 steps.  Each holds shards of
    its own (no storage shared with the model), trains to the single process's numbers, the
    best copy to the model's bit for bit, and every parameter equals torch's run of the same
    script to the bit."""
    mine, theirs = _runs(kind)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert result["dtensors"] == [result["param_count"]] * 2, (rank, result["dtensors"])
        assert result["shared"] == [0, 0] == reference["shared"], (rank, result["shared"])
        assert result["loaded_rel"] == 0.0, rank
        assert result["best_model_rel"] == 0.0, rank
        for name in ("model_ref_rel", "best_ref_rel", "ema_ref_rel"):
            assert result[name] < REF_TOLERANCE, (rank, name, result[name])
        assert abs(result["ema_loss"] - result["ref_ema_loss"]) < 1e-12, rank
        assert result["ema_loss"] == reference["ema_loss"], rank
        for name in ("model", "best", "ema"):
            assert max_rel(result["params"][name], reference["params"][name]) == 0.0, \
                (rank, name)
