"""Rank side of tests/test_fuzz_ddp.py: a rank server (tests/_fuzz.py) that runs each fuzzed
sequence of public DistributedDataParallel calls on torch's DDP (on gloo, the oracle) and on
dptc's, side by side in this process, and reports what every op returned or raised.

An example is {"config": {...}, "ops": [{"op": name, ...}, ...]} (see tests/test_fuzz_ddp.py
for the strategy).  For each implementation, torch's first, the rank:
- builds the model from config["seed"] (plus the rank with config["rank_init"]: every rank
  starts from other parameters and DDP's constructor broadcasts rank 0's): a Linear `trunk`,
  optionally a BatchNorm1d `norm` (a buffer DDP broadcasts), a residual Linear `mid`, a Linear
  `head` and a Linear `branch` added to the output only when an op says so (an unused
  parameter otherwise), in config["dtype"];
- wraps it (find_unused_parameters, static_graph, gradient_as_bucket_view, bucket_cap_mb,
  broadcast_buffers from the config) and makes the optimizer (SGD with momentum or AdamW):
  the op "setup";
- runs the ops in order, stopping at the first that raises.
Each op's outcome is {"op": name, "ok": true, "value": ...} or {"op": name, "ok": false,
"error": "Type: message"}: a backward's value is {"loss": float, "grads": {name: flat list or
None}} (the gradients every parameter holds after it: reduced, or this rank's own under
no_sync); parameters, buffers and state dicts as {name: flat list}.  The sequence ends with
the op "final", which reads every parameter, buffer and gradient.  Data comes from each op's
seed and this rank (every rank draws different rows).

Where the driver found an op that torch's DDP cannot run (example["torch_stop"], an index
into the ops; see tests/test_fuzz_ddp.py's torch_stop), torch's sequence stops before it
and dptc's runs whole.

An op's "branch" says which ranks use the branch: "no", "yes" (every rank) or "rank0" (rank 0
only: a parameter unused on some ranks).  The op "join" runs `steps` train steps inside
ddp.join() on rank 0 and one fewer on rank 1 (uneven inputs), each optionally followed by an
optimizer step.

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
IN = 5
HIDDEN = 8
OUT = 4
BATCH = 3


class Net(nn.Module):
    def __init__(self, batch_norm):
        super().__init__()
        self.trunk = nn.Linear(IN, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN) if batch_norm else nn.Identity()
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.branch = nn.Linear(HIDDEN, OUT)

    def forward(self, x, branch=False):
        h = torch.tanh(self.norm(self.trunk(x)))
        h = h + torch.tanh(self.mid(h))
        out = self.head(h)
        return out + self.branch(h) if branch else out


def _ddp_class(impl):
    if impl == "dptc":
        import dptc
        return dptc.DistributedDataParallel
    return torch.nn.parallel.DistributedDataParallel


def _build(config, rank):
    torch.manual_seed(config["seed"] + (100 * rank if config["rank_init"] else 0))
    return Net(config["batch_norm"]).to(getattr(torch, config["dtype"]))


def _wrap(model, impl, config):
    ddp = _ddp_class(impl)(model, find_unused_parameters=config["find_unused"],
                           static_graph=config["static_graph"],
                           gradient_as_bucket_view=config["bucket_view"],
                           bucket_cap_mb=config["bucket_cap_mb"],
                           broadcast_buffers=config["broadcast_buffers"])
    if config["optim"] == "sgd":
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)


def _data(seed, rank, config):
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(BATCH, IN, generator=generator, dtype=torch.float64)
    y = torch.randint(0, OUT, (BATCH,), generator=generator)
    return x.to(getattr(torch, config["dtype"])), y


def _uses_branch(op, rank):
    return op["branch"] == "yes" or (op["branch"] == "rank0" and rank == 0)


def _flat(tensor):
    return tensor.detach().double().flatten().tolist()


def _grads(model):
    return {name: None if p.grad is None else _flat(p.grad)
            for name, p in model.named_parameters()}


def _forward_loss(model, op, rank, config):
    x, y = _data(op["seed"], rank, config)
    return F.cross_entropy(model(x, branch=_uses_branch(op, rank)).float(), y)


def _step(model, op, rank, config):
    loss = _forward_loss(model, op, rank, config)
    loss.backward()
    return {"loss": loss.item(), "grads": _grads(model)}


def _apply(op, model, optimizer, rank, config, held):
    """Runs one op; returns its JSON-able value.  `held` keeps what an op leaves for later
    ones: "losses" (forwards whose backward is still to come), "states" (state dicts)."""
    name = op["op"]
    if name == "train_step":
        return _step(model, op, rank, config)
    if name == "no_sync_step":
        with model.no_sync():
            return _step(model, op, rank, config)
    if name == "set_sync":
        model.require_backward_grad_sync = op["value"]
        return None
    if name == "forward":
        return _fuzz.forward_op(op["mode"], lambda: _forward_loss(model, op, rank, config),
                                held)
    if name == "backward":
        if not held["losses"]:         # the latest kept forward's; nothing without one
            return None
        loss = held["losses"].pop()
        loss.backward()
        return {"loss": loss.item(), "grads": _grads(model)}
    if name == "join":
        losses = []
        with model.join(divide_by_initial_world_size=op["divide"]):
            for i in range(op["steps"] - rank):    # rank 1 runs out of inputs first
                step = {**op, "seed": op["seed"] + i}
                loss = _forward_loss(model, step, rank, config)
                loss.backward()
                losses.append(loss.item())
                if op["optim"]:
                    optimizer.step()
                    optimizer.zero_grad()
        return {"losses": losses, "grads": _grads(model)}
    if name == "state_dict":
        state = {key: value.detach().clone() for key, value in model.state_dict().items()}
        held["states"].append(state)
        return {key: _flat(value) for key, value in state.items()}
    if name == "load_state_dict":
        if not held["states"]:         # nothing taken yet: nothing to load
            return None
        incompatible = model.load_state_dict(held["states"][op["which"] % len(held["states"])])
        return {"missing": sorted(incompatible.missing_keys),
                "unexpected": sorted(incompatible.unexpected_keys)}
    if name == "zero_grad":
        optimizer.zero_grad(set_to_none=op["set_to_none"])
        return None
    if name == "optim_step":
        optimizer.step()
        return None
    raise ValueError(f"unknown op {name!r}")


def _final(model):
    out = {f"p.{name}": _flat(p) for name, p in model.named_parameters()}
    out.update({f"b.{name}": _flat(b) for name, b in model.named_buffers()})
    out.update({f"g.{name}": grad for name, grad in _grads(model).items()})
    return out


def run_example(example, note):
    """{impl: [outcome per op]} for this rank (see the module docstring)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    config = example["config"]

    def setup(impl):
        model, optimizer = _wrap(_build(config, rank), impl, config)
        return {"model": model, "optimizer": optimizer, "held": {"losses": [], "states": []}}

    def apply(impl, state, op):
        return _apply(op, state["model"], state["optimizer"], rank, config, state["held"])

    def final(impl, state):
        return _final(state["model"])

    return _fuzz.run_impls(example, note, setup, apply, final, IMPLS)


def serve(directory):
    """The rank server for this module's examples (tests/_fuzz.py's serve_torch_and_dptc)."""
    return _fuzz.serve_torch_and_dptc(directory, run_example)
