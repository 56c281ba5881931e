"""fully_shard over tensor-parallel parameters (FSDP + TP on a 2-D mesh).

Layer: 4 ranks, a (dp=2, tp=2) mesh; rank-side code in tests/workers_fsdp_tp.py.  Each block's
linears are made tensor-parallel with torch's parallelize_module (ColwiseParallel, then
RowwiseParallel) on mesh["tp"], and a gate between them a Replicate() DTensor there (its
gradient arrives Shard(0) and is redistributed), then fully_shard shards every block and the
root over mesh["dp"], as torch's tensor-parallel tutorial does.  One launch per
implementation: dptc's fully_shard and torch's (gloo), each training in float64 against a
single-process reference, under a float32 param_dtype, and from the meta device (built, made
tensor-parallel and sharded there, then to_empty and each module's reset_parameters under a
seed, as torchtitan initialises), and as HSDP + TP: the same blocks sharded over a
(replicate=2, shard=1) mesh of a (2, 1, 2) one, the dp ranks replicating, as across nodes;
then FSDP1 over the same blocks.
"""

import pytest

from tests._compare import max_rel
from tests._launch import run_ranks

LAUNCH_TIMEOUT_S = 180
# float64: the ranks and the reference differ only by summation order (measured 3e-16).
FLOAT64_TOLERANCE = 1e-10

_launches = {}


def _results(impl):
    if impl not in _launches:
        _launches[impl] = run_ranks("tests.workers_fsdp_tp:tp_cases", 4, args={"impl": impl},
                                    timeout=LAUNCH_TIMEOUT_S, reference=impl == "torch")
    return _launches[impl]


@pytest.mark.parametrize("impl", ["dptc", "torch"])
def test_tensor_parallel_blocks_match_single_process(impl):
    """Trained parameters and every step's gradients equal the single process's on the whole
    batch; torch's run checks the test with the same numbers."""
    for rank, result in enumerate(_results(impl)):
        for name in ("float64", "hsdp"):
            run = result[name]
            assert run["ref_rel"] <= FLOAT64_TOLERANCE, (rank, name, run["ref_rel"])
            assert run["grad_rel"] <= FLOAT64_TOLERANCE, (rank, name, run["grad_rel"])


def test_tensor_parallel_layout_and_numbers_are_torchs():
    """dptc's shards are torch's: the same 2-D placements (the column-parallel weight on
    (_StridedShard(0, split_factor=2), Shard(0)), the row-parallel one on (Shard(0),
    Shard(1)), its bias (Shard(0), Replicate()), the plain parameters on (Shard(0),)), the
    same local shapes (5 rows of a tensor-parallel piece split 3 and 2), the class
    FSDPBlock, and parameters bit-identical to torch's after training: in float64, under a
    float32 param_dtype (which moves them 8e-8 from the float64 reference), initialised
    on the meta device (DTensor's random initialisation of the same shards), and as HSDP on
    a 3-D mesh (Replicate() first)."""
    for mine, theirs in zip(_results("dptc"), _results("torch")):
        for run in ("float64", "mixed", "meta", "hsdp"):
            assert mine[run]["placements"] == theirs[run]["placements"]
            assert mine[run]["local_shapes"] == theirs[run]["local_shapes"]
            assert mine[run]["class"] == theirs[run]["class"] == "FSDPBlock"
            assert max_rel(mine[run]["params"], theirs[run]["params"]) == 0.0, run
        placements = mine["float64"]["placements"]
        assert placements["blocks.0.w1.weight"] == ["_S(0, 2)", "S(0)"]
        assert placements["blocks.0.w2.bias"] == ["S(0)", "R"]
        assert placements["head.weight"] == ["S(0)"]
        hybrid = mine["hsdp"]["placements"]   # HSDP puts Replicate() first, as torch's
        assert hybrid["blocks.0.w1.weight"] == ["R", "_S(0, 2)", "S(0)"]
        assert hybrid["head.weight"] == ["R", "S(0)"]
        assert mine["mixed"]["ref_rel"] > 1e-9     # the policy did run in float32


def test_fsdp1_over_tensor_parallel_blocks():
    """FSDP1's FullyShardedDataParallel(device_mesh=mesh["dp"], use_orig_params=True), a
    block per instance, over the same tensor-parallel blocks: the trained full parameters
    equal the single process's in float64, and torch's FSDP1 bit for bit."""
    for rank, (mine, theirs) in enumerate(zip(_results("dptc"), _results("torch"))):
        for run in (mine["fsdp1"], theirs["fsdp1"]):
            assert run["ref_rel"] <= FLOAT64_TOLERANCE, (rank, run["ref_rel"])
        assert max_rel(mine["fsdp1"]["params"], theirs["fsdp1"]["params"]) == 0.0, rank


# -- dp_mesh_dims: parameters on the whole SPMD mesh (torchtitan's path) ----------------------

_spmd_launches = {}


def _spmd_results(impl):
    if impl not in _spmd_launches:
        _spmd_launches[impl] = run_ranks("tests.workers_fsdp_tp:spmd_cases", 4,
                                         args={"impl": impl}, timeout=LAUNCH_TIMEOUT_S,
                                         reference=impl == "torch")
    return _spmd_launches[impl]


SPMD_RUNS = ("fsdp_tp", "hsdp", "flat", "flat_tp", "flat_hsdp", "ddp")


@pytest.mark.parametrize("impl", ["dptc", "torch"])
def test_dp_mesh_dims_match_single_process(impl):
    """fully_shard(mesh=spmd_mesh, dp_mesh_dims=...) over parameters that are DTensors on
    the whole mesh, the batch a DTensor sharded over the dp dims (the gradients arrive
    Partial() there): FSDP over dp of a (dp, tp) mesh with column- and row-parallel linears;
    HSDP over a (replicate, shard) mesh; shard=("dp_shard", "cp") flattened (alone, with tp,
    and under HSDP), as torchtitan shards under context parallelism; replicate="dp" alone
    (torch's DDP through fully_shard).  The gradients and the trained parameters equal the
    single process's on the whole batch, in float64; without flattening the shards stay on
    the mesh passed."""
    for rank, result in enumerate(_spmd_results(impl)):
        for name in SPMD_RUNS:
            run = result[name]
            assert run["ref_rel"] <= FLOAT64_TOLERANCE, (rank, name, run["ref_rel"])
            assert run["grad_rel"] <= FLOAT64_TOLERANCE, (rank, name, run["grad_rel"])
            assert run["mesh_is_spmd"] == (not name.startswith("flat")), (rank, name)


def test_dp_mesh_dims_layout_numbers_and_errors_are_torchs():
    """dptc's SPMD shards are torch's: the same placements (the column-parallel weight
    (_StridedShard(0, split_factor=2), Shard(0)), the row-parallel one (Shard(0), Shard(1));
    HSDP (Replicate(), Shard(0)); flattened dims one Shard(0) dim of a new mesh, (Replicate(),
    Shard(0)) under HSDP; replicate alone the parameters' own placements), the same local
    shapes, parameters bit-identical to torch's after training (where the batch is split 4
    ways, the flattened run, to summation order: 4 ranks' gradients are added in another
    order); bad dp_mesh_dims raise torch's exception types and messages (naming the
    parameter too)."""
    for mine, theirs in zip(_spmd_results("dptc"), _spmd_results("torch")):
        for run in SPMD_RUNS:
            assert mine[run]["placements"] == theirs[run]["placements"], run
            assert mine[run]["local_shapes"] == theirs[run]["local_shapes"], run
            limit = 1e-14 if run == "flat" else 0.0
            assert max_rel(mine[run]["params"], theirs[run]["params"]) <= limit, run
        placements = mine["fsdp_tp"]["placements"]
        assert placements["blocks.0.w1.weight"] == ["_S(0, 2)", "S(0)"]
        assert placements["blocks.0.w2.weight"] == ["S(0)", "S(1)"]
        assert placements["head.weight"] == ["S(0)", "R"]
        assert mine["hsdp"]["placements"]["head.weight"] == ["R", "S(0)"]
        assert mine["flat"]["placements"]["head.weight"] == ["S(0)"]
        assert mine["flat_hsdp"]["placements"]["head.weight"] == ["R", "S(0)"]
        assert mine["ddp"]["placements"]["blocks.0.w1.weight"] == ["R", "S(0)"]
        errors, torch_errors = mine["errors"], theirs["errors"]
        for case in ("unknown_name", "plain_param", "not_replicate", "int_reshard",
                     "replicate_only", "several_names"):
            kind, message = errors[case].split(": ", 1)
            assert kind == torch_errors[case].split(": ", 1)[0], case
            assert message.startswith(torch_errors[case].split(": ", 1)[1][:40]), case
        assert "'weight'" in torch_errors["plain_param"]
        assert "Linear.weight" in errors["plain_param"]
