"""Wrap policies and activation checkpointing: torch's, importable from dptc, and the policies
driving fully_shard.

The policy functions and classes, ``enable_wrap``/``wrap`` and the activation-checkpointing
helpers are torch's own (``torch.distributed.fsdp.wrap``,
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``), so a script's policies mean
exactly what they mean to torch.  ``fully_shard_by_policy`` is dptc's: it applies
``fully_shard`` bottom-up wherever a policy says, then to the root, choosing the same modules
FullyShardedDataParallel's ``auto_wrap_policy`` would wrap.
"""

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp.wrap import (CustomPolicy, ModuleWrapPolicy, _Policy,
                                         always_wrap_policy, enable_wrap,
                                         lambda_auto_wrap_policy, size_based_auto_wrap_policy,
                                         transformer_auto_wrap_policy, wrap)

from ._fully_shard import FSDPModule, fully_shard

__all__ = ["fully_shard_by_policy", "policy_targets", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "lambda_auto_wrap_policy", "ModuleWrapPolicy",
           "CustomPolicy", "always_wrap_policy", "enable_wrap", "wrap", "checkpoint_wrapper",
           "apply_activation_checkpointing", "CheckpointImpl", "CheckpointWrapper"]


def _callable_targets(root, policy, ignored_params):
    """The modules a policy function (module, recurse, nonwrapped_numel) -> bool selects,
    children before parents, the root excluded: a module is asked with recurse=True whether to
    look inside it, and after its children with recurse=False whether the parameters they did
    not take (nonwrapped_numel) make it a unit itself."""
    chosen = []

    def visit(module):
        total = sum(p.numel() for p in module.parameters() if p not in ignored_params)
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return 0
        covered = sum(visit(child) for child in module.children())
        if module is not root and policy(module=module, recurse=False,
                                         nonwrapped_numel=total - covered):
            chosen.append(module)
            return total
        return covered

    visit(root)
    return {module: {} for module in chosen}


def _post_order(root):
    for child in root.children():
        yield from _post_order(child)
    yield root


def policy_targets(model, policy, ignored_params=()):
    """{module: fully_shard kwargs overrides} for the modules below the root that ``policy``
    makes units, in the order fully_shard must be applied (children first)."""
    if isinstance(policy, _Policy):
        targets = policy._run_policy(model, set(), {})
    elif callable(policy):
        targets = _callable_targets(model, policy, set(ignored_params))
    else:
        raise TypeError(f"policy must be a wrap policy (a callable such as "
                        f"functools.partial(transformer_auto_wrap_policy, ...), or a "
                        f"ModuleWrapPolicy / CustomPolicy), got {policy!r}")
    return {module: dict(targets[module]) for module in _post_order(model)
            if module in targets and module is not model}


def fully_shard_by_policy(model, policy, **fully_shard_kwargs):
    """Applies ``fully_shard`` to every module ``policy`` selects, bottom-up, then to
    ``model`` itself; returns ``model``.  ``policy`` is any of torch's wrap policies, in the
    form FullyShardedDataParallel's ``auto_wrap_policy`` takes (for example
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``);
    a CustomPolicy's dictionaries override ``fully_shard_kwargs`` for their modules."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(model).__name__}; "
                         f"fully_shard_by_policy shards a model that is not sharded yet")
    ignored = fully_shard_kwargs.get("ignored_params") or ()
    for module, overrides in policy_targets(model, policy, ignored).items():
        fully_shard(module, **{**fully_shard_kwargs, **overrides})
    return fully_shard(model, **fully_shard_kwargs)
