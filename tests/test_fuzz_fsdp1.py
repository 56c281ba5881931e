"""Property-based state-machine fuzzing of FullyShardedDataParallel (FSDP1) against torch's
own: no sequence of public calls may crash a process, hang, or end differently from torch's.

Layer: 2 ranks, long-lived rank servers (tests/_fuzz.py; the rank side is
tests/workers_fuzz_fsdp1.py) that run every example on torch's FullyShardedDataParallel
(gloo, device_id="cpu") and on dptc's side by side in the same processes.  hypothesis draws a
model configuration (float32 or float64, an Embedding or a Linear input layer, 2 blocks and a
head; wrapped by auto_wrap_policy on the blocks, by hand around the blocks, the blocks and the
head, or the root alone; FULL_SHARD, SHARD_GRAD_OP or NO_SHARD with use_orig_params=True;
a frozen norm; MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32) on float32 models;
SGD with momentum or AdamW made after wrapping) and up to MAX_OPS ops: train steps (forward,
loss, backward), train steps under no_sync(), forwards whose backward comes as a later op or
never (or under no_grad), summon_full_params (writeback or not, with_grads or not, reading
the full parameters and, under writeback, changing them alike on every rank), state_dict()
under FULL_STATE_DICT (values compared) or SHARDED_STATE_DICT (keys and shapes compared),
load_state_dict of a state taken earlier, the wrapper's clip_grad_norm_, zero_grad (to None
or zeros) and optimizer steps.  After dptc raised, its model runs the rest of the sequence
unchecked, but it must not crash or hang.

Compared, per rank, op by op: either both implementations raise (any exception; the example
ends there) or both return the same values: losses, gradient norms, full parameters and
gradients within TOLERANCE (relative), state-dict keys exactly; every example ends by reading
all parameters in full (summon_full_params, writeback=False).  A rank that dies (SIGSEGV,
SIGABRT, ...) or an example that does not finish within EXAMPLE_TIMEOUT_S fails; hypothesis
shrinks the failure, then ops are deleted one at a time while it persists, and the message
gives that 1-minimal sequence.  TORCH_LIMITS (torch raises) and TORCH_WRONG (torch's
values are wrong) say where torch cannot be the oracle, and NORMALISE which differences are
judged acceptable, each with its reason; KNOWN_FINDINGS lists the dptc bugs found and not yet
fixed (none now).

Budget: CI runs the EXPLICIT examples (the minimal sequences of the findings fixed so far) and
CI_EXAMPLES generated examples from a fixed seed, about 19 s with the ranks' start-up on the
development machine (2 cores, when nothing else runs).  Longer searches:
    DPTC_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz_fsdp1.py -s
    DPTC_FUZZ_SECONDS=1800 python -m pytest tests/test_fuzz_fsdp1.py -s
(the second runs rounds of CI_EXAMPLES examples, or DPTC_FUZZ_EXAMPLES, with seeds
DPTC_FUZZ_SEED (default 0), +1, ... until the time is up, collecting every round's finding
instead of stopping at the first).  DPTC_FUZZ_SKIP=name,name leaves ops out of the
vocabulary ("mp" never draws mixed precision), or passes the examples of a KNOWN_FINDINGS
entry (by its name), to look past known findings; DPTC_FUZZ_VERBOSE=1 logs every example.
The test prints "fuzz fsdp1: N examples ..." (run with -s).
"""

from hypothesis import strategies as st

from tests import _fuzz

TARGET = "tests.workers_fuzz_fsdp1:serve"
WORLD_SIZE = 2
CI_EXAMPLES = 100
MAX_OPS = 8
EXAMPLE_TIMEOUT_S = 15.0
WEIGHTS = {"train_step": 3}
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}


@st.composite
def examples(draw):
    """One example: {"config": ..., "ops": [...]} (see tests/workers_fuzz_fsdp1.py)."""
    skip = _fuzz.skipped_from_env()
    dtype = draw(st.sampled_from(["float32", "float64"]))
    config = {
        "seed": draw(st.integers(0, 3)),
        "dtype": dtype,
        "input": draw(st.sampled_from(["embedding", "linear"])),
        "blocks": 2,
        "wrap": draw(st.sampled_from(["policy", "manual", "manual_head", "root"])),
        "strategy": draw(st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])),
        "frozen": draw(st.booleans()),
        "mp": dtype == "float32" and "mp" not in skip and draw(st.integers(0, 3)) == 3,
        "optim": draw(st.sampled_from(["sgd", "adamw"])),
    }
    seed = st.integers(0, 7)
    ops = {
        "train_step": st.fixed_dictionaries({"op": st.just("train_step"), "seed": seed}),
        "no_sync_step": st.fixed_dictionaries({"op": st.just("no_sync_step"), "seed": seed}),
        "forward": st.fixed_dictionaries(
            {"op": st.just("forward"), "seed": seed,
             "mode": st.sampled_from(["keep", "drop", "no_grad"])}),
        "backward": st.just({"op": "backward"}),
        "summon": st.fixed_dictionaries(
            {"op": st.just("summon"), "writeback": st.booleans(), "grads": st.booleans(),
             "modify": st.booleans()}),
        "state_dict": st.fixed_dictionaries(
            {"op": st.just("state_dict"), "kind": st.sampled_from(["full", "sharded"])}),
        "load_state_dict": st.fixed_dictionaries(
            {"op": st.just("load_state_dict"), "which": st.integers(0, 3)}),
        "clip_grad_norm": st.fixed_dictionaries(
            {"op": st.just("clip_grad_norm"), "max_norm": st.sampled_from([0.1, 1.0])}),
        "zero_grad": st.fixed_dictionaries(
            {"op": st.just("zero_grad"), "set_to_none": st.booleans()}),
        "optim_step": st.just({"op": "optim_step"}),
    }
    return {"config": config, "ops": draw(_fuzz.op_sequence(ops, skip, WEIGHTS, MAX_OPS))}


# Differences judged acceptable, each with its reason in the docstring: predicates over the
# example and one rank's result; an example passes when one holds on every rank.  None so
# far: the acceptable differences found are narrower, see TORCH_LIMITS, TORCH_WRONG and
# NORMALISE.
ALLOWED = []

# Where torch (2.13, CPU, gloo) cannot be the oracle: an example is compared only up to the
# op where torch raised one of these (dptc runs the rest unchecked: a crash or a hang there
# still fails).  (text in torch's error, reason)
TORCH_LIMITS = [
    ("linalg.vector_norm: the dtype of the input (Double) should be convertible without "
     "narrowing to the specified dtype (Float)",
     "torch's FullyShardedDataParallel.clip_grad_norm_ refuses float64 gradients (it asks "
     "vector_norm for a float32 result; tests/workers_fsdp1.py trains torch's in float32 for "
     "this); dptc's clips them"),
    ("must match the size of tensor b",
     "an optimizer step after a backward under no_sync() (the accumulated gradients still "
     "unsynced): torch's FSDP1 under FULL_SHARD and SHARD_GRAD_OP leaves each parameter the "
     "full-shaped gradient on its flat shard, which the step cannot add; dptc's steps each "
     "rank's shard with its own accumulated gradient's rows, as DDP and torch's NO_SHARD "
     "step with a rank's own gradients"),
    ("Expects tensor to be sharded with size",
     "summon_full_params(with_grads=True) after a backward under no_sync(): torch's FSDP1 "
     "under FULL_SHARD and SHARD_GRAD_OP fails its own assertion on the unsharded gradient it "
     "left; dptc's shows this rank's accumulated gradients, as torch's NO_SHARD does"),
]


def _mixed_precision_interleaved(example):
    """The index of the first op (in the outcomes: "setup" is 0) from which torch is no
    oracle, or None.  Under MixedPrecision, torch 2.13's FSDP1 on CPU goes wrong once a
    forward with grad is followed by another forward before its backward (the "forward" op's
    "drop", or "keep" with the backward later or never): the next optimizer step leaves its
    parameters far from where the same sequence without that forward leaves them (measured:
    drop, train_step, optim_step under NO_SHARD ends 55 % (SGD) and 100 % (AdamW) off torch's
    own run without the drop, while dptc's ends bit-identical to it; under FULL_SHARD and
    SHARD_GRAD_OP torch's ends 8 % off dptc's), and a kept
    forward's backward after the next train step raises "setStorage: ... out of bounds for
    storage of size 0" in torch's.  Without MixedPrecision torch's FSDP1 gets both right."""
    if not example["config"]["mp"]:
        return None
    kept = dropped = 0
    for index, op in enumerate(example["ops"]):
        name = op["op"]
        if name in ("train_step", "no_sync_step", "forward") and (kept or dropped):
            return index + 1
        if name == "forward" and op["mode"] == "keep":
            kept += 1
        if name == "forward" and op["mode"] == "drop":
            dropped += 1
        if name == "backward" and kept:
            kept -= 1
    return None


def _change_after_forward(example):
    """The index of the first op (in the outcomes) from which torch is no oracle, or None.
    Under FULL_SHARD and SHARD_GRAD_OP, torch 2.13's FSDP1 (use_orig_params=True) leaves the
    units it does not reshard after forward (the root under FULL_SHARD, every unit under
    SHARD_GRAD_OP) with their parameters as views of the unsharded flat parameter until a
    backward reshards them, after any forward, one under no_grad (an evaluation) too; an
    optimizer step, load_state_dict or a summon_full_params writeback in between changes
    those views and is lost (measured: train_step, forward (kept, dropped or under no_grad),
    optim_step ends 7.8 % (FULL_SHARD) and 100 % (SHARD_GRAD_OP) off torch's own train_step,
    optim_step, where dptc's ends bit-identical to it).  NO_SHARD
    keeps one copy and gets it right."""
    config = example["config"]
    if config["strategy"] == "NO_SHARD":
        return None
    outstanding = False
    kept = 0
    for index, op in enumerate(example["ops"]):
        name = op["op"]
        changes = (name in ("optim_step", "load_state_dict")
                   or (name == "summon" and op["writeback"] and op["modify"]))
        if outstanding and changes:
            return index + 1
        if name == "forward":
            outstanding = True
            kept += op["mode"] == "keep"
        if name in ("train_step", "no_sync_step") or (name == "backward" and kept):
            outstanding = False
        if name == "backward" and kept:
            kept -= 1
    return None


def _backward_after_later_forward(example):
    """The index of the first op (in the outcomes) from which torch is no oracle, or None.
    Two forwards before the first one's backward (torch's "two forwards before one
    backward"; here a kept forward whose backward op comes after another forward with grad):
    torch 2.13's FSDP1 has freed the unsharded storage that the first forward's graph saved,
    so that backward raises "setStorage: ... out of bounds for storage of size 0" under
    FULL_SHARD and SHARD_GRAD_OP, and under NO_SHARD it leaves gradients 55 % off the same
    micro-batches run as two train steps; dptc's gradients equal those of the two train steps
    (measured, within 2e-16)."""
    kept = []
    for index, op in enumerate(example["ops"]):
        name = op["op"]
        if name in ("train_step", "no_sync_step") or (name == "forward"
                                                      and op["mode"] != "no_grad"):
            kept = [True] * len(kept)
        if name == "forward" and op["mode"] == "keep":
            kept.append(False)
        if name == "backward" and kept and kept.pop():
            return index + 1
    return None


def _mixed_precision_no_shard_accumulation(example):
    """The index of the first op (in the outcomes) from which torch is no oracle, or None.
    Under MixedPrecision and NO_SHARD, torch 2.13's FSDP1 accumulates a no_sync() backward
    into an existing gradient with a rounding the same backward does not get without one:
    train_step, zero_grad(set_to_none=False), no_sync train step, train_step leaves its
    gradients 3e-3 away from the same sequence with zero_grad(set_to_none=True) (adding to
    zeros should change nothing), where dptc's two are bit-identical, and equal to torch's
    second.  Cut at a no_sync step that meets gradients left by an earlier backward or
    zero_grad(set_to_none=False)."""
    config = example["config"]
    if not (config["mp"] and config["strategy"] == "NO_SHARD"):
        return None
    grads = False
    kept = 0
    for index, op in enumerate(example["ops"]):
        name = op["op"]
        if name == "no_sync_step" and grads:
            return index + 1
        if name in ("train_step", "no_sync_step") or (name == "backward" and kept):
            grads = True
        if name == "zero_grad":
            grads = not op["set_to_none"]
        if name == "forward" and op["mode"] == "keep":
            kept += 1
        if name == "backward" and kept:
            kept -= 1
    return None


def _frozen_unsynced_gradients(example):
    """The index of the first op (in the outcomes) from which torch is no oracle, or None.
    After a backward under no_sync(), torch 2.13's FSDP1 gives the frozen parameters
    (requires_grad=False, block 0's norm) gradients, under every strategy: the views of the
    flat parameter's unsharded gradient, which covers them too; clip_grad_norm_ counts them
    (no_sync_step, clip_grad_norm_ under NO_SHARD: 1.1054 on rank 0 where dptc's, without
    them, is 1.0942) and summon_full_params(with_grads=True) shows them.  A frozen parameter
    has no gradient, as in one process.  And zero_grad does not clear the gradient torch's
    accumulated under no_sync() for an instance that holds a frozen parameter: no_sync_step,
    zero_grad(set_to_none=True), train_step, optim_step under FULL_SHARD leaves block 0's
    parameters 3.7 % off torch's own train_step, optim_step, where dptc's two are
    bit-identical.  Cut at the first op after a no_sync step that reads gradients or clears
    them."""
    if not example["config"]["frozen"]:
        return None
    unsynced = False
    for index, op in enumerate(example["ops"]):
        name = op["op"]
        if unsynced and (name in ("clip_grad_norm", "zero_grad")
                         or (name == "summon" and op["grads"])):
            return index + 1
        unsynced = unsynced or name == "no_sync_step"
    return None


TORCH_WRONG = [_mixed_precision_interleaved, _change_after_forward,
               _backward_after_later_forward, _mixed_precision_no_shard_accumulation,
               _frozen_unsynced_gradients]


def _until_torch_limit(example, result):
    """The rank result with both implementations' outcomes cut before the op where torch
    raised one of TORCH_LIMITS, if it did, or where one of TORCH_WRONG says torch's values
    stop being an oracle."""
    cut = min([len(result["torch"])] + [c for c in (wrong(example) for wrong in TORCH_WRONG)
                                         if c is not None])
    for index, outcome in enumerate(result["torch"][:cut]):
        if not outcome["ok"] and any(text in outcome["error"] for text, _ in TORCH_LIMITS):
            cut = index
            break
    if cut >= len(result["torch"]):
        return result
    return {impl: result[impl][:cut] for impl in ("torch", "dptc")}


def _frozen_gradients(example, result):
    """summon_full_params(with_grads=True) shows a frozen parameter's gradient as zeros
    under torch's FSDP1 (a view of the flat parameter's gradient, which covers the frozen
    parameters of its instance too) and as None under dptc's, as in one process (a
    parameter with requires_grad=False has no gradient).  torch's zeros become None here,
    for the frozen parameters (block 0's norm) only."""
    if not example["config"]["frozen"]:
        return result
    for outcome in result["torch"]:
        if outcome["ok"] and outcome["op"] == "summon" and outcome["value"]:
            for key, value in outcome["value"].items():
                if (key.startswith("g.") and "blocks.0.norm." in key and value is not None
                        and not any(value)):
                    outcome["value"][key] = None
    return result


# Differences in values judged acceptable and made to agree before comparing, each with its
# reason in the docstring: (example, rank result) -> rank result.
NORMALISE = [_frozen_gradients]


# dptc findings reported and not yet fixed: DPTC_FUZZ_SKIP=<name> passes the examples where
# the predicate (example -> bool) holds, to look past them (a long run).  None is open: the
# three this fuzzer found (gradients accumulated under no_sync() hidden from .grad,
# clip_grad_norm_ and zero_grad; NO_SHARD's full state dict aliasing the parameters;
# clip_grad_norm_ after a forward leaving out the units it left unsharded) are fixed, and
# their minimal sequences are EXPLICIT examples.
KNOWN_FINDINGS = {}


def _check(servers, example):
    skip = _fuzz.skipped_from_env()
    if any(known(example) for name, known in KNOWN_FINDINGS.items() if name in skip):
        return
    results = servers.run(example)
    if any(all(allowed(example, result) for result in results) for allowed in ALLOWED):
        return
    for normalise in NORMALISE:
        results = [normalise(example, result) for result in results]
    results = [_until_torch_limit(example, result) for result in results]
    problems = _fuzz.compare(results, TOLERANCE[example["config"]["dtype"]])
    if problems:
        raise _fuzz.disagreement(problems, results)


# The minimal sequences of the findings fixed so far, run first in every run (as explicit
# examples: each once, outside hypothesis), so that CI checks them whatever the search draws.
_PLAIN = {"seed": 0, "dtype": "float64", "input": "embedding", "blocks": 2, "wrap": "policy",
          "strategy": "FULL_SHARD", "frozen": False, "mp": False, "optim": "sgd"}
EXPLICIT = [
    {"config": _PLAIN,
     "ops": [{"op": "no_sync_step", "seed": 0}, {"op": "zero_grad", "set_to_none": True},
             {"op": "train_step", "seed": 1},
             {"op": "summon", "writeback": False, "grads": True, "modify": False}]},
    {"config": {**_PLAIN, "strategy": "NO_SHARD"},
     "ops": [{"op": "train_step", "seed": 0}, {"op": "state_dict", "kind": "full"},
             {"op": "optim_step"}, {"op": "load_state_dict", "which": 0}]},
    {"config": {**_PLAIN, "dtype": "float32"},
     "ops": [{"op": "train_step", "seed": 0}, {"op": "forward", "seed": 0, "mode": "no_grad"},
             {"op": "clip_grad_norm", "max_norm": 0.1},
             {"op": "summon", "writeback": False, "grads": True, "modify": False}]},
    {"config": {**_PLAIN, "dtype": "float32"},
     "ops": [{"op": "no_sync_step", "seed": 0}, {"op": "clip_grad_norm", "max_norm": 0.1},
             {"op": "train_step", "seed": 1}]},
    {"config": {**_PLAIN, "strategy": "NO_SHARD"},
     "ops": [{"op": "train_step", "seed": 0}, {"op": "no_sync_step", "seed": 1},
             {"op": "clip_grad_norm", "max_norm": 0.1}, {"op": "zero_grad", "set_to_none": False},
             {"op": "train_step", "seed": 2}]},
]


def test_fuzz_fsdp1_matches_torch():
    """CI_EXAMPLES generated sequences (DPTC_FUZZ_EXAMPLES / DPTC_FUZZ_SECONDS for more) and
    the EXPLICIT ones: no crash, no hang, and every sequence raises in both implementations
    or ends with the same losses, gradient norms and parameters."""
    _fuzz.run_fuzz_test("fsdp1", TARGET, WORLD_SIZE, examples(), _check,
                        ci_examples=CI_EXAMPLES, explicit=EXPLICIT,
                        example_timeout=EXAMPLE_TIMEOUT_S)
