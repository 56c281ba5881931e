"""Rank side of tests/test_fuzz_fsdp.py: a rank server (tests/_fuzz.py) that runs each fuzzed
sequence of public fully_shard calls on torch's fully_shard (on gloo, the oracle) and on
dptc's, side by side in this process, and reports what every op returned or raised.

An example is {"config": {...}, "ops": [{"op": name, ...}, ...]} (see tests/test_fuzz_fsdp.py
for the strategy), with "impls": ["dptc"] to run dptc's alone (after torch's crashed or hung
on it).  For each implementation, torch's first, the rank:
- builds the model from config["seed"] (the same initial parameters everywhere): an
  embedding, `blocks` blocks of Linear + RMSNorm, a final RMSNorm `norm` and an `lm_head`
  Linear without bias, optionally tied to the embedding (`tie`) and with block 0's norm frozen
  (`frozen`);
- shards it: with config["emb_unit"] the embedding alone (a unit whose parameter backward
  does not need: the one unit set_unshard_in_backward(False) is valid for), every block
  (reshard_after_forward=config["block_raf"] where not None), then
  the multi-module unit config["head"] with reshard_after_forward=config["head_raf"]:
  "norm_head" fully_shard([model.norm, model.lm_head]), "emb_norm_head" the same with the
  embedding first (a unit whose modules run at both ends of the forward; a tied lm_head
  lies in it), None none; then the root; and makes the optimizer (SGD with momentum or
  AdamW) over the trainable parameters: the op "setup";
- runs the ops in order, stopping at the first that raises.
Each op's outcome is {"op": name, "ok": true, "value": ...} or {"op": name, "ok": false,
"error": "Type: message"}: losses and gradient norms as floats, parameters (and gradients, and
state_dict() values) as {name: flat list} of full tensors.  The sequence ends with the op
"final", which reads every parameter and gradient in full.  Data comes from each op's seed
and this rank (every rank draws different rows).

After dptc raised (past "setup"), its model goes on with the rest of the sequence, compared
no more: an exception in the middle of a forward (the op "bad_forward") or any other call
must leave a process that can go on without crashing or hanging.

The chunked train step is torchtitan's chunked loss: the model forward stops at `norm`; the
head unit is unsharded by hand with resharding and gradient sync off, runs the loss chunk by
chunk (gradient sync back on for the last chunk), is resharded, and the hidden states'
gradient is back-propagated into the rest of the model.
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import _fuzz

__all__ = ["serve", "run_example", "IMPLS", "VOCAB", "SEQ", "BATCH"]

IMPLS = ("torch", "dptc")
DIM = 8
VOCAB = 16
BATCH = 2
SEQ = 6         # divisible into 1, 2 or 3 chunks


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim)

    def forward(self, x):
        return x + self.l1(self.norm(x))


class Model(nn.Module):
    def __init__(self, dim, vocab, blocks):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, head=True):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        return self.lm_head(h) if head else h


def _fsdp(impl):
    if impl == "dptc":
        import dptc
        return dptc
    import torch.distributed.fsdp as fsdp
    return fsdp


def _build(config):
    torch.manual_seed(config["seed"])
    model = Model(DIM, VOCAB, config["blocks"]).to(getattr(torch, config["dtype"]))
    if config["tie"]:
        model.lm_head.weight = model.emb.weight
    if config["frozen"]:
        model.blocks[0].norm.requires_grad_(False)
    return model


def _shard(model, impl, config):
    fully_shard = _fsdp(impl).fully_shard
    block_kwargs = ({} if config["block_raf"] is None
                    else {"reshard_after_forward": config["block_raf"]})
    if config["emb_unit"]:
        fully_shard(model.emb)
    for block in model.blocks:
        fully_shard(block, **block_kwargs)
    if config["head"]:
        modules = [model.norm, model.lm_head]
        if config["head"] == "emb_norm_head":
            modules.insert(0, model.emb)
        fully_shard(modules, reshard_after_forward=config["head_raf"])
    fully_shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if config["optim"] == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def _units(model):
    """The modules an op may address by name: the blocks, the head unit's modules (one
    unit: any of their names reaches it; without that unit they are plain modules of the
    root's) and the root."""
    units = {f"block{i}": block for i, block in enumerate(model.blocks)}
    units.update(emb=model.emb, norm=model.norm, head=model.lm_head, root=model)
    return units


def _full(tensor):
    """The full value of a parameter or gradient: DTensors gathered, plain tensors as they
    are (a unit that is unsharded shows its unsharded parameters)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _read(model, grads):
    """{"p.<name>": flat list, ..., "kind.<name>": "DTensor" | "Tensor"[, "g.<name>": flat
    list or None]} of every parameter."""
    out = {}
    for name, p in model.named_parameters():
        out[f"kind.{name}"] = type(p).__name__ if type(p).__name__ == "DTensor" else "Tensor"
        out[f"p.{name}"] = _full(p.detach()).double().flatten().tolist()
        if grads:
            out[f"g.{name}"] = (None if p.grad is None
                                else _full(p.grad).double().flatten().tolist())
    return out


def _data(seed, rank):
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, targets


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _chunked_step(model, tokens, targets, chunks):
    """torchtitan's chunked loss (see the module docstring); the loss summed over chunks."""
    h = model(tokens, head=False)
    hd = h.detach().requires_grad_(True)
    lm = model.lm_head
    lm.set_reshard_after_forward(False)
    lm.set_reshard_after_backward(False)
    lm.set_requires_gradient_sync(False, recurse=False)
    lm.unshard()
    total = 0.0
    pieces = list(zip(hd.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)))
    for i, (piece, target) in enumerate(pieces):
        if i == len(pieces) - 1:
            lm.set_requires_gradient_sync(True, recurse=False)
        loss = _loss(lm(piece), target) / len(pieces)
        loss.backward()
        total += loss.item()
    lm.set_reshard_after_forward(True)
    lm.set_reshard_after_backward(True)
    lm.reshard()
    h.backward(hd.grad)
    return total


def _apply(op, model, optimizer, rank, held):
    """Runs one op; returns its JSON-able value.  `held` keeps what an op leaves for later
    ones: "losses" (forwards whose backward is still to come), "handles" (async unshards not
    waited for yet)."""
    name = op["op"]
    units = _units(model)
    if name == "train_step":
        tokens, targets = _data(op["seed"], rank)
        if op["chunks"]:
            return _chunked_step(model, tokens, targets, op["chunks"])
        loss = _loss(model(tokens), targets)
        loss.backward()
        return loss.item()
    if name == "forward":
        tokens, targets = _data(op["seed"], rank)
        return _fuzz.forward_op(op["mode"], lambda: _loss(model(tokens), targets), held)
    if name == "backward":
        if held["losses"]:             # the latest kept forward's; nothing without one
            held["losses"].pop().backward()
        return None
    if name == "unshard":
        handle = units[op["unit"]].unshard(async_op=op["async"])
        if op["async"]:
            if handle is None:
                raise AssertionError("unshard(async_op=True) returned None")
            if op["wait"]:
                handle.wait()
            else:                      # left to the unit's next forward, or "wait_handles"
                held["handles"].append(handle)
        return None
    if name == "wait_handles":
        while held["handles"]:
            held["handles"].pop(0).wait()
        return None
    if name == "reshard":
        units[op["unit"]].reshard()
        return None
    if name in ("set_reshard_after_forward", "set_reshard_after_backward",
                "set_requires_gradient_sync"):
        getattr(units[op["unit"]], name)(op["value"], recurse=op["recurse"])
        return None
    if name == "set_is_last_backward":
        units[op["unit"]].set_is_last_backward(op["value"])
        return None
    if name == "set_prefetch":
        method = f"set_modules_to_{op['kind']}_prefetch"
        getattr(units[op["unit"]], method)([units[target] for target in op["targets"]])
        return None
    if name == "bad_forward":          # raises inside the forward, or in the loss after it
        tokens, targets = _data(op["seed"], rank)
        if op["where"] == "embedding":
            tokens = tokens + VOCAB
        else:
            targets = targets + VOCAB
        return _loss(model(tokens), targets).item()
    if name == "reset_iter_state":
        units[op["unit"]].reset_iter_state()
        return None
    if name in ("set_force_sum_reduction_for_comms", "set_unshard_in_backward",
                "set_gradient_divide_factor"):
        getattr(units[op["unit"]], name)(op["value"])
        return None
    if name == "set_reduce_scatter_unused_params":
        units[op["unit"]].set_reduce_scatter_unused_params(op["value"], recurse=op["recurse"])
        return None
    if name == "state_dict":
        return {key: _full(value).double().flatten().tolist()
                for key, value in model.state_dict().items()}
    if name == "full_params":
        return _read(model, grads=op["grads"])
    if name == "zero_grad":
        optimizer.zero_grad(set_to_none=op["set_to_none"])
        return None
    if name == "optim_step":
        optimizer.step()
        return None
    if name == "clip_grad_norm":
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, op["max_norm"])
        return _full(norm).item()
    raise ValueError(f"unknown op {name!r}")


def run_example(example, note):
    """{impl: [outcome per op]} for this rank (see the module docstring); example["impls"]
    may name one implementation alone (dptc's, where torch's own run crashed or hung)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    config = example["config"]

    def setup(impl):
        model = _build(config)
        optimizer = _shard(model, impl, config)
        return {"model": model, "optimizer": optimizer, "held": {"losses": [], "handles": []}}

    def apply(impl, state, op):
        return _apply(op, state["model"], state["optimizer"], rank, state["held"])

    def final(impl, state):
        return _read(state["model"], grads=True)

    return _fuzz.run_impls(example, note, setup, apply, final, example.get("impls", IMPLS))


def serve(directory):
    """The rank server for this module's examples (tests/_fuzz.py's serve_torch_and_dptc)."""
    return _fuzz.serve_torch_and_dptc(directory, run_example)
