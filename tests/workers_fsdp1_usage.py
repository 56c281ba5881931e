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

__all__ = ["apply_case", "tutorial_case", "optimizer_before_wrapping_case"]


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


class _TutorialNet(nn.Module):
    """The MNIST network of torch's "Getting Started with FSDP" tutorial, its first linear
    layer sized for 12x12 inputs."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(torch.relu(self.fc1(x)))
        return torch.log_softmax(self.fc2(x), dim=1)


def tutorial_case(impl):
    """The tutorial's training loop: size_based_auto_wrap_policy(min_num_params=100),
    use_orig_params left False, Adadelta(lr=1.0) with StepLR(gamma=0.7), nll_loss summed and
    all-reduced for the log, dropout on; 2 epochs of 3 batches of 4 images a rank, then the
    tutorial's test pass under torch.no_grad().  Returns the logged losses, the test loss,
    the parameters' names and the trained full parameters."""
    import torch.distributed as dist
    from torch.optim.lr_scheduler import StepLR
    api, FSDP = _api(impl)
    if impl == "dptc":
        from dptc import size_based_auto_wrap_policy
    else:
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = FSDP(_TutorialNet(), device_id="cpu", auto_wrap_policy=functools.partial(
        size_based_auto_wrap_policy, min_num_params=100))
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(10 + rank)                     # each rank's dropout masks
    out = {"losses": {}, "names": [name for name, _ in model.named_parameters()],
           "shapes": [list(p.shape) for p in model.parameters()]}
    for epoch in range(2):
        model.train()
        ddp_loss = torch.zeros(2)
        for batch in range(3):
            x = torch.randn(4 * world, 1, 12, 12, generator=data)[rank * 4:(rank + 1) * 4]
            y = torch.randint(0, 10, (4 * world,), generator=data)[rank * 4:(rank + 1) * 4]
            optimizer.zero_grad()
            loss = nn.functional.nll_loss(model(x), y, reduction="sum")
            loss.backward()
            optimizer.step()
            ddp_loss[0] += loss.item()
            ddp_loss[1] += len(x)
        dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
        out["losses"][epoch] = [float(ddp_loss[0] / ddp_loss[1])]
        scheduler.step()
    model.eval()
    with torch.no_grad():
        x = torch.randn(4, 1, 12, 12, generator=data)
        out["test"] = {"outputs": model(x).flatten().tolist()}
    with FSDP.summon_full_params(model, writeback=False):
        out["params"] = {name.replace("_fsdp_wrapped_module.", ""):
                         p.detach().double().flatten().tolist()
                         for name, p in model.named_parameters()}
    _done(impl)
    return out


def optimizer_before_wrapping_case():
    """dptc only (torch 2.13's FSDP1 dies with SIGSEGV here): a float64 GPT, its position
    embedding ignored (ignored_modules), SGD made from model.parameters() before wrapping,
    one backward.  Returns what that optimizer's step() raised and whether any parameter
    moved; whether an optimizer of the ignored parameters alone, made before wrapping, steps;
    the step of an optimizer made after wrapping against the single-process step; and what
    its step raises once a replaced parameter is added to it (add_param_group)."""
    import dptc
    from examples.gpt import GPT
    from tests.workers_fsdp1 import _error
    _, FSDP = _api("dptc")
    rank, world = dptc.get_rank(), dptc.get_world_size()
    model, ref = build(n_layer=2), build(n_layer=2)
    before = torch.optim.SGD(model.parameters(), lr=0.1)
    ignored = torch.optim.SGD(model.pos_emb.parameters(), lr=0.1)
    stale = model.tok_emb.weight
    wrapped = FSDP(model, device_id="cpu", ignored_modules=[model.pos_emb],
                   auto_wrap_policy=functools.partial(_policy("dptc"),
                                                      transformer_layer_cls={Block}))
    after = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    idx = torch.randint(0, 64, (2 * world, 9), generator=torch.Generator().manual_seed(3))
    mine = idx[rank * 2:(rank + 1) * 2]
    GPT.loss(wrapped(mine[:, :-1]), mine[:, 1:]).backward()
    GPT.loss(ref(idx[:, :-1]), idx[:, 1:]).backward()
    # The ignored embedding is not reduced (as under torch's FSDP1): the reference's is the
    # mean of the ranks' gradients, so it steps on its own here.
    ref.pos_emb.weight.grad = None
    with FSDP.summon_full_params(wrapped, writeback=False):
        start = {name: p.detach().clone() for name, p in wrapped.named_parameters()}
    out = {"before": _error(before.step)}
    with FSDP.summon_full_params(wrapped, writeback=False):
        out["moved"] = sum(not torch.equal(p.detach(), start[name])
                           for name, p in wrapped.named_parameters())
    out["ignored"] = _error(ignored.step)
    ignored.zero_grad()
    out["after"] = _error(after.step)
    ref_opt.step()
    with FSDP.summon_full_params(wrapped, writeback=False):
        got = {name.replace("_fsdp_wrapped_module.", ""): p.detach().flatten().tolist()
               for name, p in wrapped.named_parameters() if "pos_emb" not in name}
    out["after_vs_reference"] = [got, {name: p.detach().flatten().tolist()
                                       for name, p in ref.named_parameters()
                                       if "pos_emb" not in name}]
    after.add_param_group({"params": [stale]})
    out["added"] = _error(after.step)
    dptc.destroy_process_group()
    return out
