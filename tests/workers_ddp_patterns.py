"""Rank-side bodies of tests/test_ddp_patterns.py: training-script patterns around DDP.

Each case is a small training loop written the way PyTorch's DDP material and common scripts
write it, where only the DDP class differs between "torch" (on gloo) and "dptc".  A case
returns, per rank, {"losses": [...], "params": {name: flat list}} plus whatever else it
observed; the test compares dptc's numbers with torch's.
"""

import collections
import dataclasses
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests._rank import load_impl
from tests.workers_ddp import _log, _wrapper_class

__all__ = ["CASES", "run_cases", "failing"]

SEED = 4321
ROWS = 8
STEPS = 3


def _flat(named):
    return {name: t.detach().double().flatten().tolist() for name, t in named}


def _batch(step, rank, d_in=8, classes=4, rows=ROWS):
    generator = torch.Generator().manual_seed(SEED + 97 * step + rank)
    return torch.randn(rows, d_in, generator=generator), \
        torch.randint(0, classes, (rows,), generator=generator)


def _mlp(d_in=8, hidden=16, classes=4):
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def _result(losses, model, **extra):
    return {"losses": losses, "params": _flat(model.named_parameters()), **extra}


def _step(opt, loss, losses):
    """The step every loop here takes: zero_grad, backward, the optimizer; the loss kept."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())


def _train(model, opt, rank, loss_of=None):
    """STEPS steps on this rank's batches, of cross-entropy unless loss_of(x, y) says."""
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        _step(opt, loss_of(x, y) if loss_of else F.cross_entropy(model(x), y), losses)
    return losses


def _params_of(**models):
    """The parameters of several models, each name under its model's keyword."""
    return {f"{prefix}.{name}": value for prefix, model in models.items()
            for name, value in _flat(model.named_parameters()).items()}


# ---------------------------------------------------------------------------------------------
# Cases

def gan(impl, rank):
    """A generator and a discriminator, each its own DDP and optimizer: the discriminator
    step on detached fakes, then the generator step through both."""
    DDP = _wrapper_class(impl)
    torch.manual_seed(SEED)
    gen = DDP(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)))
    disc = DDP(nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(SEED + step * 13 + rank)
        real = torch.randn(ROWS, 8, generator=generator) + 1.0
        noise = torch.randn(ROWS, 4, generator=generator)
        fake = gen(noise)
        opt_d.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(disc(real), torch.ones(ROWS, 1)) + \
            F.binary_cross_entropy_with_logits(disc(fake.detach()), torch.zeros(ROWS, 1))
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(disc(fake), torch.ones(ROWS, 1))
        g_loss.backward()
        opt_g.step()
        losses += [d_loss.item(), g_loss.item()]
    return {"losses": losses, "params": _params_of(g=gen, d=disc)}


def zero(impl, rank):
    """torch's ZeroRedundancyOptimizer over a DDP's parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = _wrapper_class(impl)(_mlp())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=1e-2)
    losses = _train(model, opt, rank)
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    return _result(losses, model, state_steps=None if state is None else
                   sorted(float(s["step"]) for s in state["state"].values()))


Pair = collections.namedtuple("Pair", "logits aux")


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux: torch.Tensor
    note: str = "x"


class Heads(nn.Module):
    """A trunk and two heads; returns both heads in a container of `kind`."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(SEED)
        self.kind = kind
        self.trunk = nn.Linear(8, 16)
        self.main = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        logits, aux = self.main(h), self.aux(h)
        if self.kind == "dict":
            return {"logits": logits, "aux": aux, "count": 3}
        if self.kind == "namedtuple":
            return Pair(logits, aux)
        if self.kind == "dataclass":
            return Output(logits, aux)
        return logits, aux, "tag", None


def _logits(out):
    if isinstance(out, dict):
        return out["logits"]
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return out[0]
    return out.logits


def _outputs_case(kind, find_unused, use_aux):
    def case(impl, rank):
        model = _wrapper_class(impl)(Heads(kind), find_unused_parameters=find_unused)
        opt = torch.optim.SGD(model.parameters(), lr=1e-1)
        losses, types = [], []
        for step in range(STEPS):
            x, y = _batch(step, rank)
            out = model(x)
            types.append(type(out).__name__)
            loss = F.cross_entropy(_logits(out), y)
            if use_aux:
                aux = out["aux"] if isinstance(out, dict) else out[1] \
                    if isinstance(out, tuple) else out.aux
                loss = loss + aux.square().mean()
            _step(opt, loss, losses)
        return _result(losses, model, types=types,
                       aux_grad_none=model.module.aux.weight.grad is None)
    return case


def two_views(impl, rank):
    """Two forwards (two augmented views of the batch) before one backward: a contrastive
    loss."""
    model = _wrapper_class(impl)(_mlp(classes=6))
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = []
    for step in range(STEPS):
        x, _ = _batch(step, rank)
        z1 = F.normalize(model(x + 0.1 * torch.sin(x)), dim=1)
        z2 = F.normalize(model(x * 0.9), dim=1)
        logits = z1 @ z2.T / 0.5
        loss = F.cross_entropy(logits, torch.arange(ROWS))
        _step(opt, loss, losses)
    return _result(losses, model)


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


def _eval_between(broadcast):
    def case(impl, rank):
        model = _wrapper_class(impl)(BNNet(), broadcast_buffers=broadcast)
        opt = torch.optim.SGD(model.parameters(), lr=1e-1)
        losses, evals = [], []
        for step in range(STEPS):
            model.train()
            x, y = _batch(step, rank)
            x = x * (1 + rank)
            loss = F.cross_entropy(model(x), y)
            _step(opt, loss, losses)
            model.eval()
            with torch.no_grad():
                evals.append(F.cross_entropy(model(x), y).item())
        return _result(losses, model, evals=evals,
                       buffers=_flat(model.module.named_buffers()))
    return case


def sampler(impl, rank):
    """DistributedSampler with set_epoch and drop_last over a dataset of 21 rows."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler
    model = _wrapper_class(impl)(_mlp())
    generator = torch.Generator().manual_seed(SEED)
    data = TensorDataset(torch.randn(21, 8, generator=generator),
                         torch.randint(0, 4, (21,), generator=generator))
    sampler_ = DistributedSampler(data, drop_last=True, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=4, sampler=sampler_)
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = []
    for epoch in range(2):
        sampler_.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            _step(opt, loss, losses)
    return _result(losses, model)


def module_access(impl, rank):
    model = _wrapper_class(impl)(_mlp())
    return _result([], model, keys=list(model.state_dict()),
                   inner_keys=list(model.module.state_dict()),
                   first=type(model.module[0]).__name__,
                   named=[n for n, _ in model.named_parameters()])


def _freeze_after(find_unused):
    def case(impl, rank):
        """The backbone is frozen after wrapping (fine-tuning a head)."""
        model = _wrapper_class(impl)(_mlp(), find_unused_parameters=find_unused)
        model.module[0].requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-1)
        losses = _train(model, opt, rank)
        return _result(losses, model)
    return case


def clip(impl, rank):
    model = _wrapper_class(impl)(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x), y) * 10
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        losses.append(loss.item())
    return _result(losses, model, norms=norms)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        P = torch.nn.utils.parametrizations
        self.a = P.weight_norm(nn.Linear(8, 16))
        self.b = P.spectral_norm(nn.Linear(16, 4))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def normed(impl, rank):
    model = _wrapper_class(impl)(Normed())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = _train(model, opt, rank)
    return _result(losses, model, buffers=_flat(model.module.named_buffers()))


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.inp = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.shared(self.inp(x)))
        return self.out(torch.tanh(self.shared(h)))


def used_twice(impl, rank):
    model = _wrapper_class(impl)(Twice())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = _train(model, opt, rank)
    return _result(losses, model)


def checkpoint(impl, rank, path):
    """The tutorial's checkpoint: rank 0 saves ddp.state_dict(), a barrier, every rank loads
    it with map_location into a fresh DDP, and training goes on."""
    DDP = _wrapper_class(impl)
    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = []

    def train(model, opt, steps):
        for step in steps:
            x, y = _batch(step, rank)
            loss = F.cross_entropy(model(x), y)
            _step(opt, loss, losses)
    train(model, opt, range(2))
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    torch.manual_seed(rank + 99)   # a different initialisation per rank: the load must win
    fresh = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    fresh.load_state_dict(torch.load(path, map_location={"cuda:0": "cpu"}, weights_only=True))
    opt = torch.optim.SGD(fresh.parameters(), lr=1e-1)
    train(fresh, opt, range(2, 4))
    return _result(losses, fresh)


def eval_grad(impl, rank):
    """A validation forward with grad enabled (no torch.no_grad) and no backward between
    training steps."""
    model = _wrapper_class(impl)(BNNet())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses, evals = [], []
    for step in range(STEPS):
        model.train()
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        _step(opt, loss, losses)
        model.eval()
        evals.append(F.cross_entropy(model(x), y).item())
    return _result(losses, model, evals=evals)


def unfreeze_after(impl, rank):
    """A layer frozen when wrapped is unfrozen later (gradual unfreezing)."""
    net = _mlp()
    net[0].requires_grad_(False)
    model = _wrapper_class(impl)(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = []
    for step in range(STEPS):
        if step == 1:
            model.module[0].requires_grad_(True)
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        _step(opt, loss, losses)
    return _result(losses, model)


def _two_backwards(find_unused):
    return lambda impl, rank: two_backwards(impl, rank, find_unused)


def two_backwards(impl, rank, find_unused=False):
    """Two losses of one forward, each with its own backward (retain_graph)."""
    model = _wrapper_class(impl)(Heads("tuple"), find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        logits, aux, _, _ = model(x)
        opt.zero_grad()
        first = F.cross_entropy(logits, y)
        first.backward(retain_graph=True)
        second = aux.square().mean()
        second.backward()
        opt.step()
        losses.append(first.item() + second.item())
    return _result(losses, model)


def inference(impl, rank):
    """An evaluation under torch.inference_mode between training steps, BatchNorm buffers
    broadcast."""
    model = _wrapper_class(impl)(BNNet())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses, evals = [], []
    for step in range(STEPS):
        model.train()
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x * (1 + rank)), y)
        _step(opt, loss, losses)
        model.eval()
        with torch.inference_mode():
            evals.append(F.cross_entropy(model(x), y).item())
    return _result(losses, model, evals=evals, buffers=_flat(model.module.named_buffers()))


class KwargsNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.fc = nn.Linear(8, 4)
        self.bias_head = nn.Linear(8, 4)

    def forward(self, x, *, mask=None, extra=False):
        out = self.fc(x)
        if extra:
            out = out + self.bias_head(x)
        return out if mask is None else out * mask


def kwargs_forward(impl, rank):
    model = _wrapper_class(impl)(KwargsNet())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = _train(model, opt, rank,
                    lambda x, y: F.cross_entropy(model(x=x, mask=torch.ones(4), extra=True), y))
    return _result(losses, model)


def _retain_twice(find_unused):
    def case(impl, rank):
        """backward twice over one loss (retain_graph=True the first time)."""
        model = _wrapper_class(impl)(_mlp(), find_unused_parameters=find_unused)
        opt = torch.optim.SGD(model.parameters(), lr=1e-1)
        losses = []
        for step in range(STEPS):
            x, y = _batch(step, rank)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward(retain_graph=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return _result(losses, model)
    return case


def local_after_step(impl, rank):
    """After a synced backward, work that is not a second backward through the forward's
    gradients: torch.autograd.grad through the outputs with respect to the inputs (no
    parameter gradient), then a local term through the unwrapped module (ddp.module), whose
    gradients stay on this rank under torch's DDP too."""
    model = _wrapper_class(impl)(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        x.requires_grad_(True)
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward(retain_graph=True)
        (saliency,) = torch.autograd.grad(out.sum(), x)
        local = 1e-3 * model.module(x.detach()).square().mean()
        local.backward()
        opt.step()
        losses += [loss.item(), saliency.abs().sum().item()]
    return _result(losses, model)


def encoder_decoder(impl, rank):
    """Two DDPs (an encoder and a decoder) trained by one loss, one backward, one optimizer."""
    DDP = _wrapper_class(impl)
    torch.manual_seed(SEED)
    enc = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh()))
    dec = DDP(nn.Linear(16, 8))
    opt = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, _ = _batch(step, rank)
        loss = F.mse_loss(dec(enc(x)), x)
        _step(opt, loss, losses)
    return {"losses": losses, "params": _params_of(e=enc, d=dec)}


def _clip_view(set_to_none):
    def case(impl, rank):
        """clip_grad_norm_ on gradients that are views of the buckets, SGD with momentum."""
        model = _wrapper_class(impl)(_mlp(), gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
        losses, norms = [], []
        for step in range(STEPS + 1):
            x, y = _batch(step, rank)
            loss = F.cross_entropy(model(x), y) * 10
            opt.zero_grad(set_to_none=set_to_none)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
            opt.step()
            losses.append(loss.item())
        return _result(losses, model, norms=norms)
    return case


def _gan_pair(impl):
    DDP = _wrapper_class(impl)
    torch.manual_seed(SEED)
    gen = DDP(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)))
    disc = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    return gen, disc


def dcgan(impl, rank):
    """The DCGAN example's order: a backward per discriminator forward (real, then detached
    fakes), the discriminator's step, then the generator's loss through the discriminator."""
    gen, disc = _gan_pair(impl)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2, betas=(0.5, 0.999))
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(SEED + step * 13 + rank)
        real = torch.randn(ROWS, 8, generator=generator) + 1.0
        noise = torch.randn(ROWS, 4, generator=generator)
        disc.zero_grad()
        err_real = F.binary_cross_entropy_with_logits(disc(real), torch.ones(ROWS, 1))
        err_real.backward()
        fake = gen(noise)
        err_fake = F.binary_cross_entropy_with_logits(disc(fake.detach()), torch.zeros(ROWS, 1))
        err_fake.backward()
        opt_d.step()
        gen.zero_grad()
        err_g = F.binary_cross_entropy_with_logits(disc(fake), torch.ones(ROWS, 1))
        err_g.backward()
        opt_g.step()
        losses += [err_real.item(), err_fake.item(), err_g.item()]
    return {"losses": losses, "params": _params_of(g=gen, d=disc)}


def wgan_gp(impl, rank):
    """WGAN-GP: three critic forwards (real, fake, interpolates), the gradient penalty from
    torch.autograd.grad(create_graph=True), one backward."""
    gen, disc = _gan_pair(impl)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.9))
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(SEED + step * 13 + rank)
        real = torch.randn(ROWS, 8, generator=generator) + 1.0
        noise = torch.randn(ROWS, 4, generator=generator)
        alpha = torch.rand(ROWS, 1, generator=generator)
        fake = gen(noise).detach()
        interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (grads,) = torch.autograd.grad(disc(interp).sum(), interp, create_graph=True)
        penalty = ((grads.norm(2, dim=1) - 1) ** 2).mean()
        d_loss = disc(fake).mean() - disc(real).mean() + 10 * penalty
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = -disc(gen(noise)).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        losses += [d_loss.item(), g_loss.item()]
    return {"losses": losses, "params": _params_of(g=gen, d=disc)}


def swa_ema(impl, rank):
    """An exponential moving average of the DDP model with torch.optim.swa_utils.AveragedModel
    (over the wrapper, which it deep-copies), evaluated each step."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    model = _wrapper_class(impl)(BNNet())
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses, evals = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x * (1 + rank)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update_parameters(model)
        losses.append(loss.item())
        ema.eval()
        with torch.no_grad():
            evals.append(F.cross_entropy(ema(x), y).item())
    return _result(losses, model, evals=evals, ema=_flat(ema.named_parameters()))


def zero_bucket_view(impl, rank):
    """ZeroRedundancyOptimizer(parameters_as_bucket_view=True) with a DDP whose gradients are
    bucket views."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = _wrapper_class(impl)(_mlp(), gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                  parameters_as_bucket_view=True, lr=1e-2)
    losses = _train(model, opt, rank)
    return _result(losses, model)


class TinyMoE(nn.Module):
    """Top-1 routing over four experts, whose load-balancing loss is kept on the module
    (self.aux_loss) and added to the loss outside forward, as MoE layers do; an expert no
    row is routed to gets no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 4)
        self.aux_loss = None

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(x)
        for k, expert in enumerate(self.experts):
            rows = choice == k
            if rows.any():
                out[rows] = expert(x[rows]) * probs[rows, k:k + 1]
        self.aux_loss = 4 * (probs.mean(0) ** 2).sum()
        return self.head(out)


def moe(impl, rank):
    model = _wrapper_class(impl)(TinyMoE(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank, rows=3)
        loss = F.cross_entropy(model(x), y) + 0.1 * model.module.aux_loss
        _step(opt, loss, losses)
    return _result(losses, model)


CASES = {
    "gan": gan,
    "zero": zero,
    **{f"out_{kind}{'_fu' if fu else ''}{'_aux' if aux else ''}": _outputs_case(kind, fu, aux)
       for kind in ("dict", "namedtuple", "dataclass", "tuple")
       for fu, aux in ((False, True), (True, False), (True, True))},
    "two_views": two_views,
    "eval_between": _eval_between(True),
    "eval_between_nobcast": _eval_between(False),
    "sampler": sampler,
    "module_access": module_access,
    "freeze_after": _freeze_after(False),
    "freeze_after_fu": _freeze_after(True),
    "clip": clip,
    "normed": normed,
    "used_twice": used_twice,
    "checkpoint": checkpoint,
    "eval_grad": eval_grad,
    "unfreeze_after": unfreeze_after,
    "two_backwards": _two_backwards(False),
    "two_backwards_fu": _two_backwards(True),
    "inference": inference,
    "kwargs_forward": kwargs_forward,
    "retain_twice": _retain_twice(False),
    "retain_twice_fu": _retain_twice(True),
    "local_after_step": local_after_step,
    "encoder_decoder": encoder_decoder,
    "clip_view": _clip_view(True),
    "clip_view_zeros": _clip_view(False),
    "dcgan": dcgan,
    "wgan_gp": wgan_gp,
    "swa_ema": swa_ema,
    "zero_bucket_view": zero_bucket_view,
    "moe": moe,
}


def run_cases(impl, cases, tmpdir=None):
    rank = int(os.environ["RANK"])
    load_impl("torch")   # the scripts call init_process_group("gloo") themselves
    if impl == "dptc":
        load_impl("dptc")
    results = {}
    for name in cases:
        try:
            if name == "checkpoint":
                results[name] = CASES[name](impl, rank, os.path.join(tmpdir, f"{impl}.pt"))
            else:
                results[name] = CASES[name](impl, rank)
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = {"error": traceback.format_exc()}
            _log(f"{impl} {name} raised\n{results[name]['error']}")
        dist.barrier()
    if impl == "dptc":
        import dptc
        if dptc.is_initialized():
            dptc.destroy_process_group()
    return results


def failing(impl, case):
    """Runs one case without catching what it raises (for run_ranks(expect_failure=True))."""
    load_impl("torch")
    if impl == "dptc":
        load_impl("dptc")
    return CASES[case](impl, int(os.environ["RANK"]))
