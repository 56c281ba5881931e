"""FullyShardedDataParallel (FSDP1's API) on dptc's fully_shard core.

Layer: several ranks; rank-side code in tests/workers_fsdp1.py.  One launch per (impl, world
size) trains every sharding strategy against single-process training (float64 GPT,
transformer_auto_wrap_policy, no_sync accumulation, the wrapper's clip_grad_norm_, AdamW);
torch's own FullyShardedDataParallel (gloo, device_id="cpu") runs the same code as a check
of the test and as the reference for the bf16 MixedPrecision.  One more dptc launch covers
summon_full_params and the state dicts.
"""

import pytest
import torch

from tests._compare import max_rel
from tests._launch import once, run_ranks
from tests.test_fsdp import two_node_rels

LAUNCH_TIMEOUT_S = 240
FLOAT64_TOLERANCE = 1e-10
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
              "_HYBRID_SHARD_ZERO2"]
PLAN = {
    ("dptc", 2, 1): (STRATEGIES, ["FULL_SHARD"]),
    ("dptc", 3, 1): (["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], []),
    ("dptc", 4, 2): (["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"], []),
    ("torch", 2, 1): (["FULL_SHARD", "NO_SHARD"], ["FULL_SHARD"]),
}
_launches = {}


def _once(key, launch):
    return once(_launches, key, launch)


def _results(impl, world_size, nnodes):
    strategies, mp = PLAN[(impl, world_size, nnodes)]
    return _once((impl, world_size, nnodes), lambda: run_ranks(
        "tests.workers_fsdp1:strategy_cases", world_size,
        args={"impl": impl, "strategies": strategies, "mp_strategies": mp,
              "low_precision_grads": world_size == 2 and nnodes == 1},
        nnodes=nnodes, timeout=LAUNCH_TIMEOUT_S, reference=impl == "torch"))


def _nested_cases():
    """nested_clip_case's results under dptc and under torch, launched once for both tests
    of a nested instance."""
    return _once("nested", lambda: [
        run_ranks("tests.workers_fsdp1:nested_clip_case", 2, args={"impl": impl},
                  timeout=LAUNCH_TIMEOUT_S, reference=impl == "torch")
        for impl in ("dptc", "torch")])


CASES = [(impl, ws, nodes, s) for (impl, ws, nodes), (strategies, _) in PLAN.items()
         for s in strategies]


@pytest.mark.parametrize("impl,world_size,nnodes,strategy", CASES,
                         ids=[f"{i}-ws{w}-n{n}-{s}" for i, w, n, s in CASES])
def test_strategy_matches_single_process(impl, world_size, nnodes, strategy):
    """Every strategy (HYBRID across 2 simulated nodes too): parameters and the clipped norm
    as the reference's (dptc in float64: summation order only; torch's runs in float32, whose
    clip_grad_norm_ refuses float64, within 1e-5), parameter names and state-dict keys the
    original module's, one instance per block plus the root."""
    tolerance, norm_tolerance = (FLOAT64_TOLERANCE, 1e-9) if impl == "dptc" else (1e-5, 1e-4)
    for rank, ranks in enumerate(_results(impl, world_size, nnodes)):
        result = ranks[strategy]
        assert result["ok"], f"rank {rank}:\n{result.get('error')}"
        assert result["ref_rel"] <= tolerance, (rank, result["ref_rel"])
        assert result["norm_diff"] <= norm_tolerance, (rank, result["norm_diff"])
        # Names as torch's show them: prefixed, the original ones inside summon_full_params.
        assert [n.replace("_fsdp_wrapped_module.", "") for n in result["names"]] == \
            result["ref_names"] != result["names"]
        assert result["summoned_names"] == result["ref_names"]
        assert not any("_fsdp_wrapped_module" in k for k in result["keys"])
        assert result["instances"] == 3
        if (impl, world_size, strategy) == ("dptc", 2, "FULL_SHARD"):
            theirs = _results("torch", 2, 1)[0][strategy]
            assert result["names"] == theirs["names"] and result["keys"] == theirs["keys"]


def test_bf16_mixed_precision_matches_torch():
    """MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32), FULL_SHARD, 2 ranks: the
    trained parameters equal torch's FullyShardedDataParallel's within 1e-6 (the same bf16
    casts and compute; 2-rank float32 sums are exact either way)."""
    mine = _results("dptc", 2, 1)[0]["FULL_SHARD+bf16"]
    theirs = _results("torch", 2, 1)[0]["FULL_SHARD+bf16"]
    assert mine["ok"] and theirs["ok"], (mine.get("error"), theirs.get("error"))
    worst = max_rel(mine["params"], theirs["params"])
    assert worst <= 1e-6, worst


def test_keep_low_precision_grads_as_torch():
    """MixedPrecision(bf16, float32 reduce, keep_low_precision_grads=True), FULL_SHARD, 2
    ranks, untied GPT: after each backward every gradient is bfloat16, as under torch's FSDP1,
    and equal to torch's; the second step, whose backward accumulates into the kept
    gradients (no zero_grad before it), too; SGD then trains both to the same parameters.
    dptc's gradients come from summon_full_params(with_grads=True), in bfloat16 (torch's
    fails under keep_low_precision_grads: the worker assembles its from the shards).  Beyond
    torch, whose FSDP1 fails there too: the tied GPT's first gradients are bfloat16, and equal
    torch's float32 ones (kept in float32 by its run) rounded to bfloat16."""
    for mine, theirs in zip(_results("dptc", 2, 1), _results("torch", 2, 1)):
        for run in ("low_precision_grads", "low_precision_grads_tied"):
            assert mine[run]["ok"] and theirs[run]["ok"], \
                (mine[run].get("error"), theirs[run].get("error"))
        untied, untied_torch = mine["low_precision_grads"], theirs["low_precision_grads"]
        for step, (a, b) in enumerate(zip(untied["steps"], untied_torch["steps"])):
            assert a["dtypes"] == b["dtypes"] == ["torch.bfloat16"], (step, a["dtypes"])
            assert max_rel(a["grads"], b["grads"]) <= 1e-6, step
        assert max_rel(untied["params"], untied_torch["params"]) <= 1e-6
        tied, tied_torch = (r["low_precision_grads_tied"]["steps"][0] for r in (mine, theirs))
        assert tied["dtypes"] == ["torch.bfloat16"] and tied_torch["dtypes"] == ["torch.float32"]
        rounded = [torch.tensor(g).float().bfloat16().double().tolist()
                   for g in tied_torch["grads"]]
        assert max_rel(tied["grads"], rounded) == 0.0


def test_summon_full_params_and_state_dicts():
    """summon_full_params gives the reference's full parameters and writes changes back;
    FULL_STATE_DICT with offload_to_cpu and rank0_only gives rank 0 the reference's plain
    tensors under the original keys and the other ranks nothing; SHARDED_STATE_DICT gives
    DTensors; both, with optim_state_dict / optim_state_dict_to_load, resume training into a
    fresh model exactly as the uninterrupted run continues (measured: bit-identical).  The
    optimizer state is keyed by the original parameter names."""
    results = run_ranks("tests.workers_fsdp1:state_cases", 2, timeout=LAUNCH_TIMEOUT_S)
    for rank, result in enumerate(results):
        assert result["summon_rel"] <= FLOAT64_TOLERANCE, result
        assert result["writeback_rel"] <= FLOAT64_TOLERANCE, result
        assert result["full_plain"]
        if rank == 0:
            assert result["full_keys_equal"] and result["full_rel"] <= FLOAT64_TOLERANCE
        else:
            assert result["full_keys"] == 0, result
        assert result["sharded_types"] == ["DTensor"] and result["sharded_keys_equal"]
        assert result["optim_keys_equal"], "optimizer state keyed by the original names"
        assert result["resumed_full_rel"] <= FLOAT64_TOLERANCE, result
        assert result["resumed_sharded_rel"] <= FLOAT64_TOLERANCE, result


def test_legacy_optimizer_state_dict_api():
    """full_optim_state_dict, sharded_optim_state_dict, shard_full_/scatter_full_/
    flatten_sharded_optim_state_dict, rekey_optim_state_dict and get_state_dict_type, against
    torch's FSDP1 (float32, 2 ranks): the same deprecation warnings, keys, ID mapping and
    settings; the full state is the single-process run's AdamW state (within 1e-5), and each
    way back into a fresh model resumes training exactly as the uninterrupted run continues.
    torch 2.13 itself fails the last two (measured: its full_optim_state_dict's exp_avg 1.0
    from the single-process run's, relative, and its shard_full_optim_state_dict resumes 2e-2
    off; only its flatten_sharded path resumes exactly), so those are checked on dptc alone."""
    torch_results = run_ranks("tests.workers_fsdp1:legacy_optim_case", 2,
                              args={"impl": "torch"}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    dptc_results = run_ranks("tests.workers_fsdp1:legacy_optim_case", 2,
                             args={"impl": "dptc"}, timeout=LAUNCH_TIMEOUT_S)
    for rank, (want, got) in enumerate(zip(torch_results, dptc_results)):
        for key in ("warnings", "rank0_only_keys", "full_groups", "id_keys",
                    "rekey_round_trip", "settings"):
            assert got[key] == want[key], (rank, key, got[key], want[key])
        assert sorted(got["full_state"]) == sorted(want["full_state"]), rank
        assert bool(got["rank0_only_keys"]) == (rank == 0), rank
        assert got["rekey_round_trip"] and got["id_keys"] == list(range(len(got["full_state"])))
        assert got["full_vs_reference"] <= 1e-5, (rank, got["full_vs_reference"])
        assert all(rel <= 1e-12 for rel in got["resumed_rel"].values()), (rank, got)
        assert want["resumed_rel"]["flatten_sharded"] <= 1e-12, (rank, want)


def test_dcp_checkpoint_as_torchs_tutorial(tmp_path):
    """dcp.save and dcp.load of SHARDED_STATE_DICT model state and FSDP.optim_state_dict, as
    torch's FSDP1 tutorial writes them (float32, 2 ranks): the same model keys as torch's; a
    fresh model loaded from its own checkpoint, and dptc's loaded from torch's, resume one
    step to the parameters of the run that went on (within 1e-6 of torch's for the latter;
    measured: bit for bit).  torch 2.13's own FSDP1 does not resume exactly from its own
    checkpoint here (measured 4.9e-2 off, relative), so that is checked on dptc alone.  Then
    torch.distributed.checkpoint.state_dict's get_state_dict: the model's and the optimizer's
    keys are torch's (no _fsdp_wrapped_module.), its tensors are shards as torch's are (a rank
    holds half of each state), and set_state_dict of its saved state into a fresh model
    resumes exactly; so do full_state_dict=True (torch's values on every rank) and
    cpu_offload=True (rank 0 alone) into broadcast_from_rank0=True."""
    torch_results = run_ranks("tests.workers_fsdp1:dcp_case", 2, timeout=LAUNCH_TIMEOUT_S,
                              args={"impl": "torch", "path": str(tmp_path)}, reference=True)
    dptc_results = run_ranks("tests.workers_fsdp1:dcp_case", 2, timeout=LAUNCH_TIMEOUT_S,
                             args={"impl": "dptc", "path": str(tmp_path)})
    for rank, (want, got) in enumerate(zip(torch_results, dptc_results)):
        assert got["keys"] == want["keys"], (rank, got["keys"], want["keys"])
        assert max_rel(got["from_own"], got["continued"]) == 0.0, rank
        assert max_rel(got["continued"], want["continued"]) <= 1e-6, rank
        assert max_rel(got["from_torch"], want["continued"]) <= 1e-6, rank
        # torch.distributed.checkpoint.state_dict's helpers: torch's names, and a resume.
        assert got["dsd_model_keys"] == want["dsd_model_keys"], rank
        assert got["dsd_optim_keys"] == want["dsd_optim_keys"], rank
        assert not any("_fsdp_wrapped_module" in key for key in got["dsd_optim_keys"]), rank
        assert max_rel(got["from_own_dsd"], got["continued"]) == 0.0, rank
        # By default the helpers give shards, as torch's FSDP1 does: every tensor of either
        # state is one, and a rank holds half of the elements (torch.chunk halves every dim 0
        # of this model).
        for part in ("model", "optim"):
            held, full, shards = got["dsd_held"][part]
            assert want["dsd_held"][part][1:] == [full, shards], (rank, part, got, want)
            assert held == full // 2, (rank, part, held, full)
            assert got["dsd_full_held"][part] == [full, full, 0], (rank, part)
        count = len(got["dsd_model_keys"])
        assert got["dsd_held"]["model"][2] == count, (rank, got["dsd_held"])
        # full_state_dict=True: the full tensors on every rank, torch's values.
        assert sorted(got["dsd_full"]) == sorted(want["dsd_full"]), rank
        assert max_rel(list(got["dsd_full"].values()),
                    [want["dsd_full"][key] for key in got["dsd_full"]]) <= 1e-6, rank
        # With cpu_offload=True rank 0 alone holds them.
        assert got["dsd_rank0_held"] == (got["dsd_full_held"] if rank == 0 else
                                         {"model": [0, 0, 0], "optim": [0, 0, 0]}), rank
        assert max_rel(got["from_full_dsd"], got["continued"]) == 0.0, rank
        assert max_rel(got["from_rank0_dsd"], got["continued"]) == 0.0, rank


def test_hybrid_shard_two_torchrun_nodes():
    """HYBRID_SHARD under two torchrun --nnodes=2 invocations of 2 ranks: FullyShardedDataParallel
    finds the node layout (shard within a node, replicate across) and trains to the reference."""
    rels = two_node_rels("--fsdp1")
    assert all(rel <= FLOAT64_TOLERANCE for rel in rels), rels


def test_construction_options_and_checkpointing():
    """sync_module_states makes rank 1 start from rank 0's weights; param_init_fn runs once
    per module left on the meta device, and under NO_SHARD the parameters forward sees are the
    shard buffers themselves and the gradients are reduced where autograd left them;
    ignored_modules stay whole; activation checkpointing
    applied after wrapping keeps the numbers and the state-dict keys: each trained against the
    single-process reference (float64)."""
    for result in run_ranks("tests.workers_fsdp1:extras_case", 2, timeout=LAUNCH_TIMEOUT_S):
        assert result["sync_rel"] <= FLOAT64_TOLERANCE, result
        assert result["init_all"] and result["init_modules"] > 0, result
        # NO_SHARD: every parameter in forward is its shard's memory, no gathered copy.
        assert result["no_shard_params"] > 0, result
        assert result["no_shard_in_place"] == result["no_shard_params"], result
        # ... and its gradients are reduced in place, each the one autograd made.
        assert result["no_shard_grads"] == result["no_shard_params"], result
        assert result["no_shard_grad_storages"] == result["no_shard_grads"], result
        assert result["no_shard_rel"] <= FLOAT64_TOLERANCE, result
        assert result["ignored_plain"] and result["ignored_rel"] <= FLOAT64_TOLERANCE, result
        assert result["checkpointed"] == 2, result
        assert result["checkpoint_rel"] <= FLOAT64_TOLERANCE, result
        assert result["checkpoint_keys"], result


def test_process_group_subsets_and_pairs():
    """process_group as torch's FSDP1 takes it, 4 ranks: FULL_SHARD and NO_SHARD over the pair
    groups {0,1} and {2,3} (two models, each trained on its pair's data), and HYBRID_SHARD
    with process_group=(shard, replicate) = ({0,2}|{1,3}, {0,1}|{2,3}), over all four ranks'
    data: each equals its single-process reference, on the mesh the groups describe.  A
process_group that does not fit the strategy is a ValueError, as torch's."""
    results = run_ranks("tests.workers_fsdp1:groups_case", 4, timeout=LAUNCH_TIMEOUT_S)
    for rank, result in enumerate(results):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        for strategy in ("FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"):
            case = result[strategy]
            assert case["rel"] <= FLOAT64_TOLERANCE, (rank, strategy, case)
            assert case["rows"] == 64, case
        assert result["FULL_SHARD"]["mesh"] == pair
        assert result["FULL_SHARD"]["local_rows"] == 32
        assert result["NO_SHARD"]["mesh"] == [[r] for r in pair]
        assert result["NO_SHARD"]["local_rows"] == 64
        assert result["HYBRID_SHARD"]["mesh"] == [[0, 2], [1, 3]]
        assert result["HYBRID_SHARD"]["local_rows"] == 32
        # Bad input, as torch refuses it (its types), naming what to pass instead.
        errors = result["errors"]
        assert errors["hybrid_one_group"][0] == "ValueError"
        assert "pair (shard group, replicate group)" in errors["hybrid_one_group"][1]
        assert errors["full_pair"][0] == "ValueError" and "takes one group" in \
            errors["full_pair"][1]
        assert errors["group_and_mesh"] == [
            "ValueError", "pass process_group or device_mesh to FullyShardedDataParallel, "
            "not both"]
        assert errors["prefetch"][0] == "TypeError" and "'BACKWARD_PRE'" in \
            errors["prefetch"][1]


def _expected_prefetch_log(forward_prefetch, backward):
    """One step of 2 micro-batches of a root and blocks 0 and 1 (the first under no_sync):
    where each gather starts, as torch's FSDP1 places it for these options."""
    forward = (["gather root", "gather blocks.0", "gather blocks.1", "forward blocks.0",
                "forward blocks.1"] if forward_prefetch else
               ["gather root", "gather blocks.0", "forward blocks.0", "gather blocks.1",
                "forward blocks.1"])
    log = []
    for sync in (False, True):
        reduce1 = ["reduce blocks.1"] if sync else []
        log += forward + ["gather blocks.1"]
        if backward == "pre":
            log += ["gather blocks.0", "backward blocks.1"] + reduce1
        elif backward == "post":
            log += ["backward blocks.1", "gather blocks.0"] + reduce1
        else:
            log += ["backward blocks.1"] + reduce1 + ["gather blocks.0"]
        log += ["backward blocks.0"] + (["reduce blocks.0", "reduce root"] if sync else [])
    return log


def test_prefetch_options_place_the_gathers():
    """forward_prefetch and backward_prefetch decide where each unit's gather starts, logged
    against the blocks' forward and backward: forward_prefetch=True gathers block 1 before
    block 0 computes (default False: in block 1's own pre-forward); BACKWARD_PRE (default)
    gathers block 0 before block 1's backward computes, BACKWARD_POST after it and before
    block 1's reduce-scatter, None in block 0's own pre-backward.  The numbers are the
    reference's in every case."""
    cases = {"default": (False, "pre"), "forward": (True, "pre"), "post": (False, "post"),
             "none": (False, None)}
    for result in run_ranks("tests.workers_fsdp1:prefetch_case", 2, timeout=LAUNCH_TIMEOUT_S):
        for label, (forward_prefetch, backward) in cases.items():
            assert result[label]["rel"] <= FLOAT64_TOLERANCE, (label, result[label])
            assert result[label]["log"] == _expected_prefetch_log(forward_prefetch, backward), \
                (label, result[label]["log"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only torch")
def test_cuda_device_id_without_cuda_is_a_clear_error():
    """device_id naming a CUDA device on a torch that sees none: ValueError naming the argument
    and the remedy, before any group is needed."""
    from dptc import FullyShardedDataParallel
    with pytest.raises(ValueError, match=r"device_id=0 names a CUDA device, but this torch sees "
                                         r"none .*pass device_id=None or 'cpu'"):
        FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=0)


def test_register_comm_hook_as_torchs():
    """register_comm_hook, 2 ranks, float32, NO_SHARD and FULL_SHARD.  torch's default hooks
    (allreduce_hook, reduce_scatter_hook), which dptc runs on its engine, and the same behind
    a Python hook (over gloo) train to the single-process reference (1e-5) and to torch's
    FSDP1 parameters with the same hook; the Python hook sees the calls torch's FSDP1 makes
    (one per unit and synced backward, the unit's flat gradient and, sharded, its shard).
    fp16_compress_hook (torch 2.13's own fails on CPU, in a CUDA-only record_stream) equals
    its arithmetic written out as a Python hook over gloo, bit for bit, and is visibly not
    the float32 result.  Misuse raises what torch's raises."""
    mine = run_ranks("tests.workers_fsdp1:comm_hook_case", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:comm_hook_case", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        for strategy in ("NO_SHARD", "FULL_SHARD"):
            for name in ("default", "python", "fp16", "fp16_python"):
                case = result[f"{strategy}/{name}"]
                assert case["ok"], f"rank {rank} {strategy}/{name}:\n{case.get('error')}"
            for name in ("default", "python"):
                case, torch_case = result[f"{strategy}/{name}"], reference[f"{strategy}/{name}"]
                assert torch_case["ok"], torch_case.get("error")
                assert case["ref_rel"] <= 1e-5, (rank, strategy, name, case["ref_rel"])
                drift = max(abs(a - b) for p, q in zip(case["params"], torch_case["params"])
                            for a, b in zip(p, q))
                assert drift <= 1e-6, (rank, strategy, name, drift)
            calls = result[f"{strategy}/python"]["calls"]
            assert calls == reference[f"{strategy}/python"]["calls"], (rank, strategy)
            assert len(calls) == 3 * 2, calls       # 3 units, 2 synced backwards
            assert all((out is None) == (strategy == "NO_SHARD") for _, out in calls), calls
            fp16, written = result[f"{strategy}/fp16"], result[f"{strategy}/fp16_python"]
            assert fp16["params"] == written["params"], (rank, strategy)
            assert fp16["params"] != result[f"{strategy}/default"]["params"], (rank, strategy)
            assert 1e-4 < fp16["ref_rel"] < 0.1, (rank, strategy, fp16["ref_rel"])
        for misuse in ("not callable", "twice", "not root"):
            assert result["errors"][misuse] == reference["errors"][misuse], misuse
        kind, message = result["errors"]["hybrid"]
        assert kind == "AssertionError" and "hybrid" in message, result["errors"]["hybrid"]


def test_meta_model_initialised_in_torchs_order():
    """A meta-device GPT wrapped with a transformer auto wrap policy and no param_init_fn:
    each module is materialised and reset_parameters()'d in the order torch's FSDP1 does it
    (every block's modules, breadth-first, then the root's), so one seed gives torch's
    initial parameters exactly.  (In model.modules() order they were 5 off at most.)"""
    mine = run_ranks("tests.workers_fsdp1:meta_init_case", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:meta_init_case", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert list(result) == list(reference), (rank, list(result), list(reference))
        for name in result:
            assert result[name] == reference[name], (rank, name)


def test_state_dicts_are_snapshots_as_torchs():
    """State dicts kept in memory while training goes on (an in-process rollback): loading
    FULL and SHARDED model and optimizer state dicts back repeats the steps after them
    exactly, twice from the same dicts, as with torch's FSDP1, whose losses dptc's equal.
    (dptc's dicts held the live shards and AdamW's step counters, so training changed them
    and the rollback trained from the later state: 0.17 off under SHARDED.)"""
    mine = run_ranks("tests.workers_fsdp1:snapshot_case", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:snapshot_case", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert list(result) == list(reference) == ["FULL_STATE_DICT", "SHARDED_STATE_DICT"]
        for kind, (losses, rolled_back, again) in result.items():
            assert reference[kind][1] == reference[kind][2] == reference[kind][0], \
                (rank, kind, reference[kind])
            assert rolled_back == again == losses, (rank, kind, result[kind])
            assert max_rel({kind: losses}, {kind: reference[kind][0]}) <= 1e-6, \
                (rank, kind, losses, reference[kind][0])


def test_set_state_dict_type_as_torchs():
    """set_state_dict_type returns the settings before as StateDictSettings (torch's class,
    whose fields restore them), and refuses a config of the other state-dict type with
    torch's RuntimeError, naming the config it takes, and changing nothing.  (dptc returned
    a plain tuple and took any config.)"""
    mine = run_ranks("tests.workers_fsdp1:state_dict_settings_case", 2,
                     args={"impl": "dptc"}, timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:state_dict_settings_case", 2,
                       args={"impl": "torch"}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    for result, reference in zip(mine, theirs):
        assert list(result) == list(reference)
        for name, value in result.items():
            if name.endswith("Config"):
                assert value[0] == reference[name][0] == "RuntimeError", (name, value)
                wanted = "ShardedStateDictConfig" if name.startswith("SHARDED") else \
                    "FullStateDictConfig"
                assert wanted in value[1], (name, value)
            else:
                assert value == reference[name], (name, value, reference[name])
        assert result["returns"] == "StateDictSettings"


def test_clip_grad_norm_on_a_nested_instance_raises_as_torchs():
    """clip_grad_norm_ on a nested instance raises torch's RuntimeError and changes no
    gradient: the root's norm afterwards is torch's.  (dptc clipped the nested instance's
    parameters by their own norm.)"""
    mine, theirs = _nested_cases()
    for result, reference in zip(mine, theirs):
        assert reference["nested"][0] == "RuntimeError", reference
        assert result["nested"] is not None and result["nested"][0] == "RuntimeError", result
        assert "root" in result["nested"][1]
        assert abs(result["root"] - reference["root"]) <= 1e-6 * reference["root"], \
            (result, reference)


def test_no_sync_on_a_nested_instance_raises_as_torchs():
    """no_sync() on a nested instance raises torch's RuntimeError.  (dptc stopped the
    gradient sync of that instance's units alone.)"""
    mine, theirs = _nested_cases()
    for result, reference in zip(mine, theirs):
        assert reference["nested no_sync"][0] == "RuntimeError", reference
        assert result["nested no_sync"] is not None, result
        assert result["nested no_sync"][0] == "RuntimeError" and \
            "root" in result["nested no_sync"][1], result


def test_sync_module_states_leaves_ignored_parameters():
    """sync_module_states=True broadcasts rank 0's managed parameters and leaves the
    ignored ones (ignored_modules', ignored_states') each rank's own, as torch's FSDP1
    syncs only the parameters it manages (its sync needs a GPU, so no torch run here).
    (dptc broadcast the ignored parameters too.)"""
    for rank, result in enumerate(run_ranks("tests.workers_fsdp1:sync_ignored_case", 2,
                                            timeout=LAUNCH_TIMEOUT_S)):
        assert result["managed"] > 0 and result["managed_rel"] == 0.0, (rank, result)
        assert result["ignored_kept"] == [True, True], (rank, result)


@pytest.mark.parametrize("register", ["register_post_accumulate_grad_hook", "register_hook"])
def test_post_accumulate_grad_hooks_refused_as_torch_never_runs_them_on_params(register):
    """register_post_accumulate_grad_hook on the wrapper's parameters, FULL_SHARD, 2 ranks.
    torch's FSDP1 never runs such hooks under use_orig_params=True, and under
    use_orig_params=False runs them on each flat parameter with this rank's unsharded,
    unreduced gradient (the ranks' gradients differ).  dptc, which has no flat parameter,
    refuses both in the root's forward with a RuntimeError naming the remedy, before any
    gather; with the hooks removed the same steps train to torch's parameters (float32,
    within 1e-6).  The same for gradient hooks (register_hook), which torch's FSDP1 runs on
    the same gradients.  (dptc ran post-accumulate-grad hooks after the reduced gradient, as
    fully_shard does, and never ran gradient hooks.)"""
    args = {"register": register}
    mine = run_ranks("tests.workers_fsdp1:post_accumulate_hooks_case", 2,
                     args={"impl": "dptc", **args}, timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:post_accumulate_hooks_case", 2,
                       args={"impl": "torch", **args}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        orig, flat = reference["use_orig_params=True"], reference["use_orig_params=False"]
        assert orig["error"] is None and orig["calls"] == [], (rank, orig)
        assert flat["error"] is None and len(flat["calls"]) == len(flat["local_numels"]) == 3
        assert sorted(numel for numel, _ in flat["calls"]) == \
            sorted(2 * numel for numel in flat["local_numels"]), (rank, flat)
        for setting in ("use_orig_params=True", "use_orig_params=False"):
            case = result[setting]
            assert case["calls"] == [], (rank, setting, case["calls"])
            kind, message = case["error"]
            assert kind == "RuntimeError", (rank, setting, case["error"])
            for part in (f"{register} on parameters", "use_orig_params=True",
                         "unreduced gradient", "remove()", "blocks.0.attn.qkv.weight"):
                assert part in message, (part, message)
            assert ("dptc.fully_shard" in message) == (register != "register_hook"), message
            assert max_rel(case["params"], reference[setting]["params"]) <= 1e-6, (rank, setting)
    # The flat parameters' gradients are this rank's own: they differ between the ranks.
    sums = [sorted(total for _, total in r["use_orig_params=False"]["calls"]) for r in theirs]
    assert sums[0] != sums[1], sums


def test_batch_norm_left_in_full_precision_as_torchs():
    """MixedPrecision with an auto_wrap_policy (a policy object and a policy function), 2
    ranks, a network of Linear + BatchNorm1d blocks: as torch's FSDP1, each BatchNorm becomes
    an instance of its own without mixed precision (its inputs cast to float32 and back), with
    torch's warning, and its running statistics stay float32 while the other buffers take
    buffer_dtype.  Trained parameters and buffers equal torch's within 1e-6.  (dptc ran the
    BatchNorms in bf16, 4.6 % off torch's gradients, and failed with buffer_dtype alone, or
    param_dtype=float64: "expected scalar type Float but found Half".)"""
    mine = run_ranks("tests.workers_fsdp1:batch_norm_precision_case", 2,
                     args={"impl": "dptc"}, timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:batch_norm_precision_case", 2,
                       args={"impl": "torch"}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert list(result) == list(reference)
        for case, want in reference.items():
            got = result[case]
            assert "error" not in want, (case, want["error"])
            assert "error" not in got, (rank, case, got["error"])
            assert len(got["warnings"]) == len(want["warnings"]) == 1, (case, got, want)
            assert "BatchNorm1d" in got["warnings"][0]
            assert got["instances"] == want["instances"] == 5, (case, got["instances"])
            assert got["buffer_dtypes"] == want["buffer_dtypes"], (rank, case)
            assert got["buffer_dtypes"]["0.norm.running_mean"] == "torch.float32", case
            assert max_rel(got["params"], want["params"]) <= 1e-6, (rank, case)
            assert max_rel(got["buffers"], want["buffers"]) <= 1e-6, (rank, case)
        assert result["lambda/bf16"]["buffer_dtypes"]["0.scale"] == "torch.bfloat16"


def test_state_dicts_give_buffers_in_their_own_dtype_as_torchs():
    """MixedPrecision(buffer_dtype=float16), 2 ranks, buffers of a nested instance and of the
    root: the module computes with float16 buffers (BatchNorm's statistics left float32), and
    FULL and SHARDED state dicts give every buffer in the dtype it had before wrapping, float32,
    with torch's values (the float16 ones, exactly).  (dptc's state dicts held float16.)"""
    mine = run_ranks("tests.workers_fsdp1:buffer_state_dict_case", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:buffer_state_dict_case", 2,
                       args={"impl": "torch"}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert result["module"] == reference["module"], (rank, result["module"])
        assert result["module"]["0.scale"] == result["module"]["1.scale"] == "torch.float16"
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            assert sorted(result[kind]) == sorted(result["module"]), (rank, kind)
            for key, (dtype, values) in result[kind].items():
                assert dtype == reference[kind][key][0] == "torch.float32", (rank, kind, key)
                assert values == reference[kind][key][1], (rank, kind, key)


def test_forward_inside_summon_full_params_as_torchs():
    """A forward inside summon_full_params before any training forward (generating with
    summon_full_params(recurse=False) around the wrapped module, or evaluating in a full
    summon, with or without gradients), 2 ranks, float32: the logits and the next training
    step's loss are torch's (within 1e-6); a summon_full_params nested in one of the same
    instance raises AssertionError, as torch's.  (dptc raised "Embedding.weight was replaced
    by a Parameter" in each.)"""
    mine = run_ranks("tests.workers_fsdp1:summon_forward_case", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:summon_forward_case", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        for case in ("generation", "full", "with_grad"):
            (logits, loss), (want_logits, want_loss) = result[case], reference[case]
            assert isinstance(want_logits[0], float), (case, want_logits)
            assert isinstance(logits[0], float), (rank, case, logits)
            assert max_rel([logits], [want_logits]) <= 1e-6, (rank, case)
            assert abs(loss - want_loss) <= 1e-6 * abs(want_loss), (rank, case, loss, want_loss)
        assert result["nested"][0] == reference["nested"][0] == "AssertionError", \
            (result["nested"], reference["nested"])
        assert "summon_full_params inside summon_full_params" in result["nested"][1]
        # rank0_only with writeback: torch's NotImplementedError, with the remedy.
        assert result["rank0_writeback"][0] == reference["rank0_writeback"][0] == \
            "NotImplementedError", (result["rank0_writeback"], reference["rank0_writeback"])
        assert "pass writeback=False" in result["rank0_writeback"][1]


def test_sync_module_states_from_a_meta_model():
    """Rank 0 builds the model, rank 1 on the meta device, sync_module_states=True with a
    param_init_fn materializing module by module (accelerate's low-memory loading): every
    parameter is rank 0's, bit for bit.  Where the ranks' modules differ (the embedding and
    head tied on rank 0, untied on rank 1 by to_empty, as under torch's FSDP1) a ValueError
    names the parameter and the remedy on every rank, before any broadcast (torch's sync
    needs a GPU, so no torch run; dptc raised CollectiveMismatchError between a broadcast and
    the next unit's shared-memory setup)."""
    for rank, result in enumerate(run_ranks("tests.workers_fsdp1:sync_meta_case", 2,
                                            timeout=LAUNCH_TIMEOUT_S)):
        assert result["untied_diff"] == 0.0 and result["untied_count"] == 16, (rank, result)
        kind, message = result["tied"]
        assert kind == "ValueError", (rank, result["tied"])
        assert "only on rank 1: ['head.weight']" in message, message
        assert "tie them again in param_init_fn" in message, message


def test_instance_wrapped_by_hand_casts_inputs_as_a_nested_one():
    """An instance made by hand with MixedPrecision(param_dtype=bfloat16), then wrapped in a
    root without mixed precision, 2 ranks: as torch's, it is nested at the first forward, so
    it casts its inputs only by cast_forward_inputs (False): its float32 input times bfloat16
    weights gives float32 outputs, and two SGD steps train to torch's parameters (within
    1e-6).  (dptc cast the input by cast_root_forward_inputs, as for a root: bfloat16 reached
    the next Linear, which failed: "mat1 and mat2 must have the same dtype".)"""
    mine = run_ranks("tests.workers_fsdp1:nested_cast_case", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:nested_cast_case", 2, args={"impl": "torch"},
                       timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert "error" not in reference, reference["error"]
        assert "error" not in result, (rank, result["error"])
        for step, (got, want) in enumerate(zip(result["steps"], reference["steps"])):
            assert got[0] == want[0] == "torch.float32", (rank, step, got[0], want[0])
            assert max_rel([got[1]], [want[1]]) <= 1e-6, (rank, step)
        assert max_rel(result["params"], reference["params"]) <= 1e-6, rank


def test_load_state_dict_reports_keys_as_torchs():
    """load_state_dict's missing and unexpected keys, and strict's error message, name the
    keys as the state dict does (blocks.0.attn.qkv.weight), exactly as torch's FSDP1 reports
    them, FULL and SHARDED, use_orig_params True and False.  (dptc's carried the
    _fsdp_wrapped_module. prefixes, so scripts checking them against the state dict's keys
    saw every key as missing.)"""
    mine = run_ranks("tests.workers_fsdp1:incompatible_keys_case", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:incompatible_keys_case", 2,
                       args={"impl": "torch"}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        assert result == reference, (rank, result, reference)
        assert result["use_orig_params=True/FULL_STATE_DICT/missing"] == \
            [["blocks.0.attn.qkv.weight", "ln_f.weight"], []]
        assert result["use_orig_params=False/SHARDED_STATE_DICT/extra"] == \
            [[], ["blocks.0.extra"]]
        assert 'Missing key(s) in state_dict: "ln_f.weight"' in \
            result["use_orig_params=True/FULL_STATE_DICT/strict"][1]


def test_state_dict_keys_in_the_modules_order_as_torchs():
    """Instances nested in instances (BatchNorms in blocks, as MixedPrecision with an
    auto_wrap_policy makes them), 2 ranks: FULL and SHARDED state dicts list their keys in
    the wrapped module's order, as torch's FSDP1 and the unwrapped module do.  (dptc put a
    block's nested instance's keys before the block's own: 0.norm.weight before 0.scale.)"""
    mine = run_ranks("tests.workers_fsdp1:state_dict_order_case", 2, args={"impl": "dptc"},
                     timeout=LAUNCH_TIMEOUT_S)
    theirs = run_ranks("tests.workers_fsdp1:state_dict_order_case", 2,
                       args={"impl": "torch"}, timeout=LAUNCH_TIMEOUT_S, reference=True)
    for rank, (result, reference) in enumerate(zip(mine, theirs)):
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            assert result[kind] == reference[kind] == result["plain"], (rank, kind, result)
