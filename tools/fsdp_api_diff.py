"""Lists where dptc's fully_shard API differs from the installed torch's.

    python tools/fsdp_api_diff.py

Compares fully_shard's parameters, the public names of torch.distributed.fsdp's FSDP2 API,
and every method of torch's FSDPModule and UnshardHandle with dptc's: a method missing from
dptc, one that raises NotImplementedError (dptc's stub), or one whose parameters differ.
Exits 1 when something differs, so it can guard a torch upgrade.
"""

import inspect
import sys

import torch.distributed.fsdp as torch_fsdp

import dptc

# torch.distributed.fsdp's names that belong to FSDP1 or its configuration, which dptc takes
# from torch (dptc.fsdp re-exports those it uses) or which are modules.
_NOT_FSDP2 = {"FlatParameter", "FullOptimStateDictConfig", "LocalOptimStateDictConfig",
              "LocalStateDictConfig", "OptimStateDictConfig", "OptimStateKeyType",
              "ShardedOptimStateDictConfig", "StateDictConfig", "StateDictSettings", "api",
              "fully_sharded_data_parallel", "wrap"}


def _params(func):
    return {name: (p.kind, p.default) for name, p in inspect.signature(func).parameters.items()}


def _stub(func):
    """Whether func is dptc's NotImplementedError stub (_fully_shard._unsupported)."""
    return getattr(func, "__qualname__", "").startswith("_unsupported.")


def _compare_params(label, theirs, ours):
    out = []
    a, b = _params(theirs), _params(ours)
    for name in a:
        if name not in b and "kwargs" not in b:
            out.append(f"{label}: parameter {name!r} missing")
        elif name in b and a[name][0] != b[name][0]:
            out.append(f"{label}: parameter {name!r} is {b[name][0].name}, torch's "
                       f"{a[name][0].name}")
    out += [f"{label}: extra parameter {name!r}" for name in b if name not in a]
    return out


def differences():
    out = []
    out += _compare_params("fully_shard", inspect.unwrap(torch_fsdp.fully_shard),
                           dptc.fully_shard)
    for name in sorted(n for n in dir(torch_fsdp) if not n.startswith("_")):
        if name not in _NOT_FSDP2 and not hasattr(dptc, name):
            out.append(f"dptc.{name}: missing (torch.distributed.fsdp.{name})")
    for cls_name in ("FSDPModule", "UnshardHandle"):
        theirs, ours = getattr(torch_fsdp, cls_name), getattr(dptc, cls_name)
        for name, value in sorted(vars(theirs).items()):
            if not callable(value) or name.startswith("__"):
                continue
            mine = getattr(ours, name, None)
            label = f"{cls_name}.{name}"
            if mine is None:
                out.append(f"{label}: missing")
            elif _stub(mine):
                out.append(f"{label}: raises NotImplementedError")
            elif mine is not value:
                out += _compare_params(label, value, mine)
    return out


def main():
    import torch
    found = differences()
    print(f"torch {torch.__version__} against dptc: {len(found)} differences")
    for line in found:
        print("  " + line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
