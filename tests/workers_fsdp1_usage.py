"""Rank-side bodies of tests/test_fsdp1_usage.py: FullyShardedDataParallel as training scripts
use it (torch's FSDP tutorials, accelerate's and Lightning's FSDP plugins), from dptc and from
torch (gloo, device_id="cpu"), each returning what the test compares between the two.
"""

import functools

import torch
from torch import nn

from examples.gpt import Block
from tests.workers_fsdp1 import _api, _policy
from tests.workers_fsdp_wrap import build

__all__ = ["apply_case"]


def _done(impl):
    if impl == "dptc":
        import dptc
        dptc.destroy_process_group()


def _init_weights(module):
    """nanoGPT's and HuggingFace's _init_weights, as scripts pass it to model.apply."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)


def apply_case(impl):
    """model.apply(_init_weights) after wrapping (FULL_SHARD, transformer auto wrap policy,
    float32 GPT), one seed on every rank: whether apply returns the instance, the shapes fn
    saw for each Linear weight, and the full parameters after it, by original name; and the
    same apply on the unwrapped model in this process (the single-process reference)."""
    _, FSDP = _api(impl)
    seen = []

    def init(module):
        if isinstance(module, nn.Linear):
            seen.append(list(module.weight.shape))
        _init_weights(module)

    wrapped = FSDP(build(n_layer=2).float(), device_id="cpu", use_orig_params=True,
                   auto_wrap_policy=functools.partial(_policy(impl),
                                                      transformer_layer_cls={Block}))
    torch.manual_seed(3)
    out = {"returns_self": wrapped.apply(init) is wrapped, "shapes": seen}
    with FSDP.summon_full_params(wrapped, writeback=False):
        out["params"] = {name.replace("_fsdp_wrapped_module.", ""):
                         p.detach().double().flatten().tolist()
                         for name, p in wrapped.named_parameters()}
    single = build(n_layer=2).float()
    torch.manual_seed(3)
    single.apply(_init_weights)
    out["single"] = {name: p.detach().double().flatten().tolist()
                     for name, p in single.named_parameters()}
    _done(impl)
    return out
