"""Rank-side bodies of tests/test_slots.py: results with the staging slots overwritten between
collectives.

With a sentinel, every engine this process opens has local rank 0 fill every local rank's
staging slots of a stream with that byte between any two collectives on the stream (the C
engine's test-only `_fill_slots_between`, [Note: slots between collectives] in csrc/shm.c).
0xFF is NaN in every floating dtype and -1 in every integer one, so a collective that read a
slot its owner had not written in that collective would show it.  Each function returns what
the test compares between a run with the sentinel and one without: digests of every result,
their distance from the math or from single-process training, and how many fills ran.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["collectives", "ddp", "fully_shard"]

# Above the size that takes the large all-reduce and local rank 0's timing of the staging
# (STAGING_MEASURED_BYTES, 4 MiB), and no multiple of a round or of 64 bytes.
LARGE = (5 << 20) // 4 + 17
SMALL = 999                     # 4 KB: one round, the small all-reduce


class _Engines:
    """Every engine this process opens from now on (dptc.group._open_engine), with the
    sentinel set before its first collective."""

    def __init__(self, sentinel):
        import dptc.group as group
        self.sentinel, self.engines, self.fills = sentinel, [], 0
        opened = group._open_engine

        def open_engine(*args, **kwargs):
            engine, layout = opened(*args, **kwargs)
            if sentinel is not None:
                engine._fill_slots_between(sentinel)
            self.engines.append(engine)
            return engine, layout

        group._open_engine = open_engine

    def count(self):
        """Adds up the fills of the engines still open (call before destroying them)."""
        for engine in self.engines:
            if not engine.closed:
                self.fills += engine._fill_slots_between(None)
        self.engines = [e for e in self.engines if not e.closed]
        return self.fills


def _digest(tensors):
    digest = hashlib.sha256()
    for tensor in tensors:
        tensor = tensor.detach()
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _inputs(seed, case, size, count, dtype):
    """Every rank's input of case `case`, drawn alike on every rank."""
    out = []
    for rank in range(size):
        generator = torch.Generator().manual_seed(seed * 100_003 + case * 101 + rank)
        if dtype.is_floating_point:
            out.append(torch.randn(count, generator=generator, dtype=torch.float64).to(dtype))
        else:
            out.append(torch.randint(-1000, 1000, (count,), generator=generator, dtype=dtype))
    return out


def _sum(inputs, local_size=None):
    """The sum in rank order, as dptc's reductions add (bit for bit); across nodes, of each
    node's sum in rank order (two nodes: addition commutes, so gloo's order is moot)."""
    if local_size is not None and local_size < len(inputs):
        return _sum([_sum(inputs[at:at + local_size]) for at in range(0, len(inputs), local_size)])
    total = inputs[0].clone()
    for other in inputs[1:]:
        total += other
    return total


def _run_cases(dptc, group, members, seed, failures, digests):
    """Every staged kind of collective on `group` (ranks `members`), each checked bit for bit
    against the math; several are issued twice on the same unchanged tensors, as DDP
    broadcasts unchanged buffers every forward.  Returns how many collectives it issued."""
    from dptc._dtypes import OP_ALL_REDUCE, REDOP_SUM, dtype_code
    size, rank = len(members), members.index(torch.distributed.get_rank())
    before = len(digests)
    assert group.nnodes <= 2, "two nodes at most: _sum adds nodes in either order"
    case = [0]

    def check(label, got, expected):
        digests.append(_digest([got]))
        if not torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8)):
            bad = (got != expected).nonzero().flatten()
            first = bad[0].item() if bad.numel() else -1
            failures.append(f"{label} on {members}: {bad.numel()} of {got.numel()} elements "
                            f"differ, first at {first}: {got.flatten()[first].item()} != "
                            f"{expected.flatten()[first].item()}")

    def draw(count, dtype):
        case[0] += 1
        return _inputs(seed, case[0] + 1000 * len(digests), size, count, dtype)

    for dtype, count, stream in ((torch.float32, SMALL, 0), (torch.float32, LARGE, 0),
                                 (torch.int64, LARGE // 2 + 3, 1), (torch.float64, SMALL, 1)):
        label = f"{dtype} count {count} stream {stream}"
        inputs = draw(count, dtype)
        for repeat in range(2):
            got = inputs[rank].clone()
            dptc.all_reduce(got, group=group, stream=stream)
            check(f"all_reduce {label} #{repeat}", got, _sum(inputs, group.local_size))
        # DDP's form: an all-reduce in place on several pieces (see [Note: several pieces]).
        pieces = list(inputs[rank].clone().tensor_split(3))
        group._c.run(OP_ALL_REDUCE, dtype_code(dtype), REDOP_SUM, None, pieces, count, 0,
                     stream)
        check(f"all_reduce pieces {label}", torch.cat(pieces), _sum(inputs, group.local_size))
        inputs = draw(count // size + 1, dtype)
        for repeat in range(2):
            got = torch.empty(len(inputs[0]) * size, dtype=dtype)
            dptc.all_gather_into_tensor(got, inputs[rank], group=group, stream=stream)
            check(f"all_gather {label} #{repeat}", got, torch.cat(inputs))
        # FSDP's form: straight into several outputs.
        n = len(inputs[0])
        outputs = [torch.empty(size * k, dtype=dtype) for k in (n // 2, n - n // 2)]
        dptc.all_gather_into_tensors(outputs, inputs[rank], group=group, stream=stream)
        expected = [torch.cat([x[:n // 2] for x in inputs]),
                    torch.cat([x[n // 2:] for x in inputs])]
        check(f"all_gather_into_tensors {label}", torch.cat(outputs), torch.cat(expected))
        inputs = draw((count // size + 1) * size, dtype)
        for repeat in range(2):
            got = torch.empty(len(inputs[0]) // size, dtype=dtype)
            dptc.reduce_scatter_tensor(got, inputs[rank], group=group, stream=stream)
            check(f"reduce_scatter {label} #{repeat}", got,
                  _sum(inputs, group.local_size).chunk(size)[rank])
        inputs = draw(count, dtype)
        for root in (members[0], members[-1]):
            for repeat in range(2):
                got = inputs[rank].clone() if members[rank] == root else \
                    torch.zeros(count, dtype=dtype)
                dptc.broadcast(got, src=root, group=group, stream=stream)
                check(f"broadcast from {root} {label} #{repeat}", got,
                      inputs[members.index(root)])
        dptc.barrier(group=group, stream=stream)
    return len(digests) - before + 4       # a barrier per dtype


def collectives(seed: int, sentinel=None, groups=None):
    """The cases of _run_cases on the world, then on each group of `groups` (lists of global
    ranks; by default every rank but the last, a group of one at 2 ranks where nothing is
    staged, and ranks [0, 1] where there are 3 or more).  Returns the failures, the digest of
    every result and the fills."""
    import dptc
    engines = _Engines(sentinel)
    dptc.init_process_group()
    world = dptc.get_world_size()
    if groups is None:
        groups = [list(range(world - 1))] + ([[0, 1]] if world > 2 else [])
    failures, digests = [], []
    # Collectives on groups with a peer: those open with a fill (a group of one has no
    # slots to read).
    staged = _run_cases(dptc, dptc.group.default_group(), list(range(world)), seed, failures,
                        digests)
    for members in groups:
        group = dptc.new_group(members)
        if group is not torch.distributed.GroupMember.NON_GROUP_MEMBER:
            issued = _run_cases(dptc, group, members, seed, failures, digests)
            staged += issued if len(members) > 1 else 0
    dptc.barrier()
    staged += 1
    fills = engines.count()
    dptc.destroy_process_group()
    return {"failures": failures, "digests": digests, "fills": fills, "issued": staged}


def ddp(seed: int, steps: int, sentinel=None):
    """dptc's DDP (buffers broadcast, gradients all-reduced as pieces during backward) trains
    an MLP for `steps` SGD steps beside a single-process copy on the whole batch.  Returns the
    parameters' digest, their largest relative difference from the copy, and the fills."""
    import dptc
    from tests.workers_staging import train_ddp_beside_single
    engines = _Engines(sentinel)
    dptc.init_process_group()
    model, worst = train_ddp_beside_single(seed, steps)
    result = {"digest": _digest(model.module.parameters()), "max_rel": worst,
              "fills": engines.count()}
    dptc.destroy_process_group()
    return result


def fully_shard(scenarios, sentinel=None):
    """Each scenario of tests/workers_fsdp.py's training (3 steps of 2 micro-batches, AdamW)
    under dptc's fully_shard: {name: digest of the trained full parameters, distance from the
    single-process reference where it trains one}, and the fills."""
    import dptc
    from tests import workers_fsdp
    engines = _Engines(sentinel)
    dptc.init_process_group()
    results = {}
    for name in scenarios:
        out = workers_fsdp._run("dptc", name, workers_fsdp.SCENARIOS[name])
        params = [torch.tensor(values, dtype=torch.float64) for values in out["params"].values()]
        results[name] = {"digest": _digest(params), "ref_rel": out.get("ref_rel"),
                         "losses": out["losses"]}
    fills = engines.count()
    workers_fsdp._finish("dptc")
    return {"scenarios": results, "fills": fills}
