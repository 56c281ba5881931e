"""Rank-side half of the test harness (see tests/_launch.py).

    python -m tests._rank <module:function> <json kwargs> <result file>

imports the function, calls it with the kwargs and writes one JSON object to the result file:
    {"ok": true,  "value": <return value>, "elapsed": s}
    {"ok": false, "error_type": name, "error_mro": [names], "error": message,
     "traceback": text, "elapsed": s}
and exits 0 or 1.  SIGUSR1 dumps every thread's Python stack to stderr (the harness sends it to a
rank past its deadline).

Worker functions also import from here:
- `start_clock()` restarts the clock behind "elapsed", so a failure test can time one collective
  instead of the whole function (interpreter start-up and group initialisation excluded);
- `load_impl(name)` returns the collective API under test, "torch" (torch.distributed on gloo)
  or "dptc", behind one small adapter with the same signatures.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback

__all__ = ["IMPLS", "Impl", "load_impl", "start_clock", "main"]

IMPLS = ("torch", "dptc")

_clock_start = time.monotonic()


def start_clock():
    """Restarts the clock whose reading the harness reports as "elapsed"."""
    global _clock_start
    _clock_start = time.monotonic()


def _elapsed() -> float:
    return time.monotonic() - _clock_start


# ---------------------------------------------------------------------------------------------
# The implementation under test

class Impl:
    """One implementation of the torch.distributed collective API (notes/API.md).

    Attributes: name ("torch" or "dptc"), module (torch.distributed or dptc), ReduceOp, and the
    functions all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor, barrier,
    get_rank, get_world_size, destroy_process_group, all with torch.distributed's signatures.
    """

    def __init__(self, name, module):
        self.name = name
        self.module = module
        self.ReduceOp = module.ReduceOp
        self.all_reduce = module.all_reduce
        self.broadcast = module.broadcast
        self.all_gather_into_tensor = module.all_gather_into_tensor
        self.reduce_scatter_tensor = module.reduce_scatter_tensor
        self.barrier = module.barrier
        self.get_rank = module.get_rank
        self.get_world_size = module.get_world_size
        self.destroy_process_group = module.destroy_process_group

    def __repr__(self):
        return f"Impl({self.name!r})"


def load_impl(name: str) -> Impl:
    """The API under test, initialised from the torchrun environment.

    "torch": torch.distributed.init_process_group("gloo") with DPTC_TIMEOUT as its timeout (so a
    reference run cannot hang longer than a dptc one).  "dptc": `import dptc` only; dptc
    initialises itself on first use.
    """
    if name == "torch":
        import torch.distributed as dist
        if not dist.is_initialized():
            seconds = float(os.environ.get("DPTC_TIMEOUT", "300"))
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
        return Impl("torch", dist)
    if name == "dptc":
        import dptc
        return Impl("dptc", dptc)
    raise ValueError(f"impl must be one of {IMPLS}, got {name!r}")


# ---------------------------------------------------------------------------------------------
# Runner

def _write_result(path: str, record: dict):
    try:
        text = json.dumps(record)
    except (TypeError, ValueError) as error:
        text = json.dumps({
            "ok": False, "error_type": "TypeError", "error_mro": ["TypeError", "Exception"],
            "error": f"the return value is not JSON-serialisable: {error}",
            "traceback": "", "elapsed": record.get("elapsed"),
        })
    partial = path + ".partial"
    with open(partial, "w") as file:
        file.write(text)
    os.replace(partial, path)  # the harness never reads half a result


# [Note: torch references at teardown]
# A torch reference run (the harness sets DPTC_TEST_REFERENCE=1, see run_ranks) can deadlock in
# torch 2.13 itself when its gloo group is freed: once destroy_process_group has dropped the
# group from torch's registry, the last reference may be a torch DDP's Reducer, freed when the
# worker function returns.  ~ProcessGroupGloo then joins gloo's work thread while holding the
# GIL, and that thread is freeing a finished work whose thread-local state needs the GIL
# (seen with gdb: ~Reducer -> ~ProcessGroupGloo -> thread::join, the pt_gloo_runloop thread in
# ~AsyncAllreduceWork -> take_gil); the rank hangs before writing its result.  So in a reference
# run every torch group destroy_process_group drops is kept alive, and after the result is
# written the process leaves with os._exit, freeing nothing: the reference is judged by its
# results (as for the SIGABRT torch's gloo sometimes raises at exit).  dptc's own runs exit as
# usual, and must do so cleanly.
_HELD_GROUPS = []


def _hold_torch_groups():
    """Reference runs: destroy_process_group keeps the groups it drops alive (see the note)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    destroy = c10d.destroy_process_group

    def destroy_holding(group=None):
        _HELD_GROUPS.extend(c10d._world.pg_map.keys())
        return destroy(group)
    dist.destroy_process_group = c10d.destroy_process_group = destroy_holding


def _leave(code: int):
    """Reference runs: exit without freeing anything (see the note); dptc's group, where
    the reference loaded dptc too, is destroyed first so nothing of it is left behind."""
    dptc = sys.modules.get("dptc")
    if dptc is not None and dptc.is_initialized():
        dptc.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv) -> int:
    target, args_json, result_path = argv
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    reference = os.environ.get("DPTC_TEST_REFERENCE") == "1"
    if reference:
        _hold_torch_groups()
    start_clock()
    try:
        module_name, _, function_name = target.partition(":")
        function = getattr(importlib.import_module(module_name), function_name)
        start_clock()
        value = function(**json.loads(args_json))
        record = {"ok": True, "value": value, "elapsed": _elapsed()}
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the harness
        record = {
            "ok": False,
            "error_type": type(error).__name__,
            "error_mro": [cls.__name__ for cls in type(error).__mro__],
            "error": str(error),
            "traceback": traceback.format_exc(),
            "elapsed": _elapsed(),
        }
    _write_result(result_path, record)
    if reference:
        _leave(0 if record["ok"] else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    # Run from the importable copy of this module, so that worker functions that import
    # tests._rank (start_clock) share its state with the runner.
    from tests._rank import main as _main
    sys.exit(_main(sys.argv[1:]))
