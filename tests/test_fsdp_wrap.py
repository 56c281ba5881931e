"""Wrap policies driving fully_shard, and activation checkpointing (full and selective).

Layers: no process group (which modules a policy selects, against the modules torch's own
auto-wrapping picks; selective checkpointing on one process), then one launch of 2 ranks each
for the policies and for checkpointing composed with fully_shard and DDP
(tests/workers_fsdp_wrap.py), against single-process training in float64.
"""

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp.wrap import _recursive_wrap
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from torch.utils._python_dispatch import TorchDispatchMode

import dptc
from examples.gpt import GPT, Block
from tests._launch import run_ranks
from tests.workers_fsdp_wrap import build

FLOAT64_TOLERANCE = 1e-10
LAUNCH_TIMEOUT_S = 240


def _names(model, modules):
    by_module = {m: name for name, m in model.named_modules()}
    return [by_module[m] for m in modules]


def _torch_choice(model, policy):
    """The modules torch's FullyShardedDataParallel auto-wraps below the root for a policy
    function, recorded by a wrapper that wraps nothing (its own _recursive_wrap)."""
    chosen = []

    def record(module, **kwargs):
        chosen.append(module)
        return module
    _recursive_wrap(model, auto_wrap_policy=policy, wrapper_cls=record, ignored_modules=set(),
                    ignored_params=set(), only_wrap_children=True)
    return chosen


POLICIES = {
    "transformer": functools.partial(dptc.transformer_auto_wrap_policy,
                                     transformer_layer_cls={Block}),
    "size": functools.partial(dptc.size_based_auto_wrap_policy, min_num_params=5000),
    "size_small": functools.partial(dptc.size_based_auto_wrap_policy, min_num_params=500),
    "lambda": functools.partial(dptc.lambda_auto_wrap_policy,
                                lambda_fn=lambda m: isinstance(m, nn.Linear)),
    "always": dptc.always_wrap_policy,
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_functions_choose_torchs_units(name):
    """A policy function selects, children first, exactly the modules torch's auto-wrapping
    wraps with it (the root apart, which fully_shard_by_policy shards last)."""
    model = build()
    mine = list(dptc.policy_targets(model, POLICIES[name]))
    theirs = _torch_choice(model, POLICIES[name])
    assert _names(model, mine) == _names(model, theirs)
    assert mine, "the policy selected nothing: the comparison would be empty"
    if name == "transformer":
        assert _names(model, mine) == ["blocks.0", "blocks.1", "blocks.2"]


def test_policy_classes_choose_their_modules():
    """ModuleWrapPolicy selects every instance of its classes; CustomPolicy every module its
    function returns True or a dict for, with the dict as the module's overrides."""
    model = build()
    assert _names(model, dptc.policy_targets(model, dptc.ModuleWrapPolicy({Block}))) == \
        ["blocks.0", "blocks.1", "blocks.2"]
    custom = dptc.CustomPolicy(lambda m: {"reshard_after_forward": False}
                               if m is model.blocks[2] else isinstance(m, nn.LayerNorm))
    targets = dptc.policy_targets(model, custom)
    names = dict(zip(_names(model, targets), targets.values()))
    assert names["blocks.2"] == {"reshard_after_forward": False}
    assert sum(v == {} for v in names.values()) == 7  # 2 LayerNorms x 3 blocks + ln_f


def test_policy_must_be_a_policy():
    with pytest.raises(TypeError, match="policy must be a wrap policy"):
        dptc.policy_targets(build(), "blocks")


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                    torch.ops.aten.bmm.default):
            self.mm += 1
        return func(*args, **(kwargs or {}))


def _backward_mms(wrap):
    torch.manual_seed(3)
    model = build()
    if wrap is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = wrap(block)
    idx = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(4))
    loss = GPT.loss(model(idx[:, :-1]), idx[:, 1:])
    with _CountMM() as counter:
        loss.backward()
    return counter.mm, [p.grad.clone() for p in model.parameters()]


def test_selective_checkpointing_saves_chosen_ops():
    """Selective activation checkpointing through torch's create_selective_checkpoint_contexts
    (see README): wrapping each block with checkpoint_wrapper(..., context_fn=...) that saves
    matrix products recomputes none of them in backward, where full checkpointing recomputes
    every one; the gradients are identical to no checkpointing in all three."""
    save_matmuls = functools.partial(
        create_selective_checkpoint_contexts,
        [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default])
    plain, grads = _backward_mms(None)
    full, full_grads = _backward_mms(lambda b: dptc.checkpoint_wrapper(b))
    selective, selective_grads = _backward_mms(
        lambda b: dptc.checkpoint_wrapper(b, context_fn=save_matmuls))
    assert full > plain, (full, plain)            # full checkpointing redoes the products
    assert selective == plain, (selective, plain)  # selective saved them
    for a, b, c in zip(grads, full_grads, selective_grads):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_fully_shard_by_policy_trains():
    """fully_shard_by_policy at 2 ranks: the units each policy makes (the root last), a
    CustomPolicy's override on its module, and parameters after 2 AdamW steps against the
    single-process reference; also fully_shard of a list of modules (one unit)."""
    results = run_ranks("tests.workers_fsdp_wrap:policy_case", 2, timeout=LAUNCH_TIMEOUT_S)
    for result in results:
        blocks = ["<root>", "blocks.0", "blocks.1", "blocks.2"]
        assert result["transformer"]["units"] == blocks
        assert result["module"]["units"] == blocks
        assert result["custom"]["units"] == blocks
        assert result["custom"]["reshard_after_forward"] == [True, False, True]
        assert "<root>" in result["size"]["units"] and len(result["size"]["units"]) > 1
        # fully_shard([blocks[0], blocks[1]]): both modules share one unit.
        assert result["list"]["units"] == blocks and result["list"]["shared_state"]
        for name, outcome in result.items():
            assert outcome["ref_rel"] <= FLOAT64_TOLERANCE, (name, outcome)


def test_activation_checkpointing_composes():
    """Activation checkpointing on every block (torch's checkpoint_wrapper, NO_REENTRANT),
    under fully_shard and under DDP: the same parameters as the reference after 2 AdamW steps,
    the same state-dict keys (no _checkpoint_wrapped_module.), and a lower allocation peak in
    one forward+backward of an 8-layer model than without it (torch's profiler; measured:
    fully_shard 9.4 MiB against 19.2, DDP 20.7 against 26.1, where the gradients and buckets
    of the whole model, which checkpointing does not touch, take most of the peak)."""
    results = run_ranks("tests.workers_fsdp_wrap:checkpointing_case", 2,
                        timeout=LAUNCH_TIMEOUT_S)
    for result in results:
        for name, outcome in result.items():
            assert outcome["ref_rel"] <= FLOAT64_TOLERANCE, (name, outcome)
            assert outcome["wrapped_keys"] == 0 and outcome["keys_equal_reference"], name
        for kind, bound in (("fsdp", 0.7), ("ddp", 0.9)):
            plain, ac = result[f"{kind}_plain"]["peak"], result[f"{kind}_ac"]["peak"]
            assert ac < bound * plain, (kind, ac, plain)
