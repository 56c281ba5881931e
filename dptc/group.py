"""Process groups: who the ranks are, where they live, and dptc's engine for them.

The shape comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK) or from an already initialised
``torch.distributed`` default group, whose store dptc reuses for its own
bootstrap.  Nodes are told apart by torchrun's node index (GROUP_RANK), not by
host name, so two torchrun invocations with ``--nnodes=2`` on one host are two
nodes.  Between nodes dptc hands its cross-node step to gloo through
``torch.distributed``.
"""

import atexit
import datetime
import logging
import os
import secrets
import socket

import torch
import torch.distributed as dist

from . import _C
from ._dtypes import element_size, torch_dtype, torch_reduce_op

__all__ = ["ProcessGroup", "init_process_group", "destroy_process_group", "is_initialized",
           "get_rank", "get_world_size", "default_group", "resolve"]

logger = logging.getLogger("dptc")

DEFAULT_TIMEOUT_S = 300.0
BRIDGE_CHECK = 3  # csrc/transport.h, DPTC_BRIDGE_CHECK
_OP_NAMES = {0: "all_reduce", 1: "broadcast", 2: "all_gather_into_tensor",
             3: "reduce_scatter_tensor", 4: "barrier"}
# Staging bytes per rank and buffer in the shared segment (two buffers per rank).
DEFAULT_SLOT_BYTES = 1 << 20

_default = None
_generation = 0
_owns_torch_group = False


class ProcessGroup:
    """A set of ranks and the C engine that moves their bytes.

    rank/size are within the group; local_rank/local_size within this node;
    node/nnodes index the nodes.  ``torch_group`` is the matching
    ``torch.distributed`` group (gloo), used across nodes and as a reference.
    """

    def __init__(self, *, rank, size, local_rank, local_size, node, nnodes, timeout,
                 engine, torch_group, cross_groups):
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.node = node
        self.nnodes = nnodes
        self.timeout = timeout
        self._c = engine
        self.torch_group = torch_group
        self._cross_groups = cross_groups

    def __repr__(self):
        return (f"dptc.ProcessGroup(rank={self.rank}, size={self.size}, node={self.node}/"
                f"{self.nnodes}, local_rank={self.local_rank}/{self.local_size})")

    def empty_shared(self, numel, dtype):
        """A zero-filled 1-D tensor in memory every local rank of the group maps.

        Collective: every rank calls it in the same order with the same numel and dtype.  An
        in-place all_reduce of a tensor at the same place of such a buffer on every rank moves
        no staging copies (see [Note: shared buffers] in csrc/engine.h); DDP puts its gradient
        buckets there.
        """
        nbytes = numel * element_size(dtype)
        buffer = self._c.share(nbytes)
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype, count=numel)

    def abort(self, reason):
        """Fails this group here and on every peer of this node (they raise at once)."""
        if not self._c.closed:
            self._c.abort(str(reason))

    def close(self):
        self._c.close()


def _timeout_seconds(timeout):
    if timeout is None:
        text = os.environ.get("DPTC_TIMEOUT")
        if text is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"DPTC_TIMEOUT must be a number of seconds, got {text!r}") from None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, "
                         f"got {timeout!r}")
    return float(timeout)


def _init_torch(timeout, explicit):
    """Initialises torch.distributed with gloo, if needed: from `explicit` (the arguments of
    init_process_group that torch's takes, when any is given), else from the environment."""
    global _owns_torch_group
    if dist.is_initialized():
        return
    delta = datetime.timedelta(seconds=timeout)
    if explicit:
        dist.init_process_group("gloo", timeout=delta, **explicit)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise ValueError(f"{name} is not set; launch with torchrun, or set RANK, "
                                 f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
        dist.init_process_group("gloo", timeout=delta)
    else:
        # A plain `python script.py`: one rank.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=delta)
    _owns_torch_group = True


def _node_layout(store, rank, size):
    """Returns (node, nnodes, local_rank, local_size) agreed by every rank.

    A rank's node key is torchrun's node index (GROUP_RANK) when set, else its
    host name.  Nodes are numbered by their lowest rank.
    """
    key = os.environ.get("GROUP_RANK")
    key = f"node{key}" if key is not None else f"host:{socket.gethostname()}"
    store.set(f"node_key/{rank}", key)
    keys = [store.get(f"node_key/{r}").decode() for r in range(size)]
    order = []
    for k in keys:
        if k not in order:
            order.append(k)
    node = order.index(key)
    members = [r for r in range(size) if keys[r] == key]
    local_rank = members.index(rank)
    local_size = len(members)
    nnodes = len(order)
    sizes = {keys.count(k) for k in order}
    contiguous = all(keys[r] == order[r // local_size] for r in range(size)) if len(sizes) == 1 \
        else False
    if not contiguous:
        raise ValueError(
            f"dptc needs the same number of ranks on every node with ranks numbered node by "
            f"node (rank = node * local_size + local_rank); got node keys {keys}. Launch with "
            f"torchrun and the same --nproc_per_node on every node")
    env_local = os.environ.get("LOCAL_RANK")
    if env_local is not None and int(env_local) != local_rank:
        raise ValueError(f"LOCAL_RANK={env_local} disagrees with the layout dptc derived "
                         f"(local rank {local_rank} of node {node}); launch with torchrun")
    return node, nnodes, local_rank, local_size


def _make_bridge(engine, local_rank, local_size, nnodes, cross_group):
    """The cross-node step: gloo on byte ranges of this rank's staging slots."""
    slot = torch.frombuffer(engine.slot(local_rank), dtype=torch.uint8)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def rank(node):
        return node * local_size + local_rank

    def check(collective, dtype, redop, count, seq, root, text):
        mine = torch.tensor([collective, dtype, redop, count, seq, root], dtype=torch.int64)
        every = torch.empty(nnodes * mine.numel(), dtype=torch.int64)
        gather(every, mine, group=cross_group)
        every = every.view(nnodes, mine.numel())
        for node in range(nnodes):
            if not torch.equal(every[node], mine):
                c, d, r, n, q, root_ = every[node].tolist()
                dtype_name = str(torch_dtype(d)).replace("torch.", "") if 0 <= d < 9 else d
                theirs = (f"{_OP_NAMES.get(c, c)}({dtype_name}, count={n}, op code {r}, "
                          f"root {root_}) (collective #{q})")
                me = [n_ for n_ in range(nnodes) if torch.equal(every[n_], mine)][0]
                return (f"collective mismatch: global rank {rank(me)} issued {text} but global "
                        f"rank {rank(node)} issued {theirs}; every rank must issue the same "
                        f"collectives in the same order")
        return None

    def bridge(op, dtype, redop, offset, offset2=0, count=0, root=0, text=None):
        if op == BRIDGE_CHECK:
            return check(dtype, redop, offset, offset2, count, root, text)
        dt = torch_dtype(dtype)
        nbytes = count * element_size(dt)
        view = slot[offset:offset + nbytes].view(dt)
        if op == 0:
            dist.all_reduce(view, op=torch_reduce_op(redop), group=cross_group)
        elif op == 1:
            dist.broadcast(view, src=root * local_size + local_rank, group=cross_group)
        elif op == 2:
            out = slot[offset2:offset2 + nnodes * nbytes].view(dt)
            gather(out, view, group=cross_group)
        else:
            raise ValueError(f"unknown bridge operation {op}")

    return bridge


def _open_engine(store, *, rank, size, node, nnodes, local_rank, local_size, timeout,
                 cross_group):
    """Creates this node's shared segment and the C engine over it.

    See [Note: shared segment layout] in csrc/shm.c: the segment is unlinked as
    soon as every local rank has mapped it, and on every failure path.
    """
    if rank == 0:
        store.set("token", secrets.token_hex(12))
    token = store.get("token").decode()
    name = f"/dptc-{token}-n{node}"
    slot_bytes = int(os.environ.get("DPTC_SLOT_BYTES", DEFAULT_SLOT_BYTES))
    engine = None
    try:
        if local_rank != 0:
            store.wait([f"created/{node}"], datetime.timedelta(seconds=timeout))
        engine = _C.Group(rank, size, local_rank, local_size, node, nnodes, name,
                          local_rank == 0, slot_bytes, timeout)
        if local_rank == 0:
            store.set(f"created/{node}", "1")
        store.set(f"mapped/{node}/{local_rank}", "1")
        store.wait([f"mapped/{node}/{r}" for r in range(local_size)],
                   datetime.timedelta(seconds=timeout))
        if nnodes > 1:
            engine.set_bridge(_make_bridge(engine, local_rank, local_size, nnodes, cross_group))
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    finally:
        try:
            os.unlink("/dev/shm" + name)
        except FileNotFoundError:
            pass
    return engine


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, **kwargs):
    """Initialises dptc's default group (idempotent).

    Arguments mirror ``torch.distributed.init_process_group``; ``backend`` may
    be None, "dptc", "gloo" or "cpu:gloo" (dptc always uses gloo for the
    torch.distributed group it builds on).  ``timeout`` (seconds or timedelta;
    default $DPTC_TIMEOUT or 300 s) bounds every wait.
    """
    global _default, _generation
    if _default is not None:
        return _default
    if backend not in (None, "dptc", "gloo", "cpu:gloo"):
        raise ValueError(f"backend must be None, 'dptc' or 'gloo', got {backend!r}; dptc "
                         f"moves CPU bytes itself and uses gloo only between nodes")
    seconds = _timeout_seconds(timeout)
    explicit = {}
    if init_method is not None or store is not None or world_size != -1 or rank != -1:
        explicit = dict(init_method=init_method, world_size=world_size, rank=rank, store=store,
                        **kwargs)
    _init_torch(seconds, explicit)
    rank, size = dist.get_rank(), dist.get_world_size()
    base_store = dist.distributed_c10d._get_default_store()
    _generation += 1
    prefix_store = dist.PrefixStore(f"dptc/{_generation}/", base_store)
    node, nnodes, local_rank, local_size = _node_layout(prefix_store, rank, size)
    cross_groups = []
    if nnodes > 1:
        for index in range(local_size):
            cross_groups.append(dist.new_group(
                [n * local_size + index for n in range(nnodes)], backend="gloo",
                timeout=datetime.timedelta(seconds=seconds)))
    engine = _open_engine(prefix_store, rank=rank, size=size, node=node, nnodes=nnodes,
                          local_rank=local_rank, local_size=local_size, timeout=seconds,
                          cross_group=cross_groups[local_rank] if cross_groups else None)
    _default = ProcessGroup(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                            node=node, nnodes=nnodes, timeout=seconds, engine=engine,
                            torch_group=dist.group.WORLD, cross_groups=cross_groups)
    logger.info("dptc process group: rank %d of %d, node %d of %d, local rank %d of %d",
                rank, size, node, nnodes, local_rank, local_size)
    return _default


def is_initialized():
    return _default is not None


def default_group():
    """The default group, initialised on first use."""
    return _default if _default is not None else init_process_group()


def resolve(group, argname="group"):
    """Maps None, a dptc ProcessGroup or torch's default group to a ProcessGroup."""
    if group is None or isinstance(group, ProcessGroup):
        return default_group() if group is None else group
    if dist.is_initialized() and isinstance(group, dist.ProcessGroup) \
            and dist.get_world_size(group) == dist.get_world_size():
        return default_group()
    raise TypeError(f"{argname} must be None, a dptc.ProcessGroup or torch's default group, "
                    f"got {group!r}; subgroups are not supported yet: use the default group")


def get_rank(group=None):
    return resolve(group).rank


def get_world_size(group=None):
    return resolve(group).size


def destroy_process_group(group=None):
    """Stops dptc's engine and removes its shared memory.

    A torch.distributed group that dptc initialised itself stays up, so that a later
    init_process_group reuses it, and is torn down at exit: tearing it down here would make
    rank 0 restart the TCPStore server on MASTER_PORT while peers may still reach the old one,
    and a re-initialisation then waits on keys nobody writes.
    """
    global _default
    if group is not None and group is not _default:
        resolve(group).close()
        return
    if _default is None:
        return
    _default.close()
    _default = None


def _shutdown():
    global _owns_torch_group
    destroy_process_group()
    if _owns_torch_group and dist.is_initialized():
        dist.destroy_process_group()
    _owns_torch_group = False


atexit.register(_shutdown)
