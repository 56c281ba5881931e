"""Rank side of tests/test_fuzz_fsdp1.py: a rank server (tests/_fuzz.py) that runs each fuzzed
sequence of public FullyShardedDataParallel (FSDP1) calls on torch's FSDP1 (on gloo,
device_id="cpu", the oracle) and on dptc's, side by side in this process, and reports what
every op returned or raised.

An example is {"config": {...}, "ops": [{"op": name, ...}, ...]} (see tests/test_fuzz_fsdp1.py
for the strategy).  For each implementation, torch's first, the rank:
- builds the model from config["seed"] (the same initial parameters everywhere): an input
  layer `inp` (an Embedding of VOCAB tokens, or a Linear of IN features: config["input"]),
  `blocks` blocks of LayerNorm + Linear (a residual), and a Linear `head` to CLASSES logits,
  in config["dtype"], with block 0's norm frozen (`frozen`);
- wraps it with FullyShardedDataParallel (use_orig_params=True, device_id="cpu", the config's
  sharding_strategy and, with config["mp"], MixedPrecision(param_dtype=bfloat16,
  reduce_dtype=float32)): config["wrap"] "policy" (auto_wrap_policy=ModuleWrapPolicy({Block})),
  "manual" (every block wrapped by hand, then the root), "manual_head" (the blocks and the
  head by hand, then the root) or "root" (one instance); then makes the optimizer (SGD with
  momentum or AdamW) over the trainable parameters, after wrapping: the op "setup";
- runs the ops in order, stopping at the first that raises.
Each op's outcome is {"op": name, "ok": true, "value": ...} or {"op": name, "ok": false,
"error": "Type: message"}: losses and gradient norms as floats, full parameters (and
gradients) as {name: flat list}; a SHARDED_STATE_DICT as {key: global shape}.  The sequence
ends with the op "final", which reads every parameter in full (summon_full_params,
writeback=False).  Data comes from each op's seed and this rank (every rank draws different
rows).

After dptc raised (past "setup"), its model goes on with the rest of the sequence, compared
no more: a raise in any call must leave a process that can go on without crashing or
hanging.
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import _fuzz

__all__ = ["serve", "run_example", "IMPLS"]

IMPLS = ("torch", "dptc")
DIM = 8
IN = 5
VOCAB = 12
CLASSES = 6
BATCH = 3
SEQ = 4
PREFIX = "_fsdp_wrapped_module."


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.l1 = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.l1(self.norm(x)))


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = config["input"] == "embedding"
        self.inp = nn.Embedding(VOCAB, DIM) if self.embedding else nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(config["blocks"]))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _api(impl):
    """(FullyShardedDataParallel, torch.distributed.fsdp): dptc's class or torch's; the enums
    and configs are torch's own either way."""
    import torch.distributed.fsdp as fsdp
    if impl == "dptc":
        import dptc
        return dptc.FullyShardedDataParallel, fsdp
    return fsdp.FullyShardedDataParallel, fsdp


def _build(config):
    torch.manual_seed(config["seed"])
    model = Model(config).to(getattr(torch, config["dtype"]))
    if config["frozen"]:
        model.blocks[0].norm.requires_grad_(False)
    return model


def _wrap(model, impl, config):
    FSDP, fsdp = _api(impl)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    kwargs = {"sharding_strategy": getattr(fsdp.ShardingStrategy, config["strategy"]),
              "use_orig_params": True, "device_id": "cpu"}
    if config["mp"]:
        kwargs["mixed_precision"] = fsdp.MixedPrecision(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    if config["wrap"] == "policy":
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)
    else:
        if config["wrap"] in ("manual", "manual_head"):
            for i in range(len(model.blocks)):
                model.blocks[i] = FSDP(model.blocks[i], **kwargs)
        if config["wrap"] == "manual_head":
            model.head = FSDP(model.head, **kwargs)
        wrapped = FSDP(model, **kwargs)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    if config["optim"] == "sgd":
        return wrapped, torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return wrapped, torch.optim.AdamW(params, lr=1e-2)


def _data(seed, rank, config):
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    if config["input"] == "embedding":
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        y = torch.randint(0, CLASSES, (BATCH, SEQ), generator=generator)
    else:
        x = torch.randn(BATCH, IN, generator=generator, dtype=torch.float64)
        x = x.to(getattr(torch, config["dtype"]))
        y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    return x, y


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, CLASSES).float(), y.reshape(-1))


def _clean(name):
    return name.replace(PREFIX, "")


def _flat(tensor):
    return tensor.detach().double().flatten().tolist()


def _summon_read(model, FSDP, grads):
    """{"p.<name>": flat list[, "g.<name>": flat list or None]} of every full parameter
    (names as named_parameters() gives them inside summon_full_params)."""
    out = {}
    with FSDP.summon_full_params(model, writeback=False, with_grads=grads):
        for name, p in model.named_parameters():
            out[f"p.{name}"] = _flat(p)
            if grads:
                out[f"g.{name}"] = None if p.grad is None else _flat(p.grad)
    return out


def _state_type(fsdp, kind):
    if kind == "full":
        return (fsdp.StateDictType.FULL_STATE_DICT,
                fsdp.FullStateDictConfig(offload_to_cpu=False, rank0_only=False))
    return fsdp.StateDictType.SHARDED_STATE_DICT, fsdp.ShardedStateDictConfig()


def _describe_sharded(value):
    """The global shape of a SHARDED_STATE_DICT value (compared with its key).  Its type is
    not: torch's are ShardedTensors, dptc's DTensors (README), and under NO_SHARD torch's are
    plain tensors where dptc's are DTensors replicated over the group (shards of one rank)."""
    return list(value.shape)


def _apply(op, impl, model, optimizer, rank, config, held):
    """Runs one op; returns its JSON-able value.  `held` keeps what an op leaves for later
    ones: "losses" (forwards whose backward is still to come), "states" (state dicts taken,
    with their kind)."""
    FSDP, fsdp = _api(impl)
    name = op["op"]
    if name == "train_step":
        x, y = _data(op["seed"], rank, config)
        loss = _loss(model(x), y)
        loss.backward()
        return loss.item()
    if name == "no_sync_step":
        x, y = _data(op["seed"], rank, config)
        with model.no_sync():
            loss = _loss(model(x), y)
            loss.backward()
        return loss.item()
    if name == "forward":
        x, y = _data(op["seed"], rank, config)
        return _fuzz.forward_op(op["mode"], lambda: _loss(model(x), y), held)
    if name == "backward":
        if held["losses"]:             # the latest kept forward's; nothing without one
            held["losses"].pop().backward()
        return None
    if name == "summon":
        out = {}
        with FSDP.summon_full_params(model, writeback=op["writeback"],
                                     with_grads=op["grads"]):
            for pname, p in model.named_parameters():
                out[f"p.{pname}"] = _flat(p)
                if op["grads"]:
                    out[f"g.{pname}"] = None if p.grad is None else _flat(p.grad)
            if op["modify"] and op["writeback"]:
                with torch.no_grad():  # the same change on every rank
                    for p in model.parameters():
                        p.mul_(0.5).add_(0.125)
        return out
    if name == "state_dict":
        kind = op["kind"]
        with FSDP.state_dict_type(model, *_state_type(fsdp, kind)):
            state = model.state_dict()
        held["states"].append((kind, state))
        if kind == "full":
            return {key: _flat(value) for key, value in state.items()}
        return {key: _describe_sharded(value) for key, value in state.items()}
    if name == "load_state_dict":
        if not held["states"]:         # nothing taken yet: nothing to load
            return None
        kind, state = held["states"][op["which"] % len(held["states"])]
        with FSDP.state_dict_type(model, *_state_type(fsdp, kind)):
            incompatible = model.load_state_dict(state)
        return {"missing": sorted(incompatible.missing_keys),
                "unexpected": sorted(incompatible.unexpected_keys)}
    if name == "clip_grad_norm":
        norm = model.clip_grad_norm_(op["max_norm"])
        return float(norm)
    if name == "zero_grad":
        optimizer.zero_grad(set_to_none=op["set_to_none"])
        return None
    if name == "optim_step":
        optimizer.step()
        return None
    raise ValueError(f"unknown op {name!r}")


def _final(impl, model):
    return _summon_read(model, _api(impl)[0], grads=False)


def run_example(example, note):
    """{impl: [outcome per op]} for this rank (see the module docstring)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    config = example["config"]

    def setup(impl):
        model, optimizer = _wrap(_build(config), impl, config)
        return {"model": model, "optimizer": optimizer, "held": {"losses": [], "states": []}}

    def apply(impl, state, op):
        return _apply(op, impl, state["model"], state["optimizer"], rank, config,
                      state["held"])

    def final(impl, state):
        return _final(impl, state["model"])

    return _fuzz.run_impls(example, note, setup, apply, final, IMPLS)


def serve(directory):
    """The rank server for this module's examples (tests/_fuzz.py's serve_torch_and_dptc)."""
    return _fuzz.serve_torch_and_dptc(directory, run_example)
