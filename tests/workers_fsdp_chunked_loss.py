"""Rank-side bodies of tests/test_fsdp_chunked_loss.py: torchtitan's chunked loss over a unit of
two modules, and what a freed unsharded parameter does when something reads it.

- ``chunked_loss_case`` trains a small Llama-shaped model (token embedding, blocks of RMSNorm +
  SiLU MLP, a final ``norm`` and the ``output`` head) with each block a unit, then
  ``fully_shard([model.norm, model.output], reshard_after_forward=False)``, then the root, as
  torchtitan 0.3.0 shards Llama 3.  Each step's loss is torchtitan's chunked cross-entropy
  (components/loss.py): the model's forward ends at ``norm``; the head's unit is unsharded
  explicitly, each chunk of the detached hidden states goes through ``output`` with a backward
  of its own (gradient sync on the last chunk only), the unit is resharded explicitly, and the
  hidden states' gradient is backpropagated through the model.  The same calls run against
  dptc's fully_shard and torch's, in the same process (torch's on the gloo group dptc set up),
  from the same initial weights; the result holds both implementations' losses and trained
  parameters.
- ``freed_parameter_case`` takes a unit's unsharded parameter while it is gathered, reshards the
  unit, and reads the parameter: directly, and through a backward whose pre-backward gather
  was removed.  Each must raise RuntimeError (the process survives), never read freed memory.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["chunked_loss_case", "freed_parameter_case"]

SEED = 4321
VOCAB = 32
DIM = 16
LAYERS = 2
SEQ = 8
BATCH = 2
STEPS = 4
LR = 1e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class Llama(nn.Module):
    """Ends at the final norm, as torchtitan's model does when its loss is chunked."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def _fsdp(impl):
    if impl == "dptc":
        from dptc import MixedPrecisionPolicy, checkpoint_wrapper, fully_shard
    else:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy, checkpoint_wrapper


def _build(impl, bf16, checkpointing):
    fully_shard, MixedPrecisionPolicy, checkpoint_wrapper = _fsdp(impl)
    torch.manual_seed(SEED)
    model = Llama()
    if checkpointing:
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard([model.norm, model.output], reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _chunked_loss(model, hidden, targets, chunks):
    """torchtitan's chunked cross-entropy: returns the loss; leaves hidden's gradient
    backpropagated through the model."""
    detached = hidden.detach().requires_grad_(True)
    head = model.output                      # the FSDPModule of the [norm, output] unit
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    total = 0.0
    pieces = list(zip(detached.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)))
    for i, (piece, target) in enumerate(pieces):
        if i == len(pieces) - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(piece).float()
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
        loss = loss / targets.numel()
        loss.backward()
        total += loss.item()
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.set_requires_gradient_sync(True, recurse=False)
    head.reshard()
    hidden.backward(detached.grad)
    return total


def _train(impl, rank, bf16, checkpointing, chunks):
    model = _build(impl, bf16, checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(SEED + 100 * step + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        losses.append(_chunked_loss(model, model(tokens), targets, chunks))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    params = {name: p.full_tensor().detach().double().flatten().tolist()
              for name, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def chunked_loss_case(variants):
    """{variant name: {"dptc": {"losses", "params"}, "torch": ...}} for each variant
    (bf16, checkpointing, chunks)."""
    import dptc
    dptc.init_process_group()
    rank = dptc.get_rank()
    result = {}
    for name, (bf16, checkpointing, chunks) in variants.items():
        result[name] = {impl: _train(impl, rank, bf16, checkpointing, chunks)
                        for impl in ("torch", "dptc")}
    dptc.destroy_process_group()
    return result


def _outcome(call):
    try:
        return {"type": None, "message": repr(call())}
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"type": type(error).__name__, "message": str(error)}


def freed_parameter_case():
    """{"held": outcome of reading a parameter taken while gathered, after the reshard,
    "repr": its repr then, "backward": outcome of a backward through a freed parameter,
    "after": losses of a normal step after both (the unit still trains)}."""
    import dptc
    from dptc import fully_shard
    dptc.init_process_group()
    torch.manual_seed(SEED)
    model = Llama()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard([model.norm, model.output], reshard_after_forward=False)
    fully_shard(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    result = {}

    model.output.unshard()
    held = model.output.weight            # the unsharded parameter, a plain tensor now
    model.output.reshard()
    result["held"] = _outcome(lambda: held.sum())
    result["held_shape"] = list(held.shape)
    result["repr"] = repr(held)

    # One module of the unit on its own (its group's forward is incomplete, so nothing hooks
    # its output), then reshard(): the backward reaches the norm's saved weight with nothing
    # to gather it first.  Autograd refuses to unpack it instead of reading freed storage.
    hidden = model(tokens).detach().requires_grad_(True)
    norm_out = model.norm(hidden)                     # saves norm's gathered weight
    model.norm.reshard()
    result["backward"] = _outcome(lambda: norm_out.sum().backward())
    model.reset_iter_state()

    # The model still trains afterwards.
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(model.output(model(tokens)).flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append(loss.item())
    result["after"] = losses
    result["grads"] = all(p.grad is not None for p in model.parameters())
    dptc.destroy_process_group()
    return result
