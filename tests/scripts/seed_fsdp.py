"""The FSDP patterns a PyTorch user brings, as user code, with only the imports choosing the
implementation; run under torchrun:

    torchrun --standalone --nproc_per_node=2 tests/scripts/seed_fsdp.py --impl dptc|torch

Four snippets, each in the form torch's documentation teaches it:
  fsdp1_mixed_precision  FullyShardedDataParallel with transformer_auto_wrap_policy,
                         MixedPrecision(bfloat16, float32) and FULL_SHARD
  fully_shard_mesh       fully_shard over each block, then the root, on a 1-D mesh
  checkpoint_blocks      checkpoint_wrapper over each of model.transformer_blocks, then
                         fully_shard
  no_sync_accumulation   FullyShardedDataParallel, accumulating under no_sync()

Everything between "# --- snippet" and "# --- end" is the user's code: it names only what the
import block below binds.  Each rank prints a line per snippet and, with --out DIR, writes
DIR/rank<R>.json: per snippet its losses, a sample of the trained parameters and, for the
float32 snippets, their largest relative difference from single-process training on the whole
batch (tests/test_fsdp_seed.py compares dptc's results with torch's).
"""

import argparse
import copy
import functools
import json
import os
import sys
import traceback

import torch
from torch import nn

# For examples/: appended, so that an installed dptc wins over an unbuilt checkout's (after a
# plain pip install .); the tests put the checkout first on PYTHONPATH themselves.
sys.path.append(os.path.join(os.path.dirname(__file__), "..", ".."))
from examples.gpt import GPT, Block  # noqa: E402

_parser = argparse.ArgumentParser()
_parser.add_argument("--impl", choices=["dptc", "torch"], default="dptc")
_parser.add_argument("--out", default=None, help="folder for the ranks' results")
ARGS = _parser.parse_args()
IMPL = ARGS.impl

if IMPL == "dptc":
    import dptc as dist                                       # noqa: F401
    from dptc import (CheckpointImpl, MixedPrecision, ShardingStrategy, checkpoint_wrapper,
                      fully_shard, transformer_auto_wrap_policy)
    from dptc import FullyShardedDataParallel as FSDP
else:
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             checkpoint_wrapper)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from tests._compare import max_rel

VOCAB, D_MODEL, LAYERS, HEADS, CTX = 64, 32, 2, 4, 16
ROWS, STEPS, ACCUM, LR = 4, 3, 2, 1e-3


class Transformer(nn.Module):
    """A GPT whose blocks are called transformer_blocks, as in the checkpointing snippet."""

    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(CTX, D_MODEL)
        self.transformer_blocks = nn.ModuleList(Block(D_MODEL, HEADS, False)
                                                for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL, bias=False)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.transformer_blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(logits, targets):
    return GPT.loss(logits, targets)


def batches(rank, world, count):
    """`count` batches: each rank's rows and the whole batch, for the reference."""
    generator = torch.Generator().manual_seed(11)
    out = []
    for _ in range(count):
        idx = torch.randint(0, VOCAB, (ROWS * world, CTX + 1), generator=generator)
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        out.append(((idx[mine, :-1], idx[mine, 1:]), (idx[:, :-1], idx[:, 1:])))
    return out


def fsdp1_mixed_precision(model, data):
    losses = []
    # --- snippet
    auto_wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                         transformer_layer_cls={Block})
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FSDP(model, auto_wrap_policy=auto_wrap_policy, mixed_precision=mp_policy,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for inputs, targets in data:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # --- end
    with FSDP.summon_full_params(model, writeback=False):
        return losses, [p.detach().clone() for p in model.parameters()]


def fully_shard_mesh(model, data):
    losses = []
    world_size = dist.get_world_size()
    # --- snippet
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.transformer_blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for inputs, targets in data:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # --- end
    return losses, [p.full_tensor().detach() for p in model.parameters()]


def checkpoint_blocks(model, data):
    losses = []
    # --- snippet
    for i, block in enumerate(model.transformer_blocks):
        model.transformer_blocks[i] = checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    for block in model.transformer_blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for inputs, targets in data:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # --- end
    return losses, [p.full_tensor().detach() for p in model.parameters()]


def no_sync_accumulation(model, data):
    losses = []
    gradient_accumulation_steps = ACCUM
    # --- snippet
    model = FSDP(model, auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}), device_id="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step, (inputs, targets) in enumerate(data):
        if (step + 1) % gradient_accumulation_steps != 0:
            with model.no_sync():
                loss = loss_fn(model(inputs), targets) / gradient_accumulation_steps
                loss.backward()
        else:
            loss = loss_fn(model(inputs), targets) / gradient_accumulation_steps
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    # --- end
    with FSDP.summon_full_params(model, writeback=False):
        return losses, [p.detach().clone() for p in model.parameters()]


SNIPPETS = {"fsdp1_mixed_precision": (fsdp1_mixed_precision, 1),
            "fully_shard_mesh": (fully_shard_mesh, 1),
            "checkpoint_blocks": (checkpoint_blocks, 1),
            "no_sync_accumulation": (no_sync_accumulation, ACCUM)}


def reference(model, data, accum):
    """Single-process training of the same model on the whole batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step, (_, (inputs, targets)) in enumerate(data):
        (loss_fn(model(inputs), targets) / accum).backward()
        if (step + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def main():
    if IMPL == "torch":
        dist.init_process_group("gloo")
    else:
        dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for name, (snippet, accum) in SNIPPETS.items():
        try:
            torch.manual_seed(0)
            model = Transformer()
            ref_model = copy.deepcopy(model)
            data = batches(rank, world, STEPS * accum)
            losses, params = snippet(model, [mine for mine, _ in data])
            result = {"snippet": name, "rank": rank, "losses": losses,
                      "sample": torch.cat([p.flatten() for p in params])[::7].tolist()}
            if name != "fsdp1_mixed_precision":
                result["ref_rel"] = max_rel(params, reference(ref_model, data, accum))
        except Exception:  # noqa: BLE001 - reported to the test
            result = {"snippet": name, "rank": rank, "error": traceback.format_exc()}
        results.append(result)
        print(f"{name} rank {rank}: " + ("ok" if "error" not in result else result["error"]),
              flush=True)
    if ARGS.out:
        os.makedirs(ARGS.out, exist_ok=True)
        path = os.path.join(ARGS.out, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
