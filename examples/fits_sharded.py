"""A GPT that trains with fully_shard on 4 ranks of one machine but does not fit with DDP.

    torchrun --standalone --nproc_per_node=4 examples/fits_sharded.py --impl fsdp
    torchrun --standalone --nproc_per_node=4 examples/fits_sharded.py --impl ddp

The default model (d_model 1536, 16 layers, vocab 32000) has 0.50 B parameters.  With AdamW,
DDP keeps on every rank the parameters, their gradients and two moments, 16 bytes per
parameter (8 GB), while fully_shard keeps a quarter of that plus one block's unsharded
parameters and gradients.  ``--memory-per-rank GIB`` caps each rank's private memory
(RLIMIT_DATA; shared memory, which every rank maps from every peer, is not counted), so a rank
that outgrows it fails with an allocation error and its peers with dptc's PeerLostError; by
default there is no cap.  Measured on a 24 GB, 2-core machine: fully_shard trains (about 35 s a
step, peak PSS 3.7 GiB per rank); DDP builds its model, then in its first step the kernel's OOM
killer ends one rank (4.1 GB resident each, the machine full, before a 4.5 GiB cap was
reached), and torchrun ends the job with exit code 1.

Rank 0 prints each step's loss and time and, at the end, every rank's peak RSS and PSS.
"""

import argparse
import resource
import threading
import time

import torch

import dptc
from gpt import build_gpt  # noqa: E402  (examples/ is on sys.path when run as a script)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--d-model", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--rows", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--memory-per-rank", type=float, default=0.0,
                        help="GiB of private memory per rank (RLIMIT_DATA; 0: no cap)")
    return parser.parse_args()


def limit_memory(gib):
    if gib > 0:
        limit = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    return gib


class PeakPss:
    """Samples this process's PSS (smaps_rollup) every 0.2 s."""

    def __init__(self):
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.wait(0.2):
            with open("/proc/self/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith("Pss:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)


def main():
    args = parse_args()
    gib = limit_memory(args.memory_per_rank)
    dptc.init_process_group()
    rank, world = dptc.get_rank(), dptc.get_world_size()
    pss = PeakPss()
    config = dict(vocab=args.vocab, d_model=args.d_model, n_layer=args.layers,
                  n_head=args.heads, ctx=args.ctx, bias=False)
    torch.manual_seed(0)
    started = time.perf_counter()
    if args.impl == "fsdp":
        with torch.device("meta"):
            model = build_gpt(**config)
        for block in model.blocks:
            dptc.fully_shard(block)
        dptc.fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():  # each rank initialises its own shards
            for param in model.parameters():
                param.normal_(0.0, 0.02)
    else:
        model = dptc.DistributedDataParallel(build_gpt(**config))
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        cap = f"{gib:.1f} GiB of private memory per rank" if gib > 0 else "no memory cap"
        print(f"{args.impl}: {n_params / 1e9:.2f} B parameters on {world} ranks, {cap}; built in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    core = model if args.impl == "fsdp" else model.module
    for step in range(args.steps):
        begin = time.perf_counter()
        idx = torch.randint(0, args.vocab, (args.rows, args.ctx + 1), generator=generator)
        loss = core.loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.3f}, {time.perf_counter() - begin:.1f} s",
                  flush=True)
    pss.stop.set()
    peaks = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, pss.peak],
                         dtype=torch.float64)
    gathered = torch.zeros(world * 2, dtype=torch.float64)
    dptc.all_gather_into_tensor(gathered, peaks)
    if rank == 0:
        rows = gathered.view(world, 2) / 2**30
        for r, (rss, peak) in enumerate(rows.tolist()):
            print(f"rank {r}: peak RSS {rss:.2f} GiB, peak PSS {peak:.2f} GiB")
    dptc.destroy_process_group()


if __name__ == "__main__":
    main()
