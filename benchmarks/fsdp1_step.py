"""Training step time of dptc's FullyShardedDataParallel (FSDP1's API) against torch's, per
sharding strategy, same run.

    python benchmarks/fsdp1_step.py --strategy NO_SHARD       # starts 2 ranks itself
    python benchmarks/fsdp1_step.py --strategy HYBRID_SHARD   # on one node: replicas of one

The model is examples/gpt.py's GPT (the sizes of benchmarks/ddp_step.py), wrapped with
transformer_auto_wrap_policy (each block, then the root), use_orig_params=True, on the CPU
(torch's with device_id="cpu", on gloo).  Four phases take turns step by step, as in
ddp_step.py, the ranks meeting at dptc's barrier before each turn: the unwrapped model
(compute), dptc's FSDP1, torch's FSDP1, and dptc's DDP.  A step is zero_grad, forward,
cross-entropy, backward and AdamW; a phase's time is the median over its timed steps of the
slowest rank's step.  At the end the three wrapped copies' full parameters are compared.
"""

import argparse
import copy
import functools
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from _checkout import put_checkout_on_path

put_checkout_on_path()

from ddp_step import run_phases, slowest_rank_median, train_step  # noqa: E402
from dptc.bench import import_dptc, run_under_torchrun  # noqa: E402
from examples.gpt import Block, build_gpt  # noqa: E402

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to start when not already under torchrun (default 2)")
    parser.add_argument("--strategy", default="NO_SHARD", choices=STRATEGIES)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per phase")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per phase")
    parser.add_argument("--comm-hook", choices=("none", "default"), default="none",
                        help="default: both FSDP1s reduce through torch's default comm hook "
                             "(allreduce_hook under NO_SHARD, reduce_scatter_hook otherwise), "
                             "registered with register_comm_hook on the world group")
    parser.add_argument("--timeout", type=float, default=600,
                        help="torch.distributed init timeout in seconds (default 600)")
    args = parser.parse_args(argv)
    args.block = 1
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def full_parameters(model, summon):
    with summon(model, writeback=False):
        return [p.detach().clone() for p in model.parameters()]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        import_dptc()
        return run_under_torchrun([os.path.abspath(__file__)], argv, args.nproc)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    dptc = import_dptc()
    dptc.init_process_group()
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    rank = dist.get_rank()

    torch.manual_seed(0)
    base = build_gpt(vocab=256, d_model=args.d_model, n_layer=args.n_layer, n_head=6, ctx=64)
    strategy = getattr(torch_fsdp.ShardingStrategy, args.strategy)

    def policy(which):
        return functools.partial(which, transformer_layer_cls={Block})
    models = {
        "compute": copy.deepcopy(base),
        "dptc FSDP1": dptc.FullyShardedDataParallel(
            copy.deepcopy(base), sharding_strategy=strategy, device_id="cpu",
            auto_wrap_policy=policy(dptc.transformer_auto_wrap_policy), use_orig_params=True),
        "torch FSDP1": torch_fsdp.FullyShardedDataParallel(
            copy.deepcopy(base), sharding_strategy=strategy, device_id="cpu",
            auto_wrap_policy=policy(transformer_auto_wrap_policy), use_orig_params=True),
        "dptc DDP": dptc.DistributedDataParallel(copy.deepcopy(base)),
    }
    if args.comm_hook == "default":
        from torch.distributed.algorithms._comm_hooks import default_hooks
        hook = default_hooks.allreduce_hook if args.strategy == "NO_SHARD" else \
            default_hooks.reduce_scatter_hook
        for name in ("dptc FSDP1", "torch FSDP1"):
            models[name].register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), hook)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4)
                  for name, model in models.items()}
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randint(256, (1, 64), generator=generator)
    targets = torch.randint(256, (1, 64), generator=generator)
    phases = {name: functools.partial(train_step, model, optimizers[name], inputs, targets)
              for name, model in models.items()}
    samples = run_phases(phases, args, dptc.barrier)
    medians = {name: slowest_rank_median(s) for name, s in samples.items()}
    mine = full_parameters(models["dptc FSDP1"], dptc.FullyShardedDataParallel.summon_full_params)
    theirs = full_parameters(models["torch FSDP1"],
                             torch_fsdp.FullyShardedDataParallel.summon_full_params)
    drift = max((a - b).abs().max().item() for a, b in zip(mine, theirs))
    if rank == 0:
        hooked = ", torch's default comm hook" if args.comm_hook == "default" else ""
        print(f"# fsdp1_step: {dist.get_world_size()} ranks, {args.strategy}{hooked}, torch "
              f"{torch.__version__}, GPT d_model {args.d_model}, {args.n_layer} layers, "
              f"{sum(p.numel() for p in base.parameters()) / 1e6:.2f} M parameters; median "
              f"of {args.steps} steps of the slowest rank")
        for name, seconds in medians.items():
            print(f"{name:>12}  {seconds * 1e3:9.2f} ms")
        print(f"step time ratio dptc FSDP1 / torch FSDP1: "
              f"{medians['dptc FSDP1'] / medians['torch FSDP1']:.2f}")
        print(f"# max |parameter difference| dptc FSDP1 vs torch FSDP1 after "
              f"{args.warmup + args.steps} steps: {drift:.3g}")
    dist.barrier()
    dptc.destroy_process_group()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
