"""Mistakes a new user makes with dptc's public calls, against torch.distributed on gloo.

Layer: two ranks (rank-side bodies in tests/workers_bad_input.py; one launch per body, shared
by the tests that read it).  Each case pins the error type and the words of dptc's message (the
argument, the value, the remedy) or the numbers the call gives; where torch is run too, its
outcome is pinned beside dptc's, so a difference is a decision, not an accident.  Mistakes
tests/test_collectives.py, test_ddp_errors.py and test_fsdp_errors.py already cover are not
repeated here.

What each case did before it was fixed:
    all_reduce (SUM, AVG), broadcast, all_gather_into_tensor, reduce_scatter_tensor of
        complex64 tensors   torch: communicated as (real, imaginary) pairs; dptc: TypeError
        "tensor has dtype torch.complex64, which dptc does not communicate"
    Work.wait(timeout=timedelta(0)) with a peer 0.5 s late   torch's default ("no timeout
        given"): torch waits; dptc waited 0 s, raised DistTimeoutError and aborted the group,
        so every rank's next collective failed with PeerLostError
    Work.wait(timeout=timedelta(seconds=-1)) or nan   torch: RuntimeError "Operation timed
        out!", the collective left running; dptc: DistTimeoutError "did not complete within
        -1.0 s", the group aborted on every rank
    Work.wait(timeout="5")   dptc: TypeError "must be real number, not str" (no argument named)
    all_reduce(t, async_op="no")   torch: TypeError; dptc returned a handle (the string is
        truthy), so a caller reading t at once read it before the reduction
    all_reduce(float32 tensor, op=ReduceOp.BAND) (BOR, BXOR; float16, bfloat16; and
        reduce_scatter_tensor)   torch: RuntimeError "Cannot use ReduceOp.BAND with
        non-integral dtype"; dptc: ValueError "op=<RedOpType.BAND: 5> is not supported by
        dptc", which it raised on integer and bool tensors too (tests/test_collectives.py)
    all_reduce(int64 tensor, op=ReduceOp.AVG)   torch: RuntimeError "result type Float can't
        be cast to the desired output type Long" (after summing); dptc: ValueError
    all_reduce(tensor.t()), all_reduce(vector[::2]), broadcast, all_gather_into_tensor and
        reduce_scatter_tensor of sliced tensors, async too   torch's gloo takes them (and
        reduces a sliced all_reduce's storage instead of the slice); dptc: ValueError "tensor is
        not contiguous"
    all_gather_into_tensor/reduce_scatter_tensor into an expanded output   torch: RuntimeError
        "more than one element of the written-to tensor refers to a single memory location";
        dptc: ValueError "not contiguous" (all_reduce of one: torch writes past its storage)
    all_reduce(meta tensor)   torch: does nothing; dptc: ValueError "is on device meta ...
        move it with .cpu()", which fails for a meta tensor
    broadcast(src=np.int64(1)) or src=torch.tensor(1)   torch accepts them; dptc: ValueError
    broadcast(src=0.5 / "1"), group_src=1.0   torch: TypeError; dptc: ValueError
    DDP, fully_shard and FSDP1 over models that differ between ranks in shapes or order but
        not in element count (Linear(4, 6) against Linear(6, 4); the same two layers in the
        other order)   torch's DDP: RuntimeError "params[0] in this process with sizes [4, 6]
        appears not to match sizes of the same param in process 0" at construction; torch's
        fully_shard accepts it, and DTensor.full_tensor() later kills a rank with SIGABRT in
        gloo; dptc accepted both silently and trained the ranks apart (DDP gradients
        [5.72, 1.65, 5.06] on rank 0 against [5.72, 3.02, 3.69] on rank 1 after one step)
    the same with an extra bias, another dtype, or a parameter frozen on one rank only
        dptc: CollectiveMismatchError naming an internal "call(uint8, count=96)" or a
        broadcast, not the parameter (torch's DDP: "DDP expects same model across all ranks")
    DDP(module, device_ids=0) on a CPU module   torch: TypeError "object of type 'int' has no
        len()"; dptc accepted it (0 is falsy) and ignored it
    MixedPrecisionPolicy(param_dtype="bf16")   torch: RuntimeError "Invalid device string:
        'bf16'" at forward; dptc: TypeError "empty(): argument 'dtype' must be torch.dtype"
    FullyShardedDataParallel(process_group=0)   torch: AttributeError "'int' object has no
        attribute 'rank'"; dptc: TypeError "'int' object is not iterable"
    new_group(2), new_group("01")   torch: TypeError "'int' object is not iterable", "'<' not
        supported between instances of 'str' and 'int'"; dptc: the first alike, the second
        ValueError "ranks must hold global ranks in [0, 2), got 01"
    fully_shard(ignored_params=param)   torch accepts it and ignores nothing (it takes a set:
        a list raises "Boolean value of Tensor with more than one value is ambiguous", which
        dptc accepts); dptc: RuntimeError "Boolean value of Tensor ... is ambiguous"
    FSDP1(ignored_modules=module)   torch and dptc: TypeError "'Linear' object is not
        iterable"
    init_process_group(timeout=5 s) or ("nccl") once dptc is initialised   torch: ValueError
        "trying to initialize the default process group twice!"; dptc returned its group
        with the timeout it had (30 s here) or its backend, ignoring the request
"""

import pytest

from tests._launch import once, run_ranks

RUN_TIMEOUT_S = 150

# case: (dptc's error type or None, fragments of its message or its value,
#        torch's error type or None, fragment of torch's message or its value)
_COMPLEX_SUM = [[2.0, 4.0], [-1.0, 1.0]]
# (arange(12).reshape(3, 4) + rank).t() summed over 2 ranks, and rank 0's broadcast.
_TRANSPOSED_SUM = [[1.0, 9.0, 17.0], [3.0, 11.0, 19.0], [5.0, 13.0, 21.0], [7.0, 15.0, 23.0]]
_TRANSPOSED_RANK0 = [[0.0, 4.0, 8.0], [1.0, 5.0, 9.0], [2.0, 6.0, 10.0], [3.0, 7.0, 11.0]]
_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a "
            "single memory location")
CALLS = {
    "complex_all_reduce_sum": (None, _COMPLEX_SUM, None, _COMPLEX_SUM),
    "complex_all_reduce_avg": (None, [[1.0, 2.0], [-0.5, 0.5]], None, [[1.0, 2.0], [-0.5, 0.5]]),
    "complex_all_reduce_max": ("ValueError", [
        "all_reduce does not support op=<RedOpType.MAX: 4> on complex tensors",
        "tensor has dtype torch.complex64", "use ReduceOp.SUM or ReduceOp.AVG"],
        "ValueError", "all_reduce does not support RedOpType.MAX on complex tensors"),
    "complex_broadcast": (None, [[1.0, 2.0], [-1.0, 1.0]], None, [[1.0, 2.0], [-1.0, 1.0]]),
    "complex_all_gather": (None, [[1.0, 2.0], [0.0, 0.0], [1.0, 2.0], [-1.0, 1.0]],
                           None, [[1.0, 2.0], [0.0, 0.0], [1.0, 2.0], [-1.0, 1.0]]),
    "complex_reduce_scatter_sum": (None, _COMPLEX_SUM, None, _COMPLEX_SUM),
    "complex_conj_view": ("RuntimeError", ["tensor is a conjugate view",
                                           "pass tensor.resolve_conj() and copy back"],
                          "RuntimeError", "view_as_real doesn't work on unresolved conjugated"),
    "wait_timeout_zero_late_peer": (None, [True, [3.0, 3.0, 3.0, 3.0]],
                                    None, [True, [3.0, 3.0, 3.0, 3.0]]),
    "wait_timeout_str": ("TypeError", ["timeout must be None, a number of seconds or a "
                                       "datetime.timedelta", "got '5'"],
                         "TypeError", "incompatible function arguments"),
    "wait_timeout_negative": ("ValueError", ["timeout must be between 0 and 1e9 seconds",
                                             "(None or 0: the default, 61 s)",
                                             "datetime.timedelta(days=-1, seconds=86399)"],
                              "RuntimeError", "Operation timed out!"),
    "wait_timeout_nan": ("ValueError", ["timeout must be between 0 and 1e9 seconds", "got nan"],
                         "RuntimeError", "Operation timed out!"),
    "async_op_str": ("TypeError", ["async_op must be a bool, got 'no'"],
                     "TypeError", "incompatible function arguments"),
    "op_int": ("TypeError", ["op must be a torch.distributed.ReduceOp (dptc.ReduceOp), got "
                             "int 0", "pass e.g. ReduceOp.SUM"],
               "TypeError", "incompatible function arguments"),
    # torch's gloo reduces bitwise only integers and bool; dptc raises its error type and
    # words, then names the argument, the value and the remedy.
    "band_float32": ("RuntimeError", [
        "Cannot use ReduceOp.BAND with non-integral dtype", "op=ReduceOp.BAND needs an integer "
        "or bool tensor, got torch.float32", "tensor.view(torch.uint8)"],
        "RuntimeError", "Cannot use ReduceOp.BAND with non-integral dtype"),
    "bor_float16": ("RuntimeError", [
        "Cannot use ReduceOp.BOR with non-integral dtype", "got torch.float16",
        "tensor.view(torch.uint8)"],
        "RuntimeError", "Cannot use ReduceOp.BOR with non-integral dtype"),
    "bxor_bfloat16_reduce_scatter": ("RuntimeError", [
        "Cannot use ReduceOp.BXOR with non-integral dtype", "op=ReduceOp.BXOR", "got "
        "torch.bfloat16", "tensor.bool() for flags"],
        "RuntimeError", "Cannot use ReduceOp.BXOR with non-integral dtype"),
    # AVG of integers: torch's gloo sums, then fails to divide in place; dptc raises the same
    # type, in torch's words first, before communicating.
    "int_all_reduce_avg": ("RuntimeError", [
        "result type Float can't be cast to the desired output type Long",
        "op=ReduceOp.AVG needs a floating-point tensor, got torch.int64",
        "use ReduceOp.SUM and divide"],
        "RuntimeError", "result type Float can't be cast to the desired output type Long"),
    # torch's gloo does nothing with a meta tensor; dptc names the remedy.
    "meta_all_reduce": ("ValueError", ["tensor is a meta tensor (shape (4,), torch.float32)",
                                       "module.to_empty(device='cpu')"], None, "None"),
    # Non-contiguous tensors (see [Note: non-contiguous tensors] in dptc/collectives.py).
    "all_reduce_transposed": (None, [_TRANSPOSED_SUM, True], None, [_TRANSPOSED_SUM, True]),
    # torch's gloo reduces the first elements of the storage, not the slice's (false, false).
    "all_reduce_sliced": (None, [True, True], None, [False, False]),
    "all_reduce_transposed_async": (None, [_TRANSPOSED_SUM, _TRANSPOSED_SUM, [1, 4]],
                                    None, [_TRANSPOSED_SUM, _TRANSPOSED_SUM, [1, 4]]),
    # Polled with is_completed() instead of waited on: the tensor holds the sum once it says
    # True (it held this rank's own values before the write-back moved there).
    "all_reduce_transposed_polled": (None, [_TRANSPOSED_SUM, _TRANSPOSED_SUM],
                                      None, [_TRANSPOSED_SUM, _TRANSPOSED_SUM]),
    "broadcast_transposed": (None, [_TRANSPOSED_RANK0, True], None, [_TRANSPOSED_RANK0, True]),
    "all_gather_sliced": (None, [[1.0, 2.0, 2.0, 3.0], True], None, [[1.0, 2.0, 2.0, 3.0], True]),
    "reduce_scatter_sliced": (None, [[1.0, 3.0, 5.0, 7.0], True],
                              None, [[1.0, 3.0, 5.0, 7.0], True]),
    "all_gather_expanded_output": ("RuntimeError", [
        _OVERLAP, "output_tensor (shape (4,), stride (0,)) is expanded",
        "pass output_tensor.clone()"], "RuntimeError", _OVERLAP),
    "reduce_scatter_expanded_output": ("RuntimeError", [
        _OVERLAP, "output (shape (2,), stride (0,)) is expanded", "pass output.clone()"],
        "RuntimeError", _OVERLAP),
    # torch's gloo would write past the one-element storage; its reference does not run it.
    "all_reduce_expanded": ("RuntimeError", [
        _OVERLAP, "tensor (shape (4,), stride (0,)) is expanded", "pass tensor.clone()"],
        None, "not run"),
    "src_numpy_int": (None, [11.0, 11.0, 11.0], None, [11.0, 11.0, 11.0]),
    "src_0dim_tensor": (None, [11.0, 11.0, 11.0], None, [11.0, 11.0, 11.0]),
    "src_float": ("TypeError", ["src must be a global rank (an int)", "got 0.5"],
                  "TypeError", "incompatible function arguments"),
    "src_str": ("TypeError", ["src must be a global rank (an int)", "got '1'"],
                "TypeError", "incompatible function arguments"),
    "group_src_float": ("TypeError", ["group_src must be a rank of the group (an int)",
                                      "got 1.0"],
                        "TypeError", "incompatible function arguments"),
    "new_group_ranks_int": ("TypeError", ["ranks must be None or a list of global ranks "
                                          "(ints), got 2"],
                            "TypeError", "'int' object is not iterable"),
    "new_group_ranks_str": ("TypeError", ["ranks must be None or a list of global ranks "
                                          "(ints), got '01'"],
                            "TypeError", "'<' not supported between instances of 'str' and "
                                         "'int'"),
    # dptc's init is idempotent (it initialises itself on first use), unless asked for
    # something other than what it has, which it used to ignore.
    "init_again_same_backend": (None, True,
                                "ValueError", "trying to initialize the default process group "
                                              "twice!"),
    "init_again_other_timeout": ("ValueError", [
        "init_process_group(timeout=datetime.timedelta(seconds=5))",
        "already initialised with timeout 30.0",
        "call init_process_group before any other dptc call"],
        "ValueError", "trying to initialize the default process group twice!"),
    "init_again_nccl": ("ValueError", ["backend must be None, 'dptc' or 'gloo', got 'nccl'"],
                        "ValueError", "trying to initialize the default process group twice!"),
}

_SAME_MODEL = "expects the same model on every rank of its group"
_DDP_REMEDY = ("build the module identically on every rank (the same layers in the same order, "
               "shapes, dtypes and requires_grad) before wrapping it")
_FSDP_REMEDY = "apply fully_shard to the same modules in the same order on every rank"
# case: (dptc's error type, fragments of its message); every case raises on both ranks alike.
MODELS = {
    "ddp_transposed": ("RuntimeError", [
        "DistributedDataParallel " + _SAME_MODEL,
        "parameter 0 is 'weight' of shape (6, 4), float32 on global rank 0 and 'weight' of "
        "shape (4, 6), float32 on global rank 1", _DDP_REMEDY]),
    "ddp_reordered": ("RuntimeError", [
        "parameter 1 is '0.bias' of shape (4,), float32 on global rank 0 and '1.weight' of "
        "shape (4, 4), float32 on global rank 1", _DDP_REMEDY]),
    "ddp_extra_bias": ("RuntimeError", [
        "global rank 0 has 2 parameters and global rank 1 has 1", "'bias' of shape (4,)"]),
    "ddp_dtype": ("RuntimeError", ["float32 on global rank 0", "float64 on global rank 1"]),
    "ddp_frozen_on_one_rank": ("RuntimeError", [
        "'0.weight' of shape (4, 4), float32, frozen on global rank 0 and '0.weight' of shape "
        "(4, 4), float32 on global rank 1"]),
    "fully_shard_transposed": ("RuntimeError", [
        "fully_shard of Linear " + _SAME_MODEL,
        "'Linear.weight' of shape (6, 4), float32 on global rank 0 and 'Linear.weight' of "
        "shape (4, 6), float32 on global rank 1", _FSDP_REMEDY]),
    "fully_shard_reordered": ("RuntimeError", [
        "parameter 1 is 'Linear.bias' of shape (4,), float32 on global rank 0 and "
        "'Linear.weight' of shape (4, 4)", _FSDP_REMEDY]),
    "fully_shard_extra_bias": ("RuntimeError", [
        "global rank 0 has 2 parameters and global rank 1 has 1"]),
    "fsdp1_transposed": ("RuntimeError", [
        "FullyShardedDataParallel " + _SAME_MODEL,
        "parameter 0 is '0.weight' of shape (6, 4), float32 on global rank 0 and '0.weight' of "
        "shape (4, 6), float32 on global rank 1", _DDP_REMEDY]),
    "ddp_device_ids_int": ("TypeError", [
        "device_ids must be None or a list", "device_ids=[index]", "got 0"]),
    "fully_shard_param_dtype_str": ("TypeError", [
        "mp_policy.param_dtype must be None or a floating-point torch.dtype", "got 'bf16'"]),
    "fully_shard_ignored_params_tensor": ("TypeError", [
        "ignored_params must be a set of parameters, got a Parameter of shape (4, 4)",
        "pass {parameter}"]),
    "fsdp1_ignored_modules_module": ("TypeError", [
        "ignored_modules must be a list of modules or parameters, got a Linear", "pass [it]"]),
    "fsdp1_process_group_int": ("TypeError", [
        "process_group must be None or a torch.distributed ProcessGroup", "device_mesh=",
        "got int 0"]),
}

_launches = {}


def _launch(key, target, **kwargs):
    return once(_launches, key, lambda: run_ranks(target, 2, timeout=RUN_TIMEOUT_S, **kwargs),
                f"the {key} launch")


def _check(outcome, error_type, expected):
    """expected: the fragments of the message (a list of str) or the value."""
    assert outcome["type"] == error_type, outcome
    if error_type is None:
        assert outcome["value"] == expected, outcome
    else:
        for fragment in expected if isinstance(expected, list) else [expected]:
            assert fragment in outcome["message"], (fragment, outcome)


# Cases whose torch reference is judged on rank 0 alone: torch's wait gives up at once there,
# while rank 1 comes late; rank 1's own collective may have completed by the time it waits (its
# peer is already there), and then torch's wait returns True (seen under tools/sanitize.sh).
_TORCH_RANK0_ONLY = {"wait_timeout_negative", "wait_timeout_nan"}


@pytest.mark.parametrize("impl", ["dptc", "torch"])
@pytest.mark.parametrize("case", list(CALLS))
def test_call(case, impl):
    dptc_type, dptc_expected, torch_type, torch_expected = CALLS[case]
    results = _launch(f"calls-{impl}", "tests.workers_bad_input:call_cases",
                      args={"impl": impl}, reference=impl == "torch")
    for rank, result in enumerate(results):
        if impl == "dptc":
            _check(result[case], dptc_type, dptc_expected)
        elif rank == 0 or case not in _TORCH_RANK0_ONLY:
            _check(result[case], torch_type, torch_expected)


@pytest.mark.parametrize("impl", ["dptc", "torch"])
def test_group_in_step_after_bad_calls(impl):
    """No refused call aborted the group or put the ranks out of step."""
    results = _launch(f"calls-{impl}", "tests.workers_bad_input:call_cases",
                      args={"impl": impl}, reference=impl == "torch")
    assert [result["in_step"] for result in results] == [True, True]


@pytest.mark.parametrize("case", list(MODELS))
def test_model_refused_on_every_rank(case):
    error_type, fragments = MODELS[case]
    results = _launch("models", "tests.workers_bad_input:model_cases")
    for result in results:
        _check(result[case], error_type, fragments)
    # Both ranks give the same message: each compares every rank's description.
    assert results[0][case]["message"] == results[1][case]["message"]


def test_matched_model_trains_after_refusals():
    """After every refusal the group is in step, and DDP and fully_shard over the same model
    on both ranks give the single process's gradients (float64)."""
    for result in _launch("models", "tests.workers_bad_input:model_cases"):
        assert result["in_step"] is True
        assert result["trained"]["ddp"] < 1e-12, result["trained"]
        assert result["trained"]["fully_shard"] < 1e-12, result["trained"]


@pytest.mark.parametrize("collective, redop, words", [
    ("all_reduce", "BAND", ["Cannot use ReduceOp.BAND with NCCL",
                            "all_reduce(op=ReduceOp.BAND) on CUDA tensors",
                            "all_reduce CPU copies of the tensors on the same group",
                            "ReduceOp.MIN for BAND"]),
    ("reduce_scatter_tensor", "BXOR", ["Cannot use ReduceOp.BXOR with NCCL",
                                       "reduce_scatter_tensor(op=ReduceOp.BXOR)"]),
])
def test_bitwise_on_cuda_tensors_refused(collective, redop, words):
    """NCCL has no bitwise reductions: dptc raises torch's NCCL ValueError, naming the op and
    the remedy, before the NCCL engine (this build has no GPU, so the check runs alone)."""
    from dptc import _dtypes
    from dptc.collectives import _check_nccl_redop
    code = getattr(_dtypes, f"REDOP_{redop}")
    op = {"all_reduce": _dtypes.OP_ALL_REDUCE,
          "reduce_scatter_tensor": _dtypes.OP_REDUCE_SCATTER}[collective]
    with pytest.raises(ValueError) as caught:
        _check_nccl_redop(op, code)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    for allowed in (_dtypes.REDOP_SUM, _dtypes.REDOP_MAX, _dtypes.REDOP_AVG):
        _check_nccl_redop(op, allowed)
    _check_nccl_redop(_dtypes.OP_BROADCAST, code)   # no reduction: nothing to refuse


def test_gather_mismatch_names_no_reduce_op():
    """A mismatch names each side's all-gather without the 'op=SUM' it used to print (an
    all-gather reduces nothing)."""
    results = run_ranks("tests.workers_bad_input:gather_mismatch", 2, timeout=RUN_TIMEOUT_S,
                        expect_failure=True)
    for result in results:
        assert result["error_type"] == "CollectiveMismatchError", result
        for fragment in ("all_gather_into_tensor(float32, count=4) (collective #1)",
                         "all_gather_into_tensor(float32, count=3) (collective #1)"):
            assert fragment in result["error"], (fragment, result["error"])
        assert "op=" not in result["error"], result["error"]


@pytest.mark.parametrize("shared", [False, True])
def test_gather_pieces_mismatch_raises_everywhere(shared):
    """all_gather_into_tensors whose pieces differ between ranks (the same total, so the
    count alone matches) raises CollectiveMismatchError on every rank, naming both sides'
    pieces, instead of gathering each rank's elements into the wrong outputs."""
    results = run_ranks("tests.workers_bad_input:pieces_mismatch", 2, args={"shared": shared},
                        timeout=RUN_TIMEOUT_S, expect_failure=True)
    for result in results:
        assert result["error_type"] == "CollectiveMismatchError", result
        for fragment in ("global rank 0 issued all_gather_into_tensor(float32, count=6, "
                         "pieces [2, 4])", "global rank 1 issued all_gather_into_tensor("
                         "float32, count=6, pieces [4, 2])"):
            assert fragment in result["error"], (fragment, result["error"])


def test_gather_pieces_mismatch_across_nodes_raises_everywhere():
    """The same across 2 simulated nodes whose ranks agree within the node: the cross-node
    check compares the pieces too (by digest), so every rank raises instead of gathering
    into the wrong outputs."""
    results = run_ranks("tests.workers_bad_input:pieces_mismatch", 4, nnodes=2,
                        args={"by_node": True}, timeout=RUN_TIMEOUT_S, expect_failure=True)
    for rank, result in enumerate(results):
        assert result["error_type"] == "CollectiveMismatchError", result
        # This rank's pieces, and the other node's by digest.
        mine = "[2, 4]" if rank < 2 else "[4, 2]"
        for fragment in (f"global rank {rank} issued all_gather_into_tensor(float32, count=6, "
                         f"pieces {mine})", "pieces digest 0x"):
            assert fragment in result["error"], (fragment, result["error"])
