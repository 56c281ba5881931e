"""Rank-side functions for tests/test_subgroups.py and tests/scripts/two_node_subgroups.py.

Subgroups: the same checks run against torch.distributed on gloo (the reference) and dptc, with
the groups made three ways ("sources"):

    "own"    the implementation's new_group (dist.new_group for torch, dptc.new_group for dptc);
    "torch"  torch.distributed.new_group, passed to the implementation's collectives;
    "mesh"   the two dimensions of init_device_mesh("cpu", (2, 2), ("replicate", "shard")).

Inputs are drawn per (seed, case, GLOBAL rank) with tests.workers_collectives.make_input, so each
member regenerates the other members' inputs and computes the expected result from the math; a
group that mixes up who its members are, or which block belongs to whom, shows as wrong numbers.
Functions return lists of failure strings (empty: pass), grouped in sections, so one launch
serves several tests.

dptc only: streams (a keyword `stream` on every collective; a group has `num_streams`
independent ordered streams), and the node layout of a group (`nnodes`, `local_size`).
"""

from __future__ import annotations

import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests._rank import load_impl, start_clock
from tests.workers_collectives import _compare, _reduce, _tolerance, make_input
from tests._compare import max_rel

__all__ = [
    "GROUPS", "CONCURRENT", "CYCLIC_ORDER", "subgroup_checks", "all_checks", "ddp_replicas",
    "stream_checks", "stream_mismatch",
]

# Created by every rank in this order.  (3, 0) is given unsorted on purpose: the group's ranks
# are sorted as torch does, so global rank 0 is group rank 0 and global rank 3 group rank 1.
GROUPS = ((0, 1), (2, 3), (0, 2), (1, 3), (3, 0))
# A ring of groups in which every rank of 4 is in exactly two: used to have two groups in flight
# on one rank at once.
CONCURRENT = ((0, 1), (0, 2), (1, 3), (2, 3))
# The order in which each rank issues its two ring groups in the "cyclic" check: rank 0 waits
# for rank 1 in (0, 1), rank 1 for rank 3 in (1, 3), rank 3 for rank 2 in (2, 3), rank 2 for
# rank 0 in (0, 2).  Only groups that progress independently of each other complete it.
CYCLIC_ORDER = {0: ((0, 1), (0, 2)), 1: ((1, 3), (0, 1)), 3: ((2, 3), (1, 3)),
                2: ((0, 2), (2, 3))}
MESH_SHAPE = (2, 2)
MESH_DIMS = ("replicate", "shard")

SIZES = (0, 1, 1023)
MEDIUM_COUNT = 300_001
# A big integer range: int64 sums that a 32-bit (or float) path would get wrong.
BIG_INT = 2 ** 40
BARRIER_DELAY_S = 0.3

_MAX_REPORTED = 40


# ---------------------------------------------------------------------------------------------
# Inputs, expected values

def _input(kind, dtype, n, seed, case, rank):
    """make_input, plus "big": int64 in [-2**40, 2**40), distinct per rank."""
    if kind == "big":
        g = torch.Generator().manual_seed((seed * 1_000_003 + case * 1009 + rank) % (2 ** 62))
        return torch.randint(-BIG_INT, BIG_INT, (n,), generator=g, dtype=torch.int64)
    return make_input(kind, dtype, n, seed, case, rank)


def _sum_kind(dtype):
    return "big" if dtype == torch.int64 else "small"


def _avg_kind(dtype):
    return "round16" if dtype in (torch.bfloat16, torch.float16) else "round"


def _garbage(dtype, n, rank):
    """Output buffers start as this, so an unwritten (or wrongly written) block shows."""
    return torch.full((n,), 77 + rank, dtype=dtype)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _check_reduced(label, got, inputs, op, dtype, kind, size):
    expected, abs_sum = _reduce(op, inputs, dtype, "small" if kind == "big" else kind)
    tolerance = _tolerance(op, "small" if kind == "big" else kind, dtype, size, False, abs_sum)
    if tolerance is None:
        return _compare(label, got, expected, mode="exact")
    return _compare(label, got, expected, mode="close", tolerance=tolerance)


# ---------------------------------------------------------------------------------------------
# The API under test, with groups

class _Api:
    """Collectives of `impl`, groups from `source`.

    torch.distributed is initialised first (gloo, with DPTC_TIMEOUT) whenever the torch side is
    involved: impl "torch", or torch-made groups handed to dptc.
    """

    def __init__(self, impl, source):
        self.source = source
        if impl == "torch" or source in ("torch", "mesh"):
            load_impl("torch")
        self.impl = load_impl(impl)
        self.name = impl
        self.rank = dist.get_rank() if impl == "torch" else self.impl.get_rank()
        self.world_size = (dist.get_world_size() if impl == "torch"
                           else self.impl.get_world_size())
        self.RO = self.impl.ReduceOp

    def new_group(self, ranks):
        if self.source == "own" and self.name == "dptc":
            return self.impl.module.new_group(list(ranks))
        return dist.new_group(list(ranks))

    def groups(self):
        """{sorted members: group handle (NON_GROUP_MEMBER for non-members)}, made in one order
        on every rank."""
        if self.source == "mesh":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_DIMS)
            shard = mesh.get_group("shard")
            replicate = mesh.get_group("replicate")
            row, column = divmod(self.rank, MESH_SHAPE[1])
            result = {}
            # The mesh is [[0, 1], [2, 3]]: "shard" runs along a row, "replicate" along a column.
            result[tuple(row * MESH_SHAPE[1] + c for c in range(MESH_SHAPE[1]))] = shard
            result[tuple(r * MESH_SHAPE[1] + column for r in range(MESH_SHAPE[0]))] = replicate
            return result
        return {tuple(sorted(ranks)): self.new_group(ranks) for ranks in GROUPS}


# ---------------------------------------------------------------------------------------------
# Checks on one group

class _GroupChecks:
    def __init__(self, api, seed, members, group, index, large, layout):
        self.api = api
        self.seed = seed
        self.members = members
        self.group = group
        self.size = len(members)
        self.rank = api.rank
        self.grank = members.index(api.rank)
        self.case0 = 100_000 * (index + 1)
        self.case = 0
        self.large = large
        self.layout = layout
        self.tag = f"group {list(members)} rank {self.rank}"
        self.failures = []

    def _next_case(self):
        self.case += 1
        return self.case0 + self.case

    def _note(self, problem):
        if problem:
            self.failures.append(problem)

    def _inputs(self, kind, dtype, n, case):
        return {r: _input(kind, dtype, n, self.seed, case, r) for r in self.members}

    def run(self):
        self.identity()
        self.all_reduce()
        self.broadcast()
        self.all_gather()
        self.reduce_scatter()
        self.barrier()
        return self.failures

    # -- who is who

    def identity(self):
        api, group = self.api, self.group
        got = (api.impl.get_rank(group), api.impl.get_world_size(group))
        if got != (self.grank, self.size):
            self.failures.append(f"{self.tag}: get_rank(group), get_world_size(group) = {got}, "
                                 f"expected {(self.grank, self.size)}")
        if api.source != "own" or api.name != "dptc":
            ranks = dist.get_process_group_ranks(group)
            if ranks != list(self.members):
                self.failures.append(f"{self.tag}: torch group ranks {ranks}, expected "
                                     f"{list(self.members)} (test setup)")
            return
        dptc = api.impl.module
        if not isinstance(group, dptc.ProcessGroup):
            self.failures.append(f"{self.tag}: dptc.new_group returned {group!r}, expected a "
                                 f"dptc.ProcessGroup")
            return
        for name, expected in (("rank", self.grank), ("size", self.size),
                               ("ranks", list(self.members))):
            value = getattr(group, name, "<missing>")
            if value != expected:
                self.failures.append(f"{self.tag}: group.{name} = {value!r}, expected "
                                     f"{expected!r}")
        if self.layout:
            local_world = int(os.environ["LOCAL_WORLD_SIZE"])
            node = self.rank // local_world
            expected = {"nnodes": len({r // local_world for r in self.members}),
                        "local_size": sum(1 for r in self.members if r // local_world == node)}
            for name, value in expected.items():
                got = getattr(group, name, "<missing>")
                if got != value:
                    self.failures.append(f"{self.tag}: group.{name} = {got!r}, expected "
                                         f"{value!r} (node layout: {local_world} ranks a node)")

    # -- collectives

    def all_reduce(self):
        api, RO = self.api, self.api.RO
        cases = []
        for n in SIZES + ((MEDIUM_COUNT,) if self.large else ()):
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                cases.append(("SUM", dtype, _sum_kind(dtype), n))
                if dtype.is_floating_point:
                    cases.append(("AVG", dtype, _avg_kind(dtype), n))
        for op, dtype, kind, n in cases:
            case = self._next_case()
            inputs = self._inputs(kind, dtype, n, case)
            tensor = inputs[self.rank].clone()
            label = f"{self.tag}: all_reduce({op}) {_dtype_name(dtype)} n={n}"
            result = api.impl.all_reduce(tensor, op=getattr(RO, op), group=self.group)
            if result is not None:
                self.failures.append(f"{label}: returned {result!r}, expected None")
            self._note(_check_reduced(label, tensor, list(inputs.values()), op, dtype, kind,
                                      self.size))

    def broadcast(self):
        api = self.api
        n = 1023
        for src in self.members:
            group_src = self.members.index(src)
            for how in ("src", "group_src"):
                for dtype in (torch.float32, torch.int64):
                    case = self._next_case()
                    kind = "bits" if dtype.is_floating_point else "big"
                    tensor = _input(kind, dtype, n, self.seed, case, self.rank)
                    expected = _input(kind, dtype, n, self.seed, case, src)
                    if how == "src":
                        api.impl.broadcast(tensor, src=src, group=self.group)
                    else:
                        api.impl.broadcast(tensor, group=self.group, group_src=group_src)
                    label = (f"{self.tag}: broadcast({how}={src if how == 'src' else group_src}"
                             f") {_dtype_name(dtype)} n={n}")
                    self._note(_compare(label, tensor, expected, mode="bits"))
        if self.large:
            case = self._next_case()
            src = self.members[-1]
            tensor = _input("bits", torch.float32, MEDIUM_COUNT, self.seed, case, self.rank)
            api.impl.broadcast(tensor, src=src, group=self.group)
            expected = _input("bits", torch.float32, MEDIUM_COUNT, self.seed, case, src)
            self._note(_compare(f"{self.tag}: broadcast(src={src}) float32 n={MEDIUM_COUNT}",
                                tensor, expected, mode="bits"))

    def all_gather(self):
        api = self.api
        cases = [(torch.float32, n) for n in SIZES + ((MEDIUM_COUNT,) if self.large else ())]
        cases += [(torch.bfloat16, 1023), (torch.int64, 1023)]
        for dtype, n in cases:
            case = self._next_case()
            kind = "big" if dtype == torch.int64 else "bits"
            inputs = self._inputs(kind, dtype, n, case)
            mine = inputs[self.rank].clone()
            output = _garbage(dtype, n * self.size, self.rank)
            api.impl.all_gather_into_tensor(output, mine, group=self.group)
            expected = torch.cat([inputs[r] for r in self.members])  # by group rank
            label = f"{self.tag}: all_gather_into_tensor {_dtype_name(dtype)} n={n}"
            self._note(_compare(label, output, expected, mode="bits")
                       or _compare(label + " (input changed)", mine, inputs[self.rank],
                                   mode="bits"))

    def reduce_scatter(self):
        api, RO = self.api, self.api.RO
        cases = [(torch.float32, n) for n in SIZES + ((MEDIUM_COUNT,) if self.large else ())]
        cases += [(torch.bfloat16, 1023), (torch.int64, 1023)]
        for dtype, n in cases:
            case = self._next_case()
            kind = _sum_kind(dtype)
            # Every rank's input differs, and so does every block of it.
            inputs = self._inputs(kind, dtype, n * self.size, case)
            mine = inputs[self.rank].clone()
            output = _garbage(dtype, n, self.rank)
            api.impl.reduce_scatter_tensor(output, mine, op=RO.SUM, group=self.group)
            block = [inputs[r][self.grank * n:(self.grank + 1) * n] for r in self.members]
            label = f"{self.tag}: reduce_scatter_tensor(SUM) {_dtype_name(dtype)} n={n}"
            self._note(_check_reduced(label, output, block, "SUM", dtype, kind, self.size)
                       or _compare(label + " (input changed)", mine, inputs[self.rank],
                                   mode="bits"))

    def barrier(self):
        """barrier(group) holds the members until the last member (by global rank) arrives."""
        api = self.api
        api.impl.barrier(group=self.group)
        late = self.members[-1]
        if self.rank == late:
            time.sleep(BARRIER_DELAY_S)
        started = time.monotonic()
        api.impl.barrier(group=self.group)
        waited = time.monotonic() - started
        if self.rank != late and waited < BARRIER_DELAY_S / 2:
            self.failures.append(f"{self.tag}: barrier(group) returned after {waited:.3f} s "
                                 f"although rank {late} arrived {BARRIER_DELAY_S} s later")


def _non_member_checks(api, members, group):
    """A rank outside `group`: the handle is NON_GROUP_MEMBER, get_rank/get_world_size are -1,
    and every collective returns None without touching its tensors."""
    tag = f"group {list(members)} non-member rank {api.rank}"
    failures = []
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        failures.append(f"{tag}: new_group returned {group!r}, expected "
                        f"torch.distributed.GroupMember.NON_GROUP_MEMBER")
    got = (api.impl.get_rank(group), api.impl.get_world_size(group))
    if got != (-1, -1):
        failures.append(f"{tag}: get_rank(group), get_world_size(group) = {got}, expected "
                        f"(-1, -1)")
    n = 16
    size = len(members)
    tensor = torch.arange(n, dtype=torch.float32) + api.rank
    before = tensor.clone()
    output = _garbage(torch.float32, n * size, api.rank)
    output_before = output.clone()
    shard = _garbage(torch.float32, n, api.rank)
    shard_before = shard.clone()
    RO = api.RO
    calls = [
        ("all_reduce", lambda: api.impl.all_reduce(tensor, op=RO.SUM, group=group)),
        ("all_reduce(async_op=True)",
         lambda: api.impl.all_reduce(tensor, op=RO.SUM, group=group, async_op=True)),
        # torch 2.13 raises ValueError for broadcast(src=<global rank>) on a non-member (it
        # maps src to a group rank before it checks membership); group_src returns None.
        ("broadcast(group_src=0)", lambda: api.impl.broadcast(tensor, group=group, group_src=0)),
        ("all_gather_into_tensor",
         lambda: api.impl.all_gather_into_tensor(output, tensor, group=group)),
        ("reduce_scatter_tensor",
         lambda: api.impl.reduce_scatter_tensor(shard, output, op=RO.SUM, group=group)),
        ("barrier", lambda: api.impl.barrier(group=group)),
    ]
    for label, call in calls:
        try:
            result = call()
        except Exception as error:  # noqa: BLE001 - reported as a failure
            failures.append(f"{tag}: {label} raised {type(error).__name__}: {error}; expected "
                            f"None")
            continue
        if result is not None:
            failures.append(f"{tag}: {label} returned {result!r}, expected None")
    for label, got, want in (("tensor", tensor, before), ("output", output, output_before),
                             ("shard", shard, shard_before)):
        problem = _compare(f"{tag}: {label} after the non-member calls", got, want, mode="bits")
        if problem:
            failures.append(problem)
    return failures


# ---------------------------------------------------------------------------------------------
# Two groups in flight on one rank

def _two_groups_in_flight(api, groups, seed, order, label):
    """Async all_reduce on both of this rank's ring groups, issued in `order` before waiting on
    either; then all_gather_into_tensor on the first and reduce_scatter_tensor on the second,
    both async.  Each must give its own group's result."""
    RO = api.RO
    rank = api.rank
    mine = [m for m in order if rank in m]
    tag = f"{label} rank {rank} groups {[list(m) for m in mine]}"
    failures = []
    n = 100_003  # big enough that both transfers are under way together
    cases = {m: 900_000 + 1000 * CONCURRENT.index(m) for m in mine}
    inputs = {m: {r: _input("small", torch.float32, n, seed, cases[m], r) for r in m}
              for m in mine}
    tensors = {m: inputs[m][rank].clone() for m in mine}
    handles = [(m, api.impl.all_reduce(tensors[m], op=RO.SUM, group=groups[m], async_op=True))
               for m in mine]
    for m, handle in reversed(handles):
        if handle is None:
            failures.append(f"{tag}: all_reduce(async_op=True) on {list(m)} returned None")
            continue
        handle.wait()
    for m in mine:
        problem = _check_reduced(f"{tag}: async all_reduce on {list(m)}", tensors[m],
                                 [inputs[m][r] for r in m], "SUM", torch.float32, "small",
                                 len(m))
        if problem:
            failures.append(problem)

    # Round 2: all_gather_into_tensor on the ring's even groups, reduce_scatter_tensor(SUM) on
    # its odd ones (each group runs one op on all its members); ranks 0 and 3 have one of each.
    k = 1023
    outputs, expected = {}, {}
    issue = {}
    for m in mine:
        g = m.index(rank)
        if CONCURRENT.index(m) % 2 == 0:
            given = {r: _input("bits", torch.float32, k, seed, cases[m] + 1, r) for r in m}
            outputs[m] = _garbage(torch.float32, k * len(m), rank)
            expected[m] = ("all_gather_into_tensor", torch.cat([given[r] for r in m]), None)
            issue[m] = (lambda m=m, x=given[rank].clone(): api.impl.all_gather_into_tensor(
                outputs[m], x, group=groups[m], async_op=True))
        else:
            given = {r: _input("small", torch.float32, k * len(m), seed, cases[m] + 1, r)
                     for r in m}
            outputs[m] = _garbage(torch.float32, k, rank)
            expected[m] = ("reduce_scatter_tensor(SUM)", None,
                           [given[r][g * k:(g + 1) * k] for r in m])
            issue[m] = (lambda m=m, x=given[rank].clone(): api.impl.reduce_scatter_tensor(
                outputs[m], x, op=RO.SUM, group=groups[m], async_op=True))
    handles = [(m, issue[m]()) for m in mine]
    for m, handle in reversed(handles):
        if handle is None:
            failures.append(f"{tag}: async op on {list(m)} returned None")
        else:
            handle.wait()
    for m in mine:
        name, copy, blocks = expected[m]
        label = f"{tag}: async {name} on {list(m)}"
        if copy is not None:
            problem = _compare(label, outputs[m], copy, mode="bits")
        else:
            problem = _check_reduced(label, outputs[m], blocks, "SUM", torch.float32, "small",
                                     len(m))
        if problem:
            failures.append(problem)
    return failures


# ---------------------------------------------------------------------------------------------
# Entry points

def subgroup_checks(impl: str, sources=("own",), seed: int = 11, large: bool = True,
                    layout: bool = False, cyclic: bool = True):
    """Every subgroup check, for each source of groups in `sources` (run in that order).

    Returns {source: {"members": [...], "nonmembers": [...], "concurrent": [...],
    "cyclic": [...]}}, lists of failures.  layout=True also checks group.nnodes and
    group.local_size (dptc's own groups only).  The cyclic check runs last: an
    implementation whose groups block each other hangs there (until its timeout) after
    every other check has been recorded.
    """
    return _checks(impl, sources, seed, large, layout, cyclic)


def all_checks(impl: str, sources=("own",), ddp_kinds=("own",), seed: int = 11):
    """subgroup_checks, with ddp_replicas(impl, ddp_kinds) run before the cyclic check, in one
    launch: {"groups": subgroup_checks' result, "ddp": ddp_replicas' result}."""
    between = {}
    groups = _checks(impl, sources, seed, True, False, True,
                     between=lambda: between.update(ddp_replicas(impl, ddp_kinds)))
    return {"groups": groups, "ddp": between}


def _checks(impl, sources, seed, large, layout, cyclic, between=None):
    result = {}
    made = []
    for source in sources:
        api = _Api(impl, source)
        if api.world_size != 4:
            raise ValueError(f"subgroup checks need 4 ranks, got {api.world_size}")
        groups = api.groups()
        made.append((source, api, groups))
        sections = {"members": [], "nonmembers": [], "concurrent": [], "cyclic": []}
        for index, members in enumerate(sorted(groups, key=_group_order)):
            group = groups[members]
            if api.rank in members:
                checks = _GroupChecks(api, seed, members, group, index, large,
                                      layout and source == "own" and impl == "dptc")
                sections["members"] += checks.run()
            else:
                sections["nonmembers"] += _non_member_checks(api, members, group)
        sections["concurrent"] = _two_groups_in_flight(api, groups, seed, CONCURRENT,
                                                       "two groups in flight")
        result[source] = {name: _cap(lines) for name, lines in sections.items()}
    if between is not None:
        between()
    if cyclic:
        for source, api, groups in made:
            result[source]["cyclic"] = _cap(_two_groups_in_flight(
                api, groups, seed + 1, CYCLIC_ORDER[api.rank],
                "two groups in flight, cyclic issue order"))
    if made:
        made[-1][1].impl.barrier()
    return result


def _group_order(members):
    """Groups in GROUPS order (the mesh's two groups: shard first, as made)."""
    for index, ranks in enumerate(GROUPS):
        if tuple(sorted(ranks)) == members:
            return index
    return len(GROUPS)


def _cap(lines):
    if len(lines) > _MAX_REPORTED:
        return lines[:_MAX_REPORTED] + [f"... and {len(lines) - _MAX_REPORTED} more failures"]
    return lines


# ---------------------------------------------------------------------------------------------
# DDP over subgroups

DDP_SEED = 4321
DDP_STEPS = 3
DDP_ROWS = 6
DDP_LR = 0.1
REPLICAS = ((0, 1), (2, 3))


def _ddp_model():
    torch.manual_seed(DDP_SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _ddp_batch(rank, step):
    g = torch.Generator().manual_seed(DDP_SEED * 1000 + rank * 10 + step)
    return torch.randn(DDP_ROWS, 8, generator=g), torch.randn(DDP_ROWS, 4, generator=g)


def _sgd_step(params):
    """Plain SGD (p -= lr * grad), then the gradients are cleared.  By hand: torch.optim's
    constructor imports torch._dynamo, seconds of start-up per rank on this machine."""
    with torch.no_grad():
        for p in params:
            p.sub_(p.grad, alpha=DDP_LR)
            p.grad = None


def ddp_replicas(impl: str, kinds=("own",)):
    """Two DDP replicas, over [0, 1] and [2, 3], each rank with its own batches.

    kinds: "own" (impl's new_group), "torch" (dist.new_group handed to dptc's DDP).  For each
    kind returns {"params": flat list, "ref_rel": max relative difference from single-process
    SGD on the concatenation of the replica members' batches, "moved": how far training moved
    the parameters (relative), "replica": members}.
    """
    result = {}
    for kind in kinds:
        api = _Api(impl, kind)
        rank = api.rank
        groups = {tuple(m): api.new_group(m) for m in REPLICAS}
        members = next(m for m in REPLICAS if rank in m)
        model = _ddp_model()
        initial = [p.detach().clone() for p in model.parameters()]
        reference = _ddp_model()
        if impl == "dptc":
            wrapper = api.impl.module.DistributedDataParallel
        else:
            wrapper = torch.nn.parallel.DistributedDataParallel
        ddp = wrapper(model, process_group=groups[members])
        for step in range(DDP_STEPS):
            x, y = _ddp_batch(rank, step)
            F.mse_loss(ddp(x), y).backward()
            _sgd_step(ddp.parameters())
            batches = [_ddp_batch(r, step) for r in members]
            F.mse_loss(reference(torch.cat([b[0] for b in batches])),
                       torch.cat([b[1] for b in batches])).backward()
            _sgd_step(reference.parameters())
        params = [p.detach() for p in model.parameters()]
        result[kind] = {
            "params": torch.cat([p.flatten() for p in params]).tolist(),
            "ref_rel": max_rel(params, [p.detach() for p in reference.parameters()]),
            "moved": max_rel(initial, params),
            "replica": list(members),
        }
        api.impl.barrier()
    return result


# ---------------------------------------------------------------------------------------------
# Streams (dptc only)

BIG_MIB = 256
SMALL_COUNT = 256  # float32: 1 KiB
HOLD_S = 0.5


def _pattern(start, stop):
    """Small integers, exact in float32 sums: (index % 7) for indices [start, stop)."""
    return torch.arange(start, stop, dtype=torch.int32).remainder_(7).to(torch.float32)


def _stream_pair(api, rank, big_in, big_out, hold):
    """reduce_scatter_tensor(big) on stream 1, all_gather_into_tensor(1 KiB) on stream 0.

    hold=False: both ranks submit the big op, then at once the small op.
    hold=True: rank 1 submits the big op only HOLD_S after its small op completed, so rank 0's
    big op cannot complete before then: its small op completes only if stream 0 does not wait
    behind stream 1.
    Returns (timings, small output).
    """
    dptc = api.module
    small_in = torch.full((SMALL_COUNT,), float(rank + 1))
    small_out = torch.full((SMALL_COUNT * 2,), -1.0)
    big_out.fill_(-1.0)
    api.barrier()
    t0 = time.monotonic()
    big = None
    if not (hold and rank == 1):
        big = dptc.reduce_scatter_tensor(big_out, big_in, op=api.ReduceOp.SUM, async_op=True,
                                         stream=1)
    t1 = time.monotonic()
    small = dptc.all_gather_into_tensor(small_out, small_in, async_op=True, stream=0)
    small.wait()
    t2 = time.monotonic()
    big_done_at_small = big.is_completed() if big is not None else None
    if big is None:
        time.sleep(HOLD_S)
        big = dptc.reduce_scatter_tensor(big_out, big_in, op=api.ReduceOp.SUM, async_op=True,
                                         stream=1)
    big.wait()
    t3 = time.monotonic()
    return {"small_latency_s": t2 - t1, "big_total_s": t3 - t0,
            "big_completed_when_small_done": big_done_at_small}, small_out


def stream_checks(impl: str = "dptc", big_mib: int = BIG_MIB):
    """2 ranks.  Sections: "attributes", "held", "concurrent", "bad_stream", "order"
    (failure lists) and "timings" (per phase: small op latency, big op total, whether the big
    op had completed when the small one was done)."""
    api = load_impl(impl)
    dptc = api.module
    rank, world_size = api.get_rank(), api.get_world_size()
    if world_size != 2:
        raise ValueError(f"stream_checks needs 2 ranks, got {world_size}")
    result = {"attributes": [], "held": [], "concurrent": [], "bad_stream": [], "order": [],
              "timings": {}}

    group = dptc.new_group([0, 1])
    streams = getattr(group, "num_streams", "<missing>")
    if streams != 2:
        result["attributes"].append(f"new_group([0, 1]).num_streams = {streams!r}, expected 2")
    check = torch.full((5,), float(rank + 1))
    dptc.all_reduce(check, group=group, stream=1)
    if not torch.equal(check, torch.full((5,), 3.0)):
        result["attributes"].append(f"all_reduce(stream=1) on new_group([0, 1]) gave "
                                    f"{check.tolist()}, expected 3.0")

    count = big_mib * 2 ** 20 // 4
    count -= count % world_size
    shard = count // world_size
    big_in = _pattern(0, count).add_(rank)   # 256 MiB of float32
    big_out = torch.empty(shard)
    expected_big = _pattern(rank * shard, (rank + 1) * shard).mul_(2).add_(1)  # sum of r = 0, 1
    expected_small = torch.cat([torch.full((SMALL_COUNT,), 1.0),
                                torch.full((SMALL_COUNT,), 2.0)])
    for phase, hold in (("held", True), ("concurrent", False)):
        timings, small_out = _stream_pair(api, rank, big_in, big_out, hold)
        result["timings"][phase] = timings
        failures = result[phase]
        for label, got, expected in (("small all_gather_into_tensor", small_out, expected_small),
                                     ("big reduce_scatter_tensor", big_out, expected_big)):
            problem = _compare(f"{phase}: {label} rank {rank}", got, expected, mode="exact")
            if problem:
                failures.append(problem)
        if timings["big_completed_when_small_done"] is True:
            failures.append(f"{phase}: rank {rank}: the stream-1 reduce_scatter_tensor was "
                            f"already completed when the stream-0 all_gather_into_tensor "
                            f"finished ({timings}); the small op did not overtake the big one")
        if hold and rank == 0 and timings["small_latency_s"] >= HOLD_S:
            failures.append(f"held: rank 0's stream-0 op took {timings['small_latency_s']:.3f} "
                            f"s, as long as rank 1 held back its stream-1 op ({HOLD_S} s)")
        if not hold and timings["small_latency_s"] >= timings["big_total_s"]:
            failures.append(f"concurrent: rank {rank}: small op latency "
                            f"{timings['small_latency_s']:.3f} s >= big op total "
                            f"{timings['big_total_s']:.3f} s")
    del big_in, big_out, expected_big

    x = torch.ones(8)
    for label, call in (
            ("all_reduce(stream=5)", lambda: dptc.all_reduce(x, stream=5)),
            ("all_reduce(stream=-1)", lambda: dptc.all_reduce(x, stream=-1)),
            ("all_gather_into_tensor(stream=2)",
             lambda: dptc.all_gather_into_tensor(torch.empty(16), x, stream=2)),
            ("broadcast(stream=5, async_op=True)",
             lambda: dptc.broadcast(x, 0, async_op=True, stream=5))):
        try:
            call()
        except ValueError as error:
            if not re.search(r"\bstream\b", str(error)):
                result["bad_stream"].append(f"{label}: ValueError {str(error)!r} does not name "
                                            f"`stream`")
        except Exception as error:  # noqa: BLE001
            result["bad_stream"].append(f"{label}: raised {type(error).__name__}: {error}; "
                                        f"expected ValueError")
        else:
            result["bad_stream"].append(f"{label}: no exception; expected ValueError")
    check = torch.full((3,), float(rank + 1))
    dptc.all_reduce(check)
    if not torch.equal(check, torch.full((3,), 3.0)):
        result["bad_stream"].append(f"all_reduce after the bad calls gave {check.tolist()}")

    result["order"] = _per_stream_order(api, rank)
    api.barrier()
    return result


def _per_stream_order(api, rank):
    """The same ops per stream, in a different interleaving of the streams on the two ranks:
    rank 0 issues A1 B1 A2 B2, rank 1 B1 B2 A1 A2 (A on stream 0, B on stream 1), all async."""
    dptc = api.module
    RO = api.ReduceOp
    a1 = torch.full((10,), float(rank + 1))
    a2 = torch.arange(10, dtype=torch.float64) * (rank + 1)
    b1_in = torch.full((7,), float(10 * (rank + 1)))
    b1_out = torch.full((14,), -1.0)
    b2 = torch.full((6,), float(rank + 5), dtype=torch.float64)
    ops = {
        "A1": lambda: dptc.all_reduce(a1, op=RO.SUM, async_op=True, stream=0),
        "A2": lambda: dptc.all_reduce(a2, op=RO.MAX, async_op=True, stream=0),
        "B1": lambda: dptc.all_gather_into_tensor(b1_out, b1_in, async_op=True, stream=1),
        "B2": lambda: dptc.broadcast(b2, 1, async_op=True, stream=1),
    }
    order = ("A1", "B1", "A2", "B2") if rank == 0 else ("B1", "B2", "A1", "A2")
    handles = {name: ops[name]() for name in order}
    for name in order:
        handles[name].wait()
    failures = []
    for label, got, expected in (
            ("A1 all_reduce(SUM) stream 0", a1, torch.full((10,), 3.0)),
            ("A2 all_reduce(MAX) stream 0", a2, torch.arange(10, dtype=torch.float64) * 2),
            ("B1 all_gather_into_tensor stream 1", b1_out,
             torch.cat([torch.full((7,), 10.0), torch.full((7,), 20.0)])),
            ("B2 broadcast(src=1) stream 1", b2, torch.full((6,), 6.0, dtype=torch.float64))):
        problem = _compare(f"order {order} rank {rank}: {label}", got, expected, mode="exact")
        if problem:
            failures.append(problem)
    return failures


def stream_mismatch(impl: str = "dptc"):
    """4 ranks, groups [0, 1] and [2, 3]: in [0, 1] rank 0 all_reduces 10 float32 on stream 0
    and rank 1 11; in [2, 3] the same on stream 1 (rank 2: 10, rank 3: 11).  Every rank must
    raise (CollectiveMismatchError)."""
    api = load_impl(impl)
    dptc = api.module
    rank = api.get_rank()
    groups = {m: dptc.new_group(list(m)) for m in ((0, 1), (2, 3))}
    members = (0, 1) if rank < 2 else (2, 3)
    group = groups[members]
    stream = 0 if rank < 2 else 1
    dptc.all_reduce(torch.ones(4), group=group, stream=stream)  # the group is up
    start_clock()
    dptc.all_reduce(torch.ones(10 if rank == members[0] else 11), group=group, stream=stream)
    return "completed"
