"""The Python <-> C crossings of dptc's fully_shard per unit and training step.

Counts, over one training step (forward, backward, AdamW) after warm-up, every call from Python
into dptc's C extension (a function of dptc._C or a method of one of its types) and every call
C makes straight back into Python (a Python function whose caller is such a C call, as the
unit's gather calls the group's submit), with sys.setprofile on each rank.  The model is
fsdp_step.py's GPT, each block and the root a unit.  Rank 0 prints each function's count per
step, the totals, and the totals per unit: the figures issue 38's unit boundary is measured by
(notes/FSDP.md).

    python benchmarks/fsdp_crossings.py [--layers 4] [--nproc 2]
"""

import argparse
import collections
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from _checkout import put_checkout_on_path

put_checkout_on_path()

from ddp_step import train_step  # noqa: E402
from dptc.bench import import_dptc, run_under_torchrun  # noqa: E402
from examples.gpt import build_gpt  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to start when not already under torchrun (default 2)")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks, each a unit")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the counted one")
    return parser.parse_args(argv)


def _is_dptc_c(function):
    owner = getattr(function, "__self__", None)
    if getattr(function, "__module__", None) == "dptc._C":
        return True
    return owner is not None and type(owner).__module__ == "dptc._C"


def _c_name(function):
    owner = getattr(function, "__self__", None)
    if owner is not None and type(owner).__module__ == "dptc._C":
        return f"{type(owner).__name__}.{function.__name__}"
    return f"_C.{function.__name__}"


def count_crossings(step):
    """({C function: calls from Python}, {Python function: calls from dptc's C}) over step()."""
    into_c, into_python = collections.Counter(), collections.Counter()
    calls = []    # the C calls in progress: (function, the Python frame that made it)

    def profile(frame, event, arg):
        if event == "c_call":
            calls.append((arg, frame))
            if _is_dptc_c(arg):
                into_c[_c_name(arg)] += 1
        elif event in ("c_return", "c_exception"):
            if calls:
                calls.pop()
        elif event == "call" and calls and frame.f_back is calls[-1][1] \
                and _is_dptc_c(calls[-1][0]):
            code = frame.f_code
            into_python[f"{code.co_qualname} ({os.path.basename(code.co_filename)})"] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return into_c, into_python


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        import_dptc()
        return run_under_torchrun([os.path.abspath(__file__)], argv, args.nproc)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    dptc = import_dptc()
    dptc.init_process_group()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_gpt(vocab=512, d_model=256, n_layer=args.layers, n_head=4, ctx=64)
    for block in model.blocks:
        dptc.fully_shard(block)
    dptc.fully_shard(model)
    units = args.layers + 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randint(512, (2, 64), generator=generator)
    targets = torch.randint(512, (2, 64), generator=generator)
    for _ in range(args.warmup):
        train_step(model, optimizer, inputs, targets)
    into_c, into_python = count_crossings(lambda: train_step(model, optimizer, inputs,
                                                             targets))
    if rank == 0:
        print(f"# fsdp_crossings: {dist.get_world_size()} ranks, torch {torch.__version__}, "
              f"GPT with {args.layers} blocks: {units} units; one step (forward, backward, "
              f"AdamW) after {args.warmup} warm-up steps")
        print("# Python -> C (dptc._C), calls per step:")
        for name, count in into_c.most_common():
            print(f"{count:8d}  {name}")
        print("# C -> Python (functions dptc's C calls directly), calls per step:")
        for name, count in into_python.most_common():
            print(f"{count:8d}  {name}")
        total_c, total_python = sum(into_c.values()), sum(into_python.values())
        print(f"per step: {total_c} Python -> C, {total_python} C -> Python; per unit: "
              f"{total_c / units:.1f} and {total_python / units:.1f}")
    dist.barrier()
    dptc.destroy_process_group()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
