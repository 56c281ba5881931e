"""Train a small GPT on synthetic data with data parallelism on CPU.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --impl torch
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --fsdp [--impl torch]

``--impl dptc`` wraps the model in dptc.DistributedDataParallel, ``--impl torch`` in
torch.nn.parallel.DistributedDataParallel over gloo; the rest of the script is identical,
which is the point: switching is one import. Each rank draws the same global batch from a
seeded generator and trains on its own slice of it; rank 0 prints the loss averaged over
ranks and the throughput of all ranks together.

``--fsdp`` shards the model instead: ``fully_shard`` on each block, then on the root
(dptc.fully_shard for ``--impl dptc``, torch.distributed.fsdp.fully_shard over gloo for
``--impl torch``). Gradient accumulation then skips the reduce-scatter of all but the last
micro-step with ``set_requires_gradient_sync(False)`` in place of ``no_sync()``.
"""

import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

_EXAMPLES = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _EXAMPLES)
# An installed dptc wins; from a source checkout (built in place), the one beside examples/.
sys.path.append(os.path.dirname(_EXAMPLES))
from gpt import PermutationWalk, build_gpt, noise_floor  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("dptc", "torch"), default="dptc",
                        help="whose DistributedDataParallel (or fully_shard, with --fsdp) "
                             "wraps the model")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the model with fully_shard (each block, then the root) "
                             "instead of wrapping it in DistributedDataParallel")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per rank per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-steps per optimizer step (all but the last under no_sync, "
                             "or without gradient sync under --fsdp)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="peak learning rate (linear warm-up, then cosine decay to 10%%)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in ("steps", "batch_size", "grad_accum", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


class Backend:
    """The few distributed calls the loop needs, from dptc or from torch.distributed."""

    def __init__(self, impl):
        self.impl = impl
        if impl == "dptc":
            import dptc
            self.lib = dptc
            dptc.init_process_group()
            self.wrapper = dptc.DistributedDataParallel
            self.fully_shard = dptc.fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
            dist.init_process_group("gloo")
            self.lib = dist
            self.wrapper = torch.nn.parallel.DistributedDataParallel
            self.fully_shard = fully_shard
        self.rank = self.lib.get_rank()
        self.world_size = self.lib.get_world_size()

    def shard(self, model):
        """fully_shard on each block, then on the root (which keeps the embeddings, the tied
        output projection and the final norm); returns the model, now an FSDPModule."""
        for block in model.blocks:
            self.fully_shard(block)
        return self.fully_shard(model)

    def mean_over_ranks(self, value):
        tensor = torch.tensor([value], dtype=torch.float64)
        self.lib.all_reduce(tensor)
        return tensor.item() / self.world_size

    def close(self):
        self.lib.destroy_process_group()
        if dist.is_initialized():
            dist.destroy_process_group()


def learning_rate(step, steps, peak, warmup=10):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def main():
    args = parse_args()
    backend = Backend(args.impl)
    rank, world_size = backend.rank, backend.world_size

    torch.manual_seed(args.seed)
    model = build_gpt(vocab=args.vocab, d_model=args.d_model, n_layer=args.n_layer,
                      n_head=args.n_head, ctx=args.ctx)
    if args.fsdp:
        model = backend.shard(model)
        core = model
    else:
        model = backend.wrapper(model)
        core = model.module
    kind = "FSDP" if args.fsdp else "DDP"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = PermutationWalk(vocab=args.vocab, ctx=args.ctx, noise=0.1, seed=args.seed)
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    global_rows = args.batch_size * world_size

    # Under fully_shard the parameters are DTensors; numel() counts the whole parameter.
    n_params = sum(p.numel() for p in core.parameters())
    if rank == 0:
        print(f"{args.impl} {kind} on {world_size} ranks: {n_params / 1e6:.2f}M parameters, "
              f"{global_rows * args.grad_accum} sequences x {args.ctx} tokens per step, "
              f"noise floor {noise_floor(args.vocab, 0.1):.3f}", flush=True)

    tokens_per_step = global_rows * args.grad_accum * args.ctx
    loss_sum = 0.0
    window_start = run_start = None
    window_first_step = 1
    for step in range(args.steps):
        if step == 1:
            # Step 0 pays for first-touch allocations and bucket rebuilding; time the rest.
            window_start = run_start = time.perf_counter()
        step_loss = 0.0
        for micro in range(args.grad_accum):
            inputs, targets = data.batch(step * args.grad_accum + micro, global_rows)
            last = micro == args.grad_accum - 1
            if args.fsdp:
                # Only the last micro-step reduce-scatters; the others accumulate unsharded.
                model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if last else model.no_sync()
            with sync:
                loss = core.loss(model(inputs[rows]), targets[rows])
                (loss / args.grad_accum).backward()
            step_loss += loss.item() / args.grad_accum
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += step_loss

        logging_step = (step + 1) % args.log_every == 0 or step + 1 == args.steps
        if logging_step:
            mean_loss = backend.mean_over_ranks(step_loss)
            if rank == 0:
                now = time.perf_counter()
                window_steps = step + 1 - window_first_step
                rate = (window_steps * tokens_per_step / (now - window_start)
                        if window_start is not None and window_steps > 0 else float("nan"))
                print(f"step {step + 1:5d}  loss {mean_loss:.4f}  {rate:9.0f} tokens/s",
                      flush=True)
                window_start, window_first_step = now, step + 1
            final_loss = mean_loss

    elapsed = time.perf_counter() - run_start if run_start is not None else float("nan")
    timed_steps = args.steps - 1
    rate = timed_steps * tokens_per_step / elapsed if timed_steps else float("nan")
    if rank == 0:
        print(f"done: {args.steps} steps, final loss {final_loss:.3f}, {rate:.0f} tokens/s, "
              f"{args.impl} {kind} on {world_size} ranks", flush=True)
    backend.close()


if __name__ == "__main__":
    main()
