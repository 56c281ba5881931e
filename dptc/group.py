"""Process groups: who the ranks are, where they live, and dptc's engine for them.

The world's shape comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK) or from an already initialised ``torch.distributed`` default
group, whose store dptc reuses for its own bootstrap.  Nodes are told apart by torchrun's node
index (GROUP_RANK), not by host name, so two torchrun invocations with ``--nnodes=2`` on one
host are two nodes.

A group is any set of ranks (see notes/ENGINE.md): the world, ``new_group(ranks)``, a
torch group made with ``torch.distributed.new_group`` or a ``DeviceMesh`` dimension.  Its
members on one node share memory; a group that spans nodes hands its cross-node step to gloo,
through gloo process groups that only its members build (``ProcessGroupGloo`` over the store),
one per stream and local index.
"""

import atexit
import datetime
import gc
import logging
import os
import secrets
import socket
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
# Before any group exists: its functions' default `group` is the world group at import time,
# which would then keep it alive past exit ([Note: torch groups at exit]).
import torch.distributed.nn.functional  # noqa: F401

from . import _C
from ._dtypes import (REDOP_MAX, REDOP_MIN, REDOP_PRODUCT, REDOP_SUM, element_size, torch_dtype,
                      torch_reduce_op)

__all__ = ["ProcessGroup", "init_process_group", "destroy_process_group", "is_initialized",
           "new_group", "get_rank", "get_world_size", "default_group", "resolve"]

logger = logging.getLogger("dptc")

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 1e9       # see _timeout_seconds
DEFAULT_STREAMS = 2
BRIDGE_CHECK = 3        # csrc/bridge.h, DPTC_BRIDGE_CHECK
_OP_NAMES = {0: "all_reduce", 1: "broadcast", 2: "all_gather_into_tensor",
             3: "reduce_scatter_tensor", 4: "barrier", 5: "share"}
# Staging bytes per rank, stream and buffer in the shared segment (two buffers each).
DEFAULT_SLOT_BYTES = 1 << 20
# How often a cross-node wait looks for an abort of the group elsewhere.
ABORT_POLL_S = 0.1
# How long a member whose gloo peer's connection closed waits for the reason in the store
# (see _run_bridged).
LOST_REASON_WAIT_S = 0.5
# How a large one-node all-reduce stages its data (csrc/shm.h dptc_shm_staging; [Note: staging]
# in csrc/shm.c): chosen by timing both, or fixed with DPTC_SHM_STAGING.
STAGINGS = {"auto": 2, "cached": 0, "streamed": 1}

_default = None
_generation = 0
# Initialisations of torch.distributed dptc made from the environment in this process: see
# [Note: torchrun restarts].
_torch_inits = 0
_owns_torch_group = False
_torch_store = None        # the TCPStore dptc made for torch.distributed (see _env_store)
_owner_pid = None          # the process that set dptc up (see _forked_child)
_world_nodes = None        # node index of every global rank
_new_groups = 0            # dptc.new_group calls so far (names their store prefixes)
_local_groups = {}         # members -> new_group(use_local_synchronization=True) calls
_mapped = {}               # torch group name -> ProcessGroup (see resolve)
_groups = weakref.WeakSet()
# After the script's destroy_process_group(): a weak reference to torch.distributed's default
# group then, or to nothing; see [Note: use after destroy].
_destroyed = None


class ProcessGroup:
    """A set of ranks and the C engine that moves their bytes.

    ``ranks`` are the members' global ranks, sorted; rank/size are within the group;
    local_rank/local_size count the members on this node; node/nnodes index the nodes the
    group spans.  ``num_streams`` independent ordered streams carry its work (collectives take
    ``stream=``).  ``torch_group`` is a matching ``torch.distributed`` group when one exists.
    """

    def __init__(self, *, ranks, rank, local_rank, local_size, node, nnodes, timeout, engine,
                 torch_group, store, num_streams):
        self.ranks = list(ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self.local_rank = local_rank
        self.local_size = local_size
        self.node = node
        self.nnodes = nnodes
        self.timeout = timeout
        self.num_streams = num_streams
        self._c = engine
        self._nccl = {}                # CUDA device index -> its NCCL engine, made on first use
        self._watchers = []            # threads passing failures through the store (_Watcher)
        self.torch_group = torch_group
        self._store = store
        _groups.add(self)

    def __repr__(self):
        return (f"dptc.ProcessGroup(ranks={self.ranks}, rank={self.rank}, size={self.size}, "
                f"node={self.node}/{self.nnodes}, local_rank={self.local_rank}/"
                f"{self.local_size})")

    def stagings(self, stream=0):
        """How this rank staged the group's collectives on `stream` that went through the
        shared segment's slots, so far: {op: {"cached": n, "streamed": m}} for all_reduce,
        all_gather, reduce_scatter and broadcast (see [Note: staging] in csrc/shm.c)."""
        if not isinstance(stream, int) or not 0 <= stream < self.num_streams:
            raise ValueError(f"stream must be an int in [0, {self.num_streams}), got {stream!r}")
        return self._c.stagings(stream)

    def group_rank(self, global_rank, argname="src"):
        """This group's rank of a global rank; ValueError when it is not a member."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"{argname}={global_rank!r} is not a rank of this group (global "
                             f"ranks {self.ranks})") from None

    def empty_shared(self, numel, dtype):
        """A zero-filled 1-D tensor in memory every local rank of the group maps.

        Collective: every rank calls it in the same order with the same numel and dtype.  An
        in-place all_reduce of a tensor at the same place of such a buffer on every rank moves
        no staging copies (see [Note: shared buffers] in csrc/shm.h); DDP puts its gradient
        buckets there.
        """
        nbytes = numel * element_size(dtype)
        buffer = self._c.share(nbytes)
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype, count=numel)

    def device_engine(self, device):
        """The engine that moves this group's CUDA tensors on `device` through NCCL (see
        [Note: the NCCL transport] in csrc/nccl.h), made on first use: collective, as every
        member reaches its first collective on CUDA tensors in the same order.  Rank 0 makes
        the communicator's unique id and the others read it from the group's store."""
        index = torch.cuda.current_device() if device.index is None else device.index
        engine = self._nccl.get(index)
        if engine is not None:
            return engine
        from . import _cuda
        _cuda.load()                   # dptc.CudaLibraryError names what is missing
        key = f"nccl/{len(self._nccl)}"
        if self.rank == 0:
            self._store.set(key, _C.nccl_unique_id())
        self._store.wait([key], datetime.timedelta(seconds=self.timeout))
        engine = _C.Group(self.rank, self.size, self.rank, self.size, 0, 1, "", False, 1,
                          self.timeout, self.num_streams, self.ranks,
                          nccl_id=self._store.get(key), device=index)
        self._nccl[index] = engine
        self._watchers.append(_Watcher("dptc-nccl-abort-watch", _watch_device_failure, engine,
                                       dist.PrefixStore(key + "/", self._store)))
        return engine

    def abort(self, reason):
        """Fails this group here and on every peer (they raise at once)."""
        for engine in (self._c, *self._nccl.values()):
            if not engine.closed:
                engine.abort(str(reason))
        if self.nnodes > 1 and not self._c.closed:
            # The members on other nodes learn it from the store's abort key (_watch_failure).
            # Write it now rather than at the watcher's next poll: a rank aborting for an
            # uncaught exception exits right after, and its peers' gloo connections close; a
            # member that sees its connection close first finds the reason here (_run_bridged).
            try:
                _watch_failure(self._c, self._store)
            except Exception:  # noqa: BLE001 - the store went with the job; the watcher tries too
                pass

    def close(self):
        # The watchers go first: one still inside a store call while the process exits and
        # torch tears the store down makes libstdc++ abort the process.
        for watcher in self._watchers:
            watcher.stop()
        self._watchers.clear()
        for engine in (*self._nccl.values(), self._c):
            engine.close()


# ---------------------------------------------------------------------------------------------
# Configuration

def _timeout_seconds(timeout):
    """Seconds from `timeout` (a number or a timedelta), else from DPTC_TIMEOUT, else the
    default.  At most MAX_TIMEOUT_S: from about 9.2e9 s on, gloo's and the store's deadlines,
    kept in nanoseconds, overflow (they expire at once or refuse the timeout)."""
    source, given = "timeout", timeout
    if timeout is None:
        given = os.environ.get("DPTC_TIMEOUT")
        if given is None:
            return DEFAULT_TIMEOUT_S
        source = "DPTC_TIMEOUT"
        try:
            timeout = float(given)
        except ValueError:
            timeout = None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout <= MAX_TIMEOUT_S:
        kind = "a number of seconds" + (" or a timedelta" if source == "timeout" else "")
        raise ValueError(f"{source} must be {kind} greater than 0 and at most "
                         f"{MAX_TIMEOUT_S:.0e} (about 31 years), got {given!r}")
    return float(timeout)


def _env_int(name, default, low, high):
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {text!r}")
    return value


def _env_choice(name, choices, default):
    text = os.environ.get(name, default)
    if text not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {text!r}")
    return choices[text]


def _env_flag(name, default):
    """A switch set with NAME=0 or NAME=1; any other value is refused rather than read as
    the default (a mistyped NAME=false used to leave it on)."""
    return _env_choice(name, {"0": False, "1": True}, "1" if default else "0")


def _check_c_settings():
    """The settings csrc/ reads itself, checked before a group is made, so that a mistyped
    value is an error rather than the default in silence: DPTC_SHM (shm.c: memfd, the
    default, or posix) and DPTC_NCCL_CHECK_ORDER (nccl.c: 1, the default, or 0)."""
    _env_choice("DPTC_SHM", {"memfd": "memfd", "posix": "posix"}, "memfd")
    _env_flag("DPTC_NCCL_CHECK_ORDER", True)


def _init_torch(timeout, explicit):
    """Initialises torch.distributed with gloo, if needed: from `explicit` (the arguments of
    init_process_group that torch's takes, when any is given), else from the environment."""
    global _owns_torch_group, _torch_inits
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
        dist.init_process_group("gloo", timeout=delta,
                                **(_agent_store(delta) or _env_store(delta)))
        _torch_inits += 1
    else:
        _check_single_process()
        # A plain `python script.py`: one rank.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=delta)
    _owns_torch_group = True


# A key the store server of a finished initialisation carries: see [Note: the last store].
_RETIRED_KEY = "dptc/retired"


def _env_store(delta):
    """The TCP store of torchrun's environment, as torch's env:// rendezvous makes it (rank 0
    serves it on MASTER_PORT), but never a store that a finished initialisation left behind.

    [Note: the last store]
    A script that initialises again after destroy_process_group (a tutorial's setup() and
    cleanup() in a loop) races: a rank that comes round first connects to MASTER_PORT while
    rank 0, still in the last step, serves the last initialisation's store there.  It then
    reads that store's keys (gloo dials rank 0's old address) until rank 0 frees the store,
    and fails with "Broken pipe" or waits until the timeout, while rank 0 waits for it on the
    new store.  torch alone hangs the same way when rank 0 is a second late.  So the rank that
    leaves an initialisation marks its store retired (_retire_torch_store), and a rank that
    finds the mark where it connected drops the connection and tries again, until rank 0
    serves a new store or the timeout.  The old server may also go away while a rank is
    connecting to it or reading the mark (DistNetworkError, "Failed to recv"; once in a
    fresh-clone CI run): that rank tries again too.
    """
    global _torch_store
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    use_libuv = os.environ.get("USE_LIBUV", "1") == "1"
    deadline = time.monotonic() + delta.total_seconds()
    while True:
        try:
            store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=delta,
                                  multi_tenant=True, use_libuv=use_libuv)
            retired = store.check([_RETIRED_KEY])
        except dist.DistNetworkError:
            if rank == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.05)   # the last store's server went away under this rank
            continue
        if not retired:
            _torch_store = store
            return {"store": store, "rank": rank, "world_size": size}
        del store
        if rank == 0:
            # multi_tenant hands rank 0 the server a live store object still holds.
            raise RuntimeError(
                f"the TCP store of the last initialisation is still served on MASTER_PORT="
                f"{port} by this process (an object still holds it); drop every reference "
                f"to torch.distributed's old store before initialising again")
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"rank {rank}: {host}:{port} still serves the store of the last "
                f"initialisation after {delta.total_seconds():g} s; rank 0 has not "
                f"initialised again (call destroy_process_group and init_process_group on "
                f"every rank)")
        time.sleep(0.05)


def _retire_torch_store():
    """Marks the store dptc made for the last initialisation as retired and drops it (see
    [Note: the last store]); its server is gone already where rank 0 left first."""
    global _torch_store
    store, _torch_store = _torch_store, None
    if store is None:
        return
    try:
        store.set(_RETIRED_KEY, "1")
    except dist.DistError:
        pass


def _check_single_process():
    """Refuses to make a world of one rank where the environment shows part of a multi-process
    launch (torch.multiprocessing.spawn sets no RANK or WORLD_SIZE, but its tutorials set
    MASTER_ADDR and MASTER_PORT): every process would train alone, its gradients never
    averaged.  torch's DDP raises "Default process group has not been initialized" there."""
    present = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name in os.environ]
    if not present:
        return
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    raise ValueError(
        f"the default process group has not been initialized, and {' and '.join(present)} "
        f"{'is' if len(present) == 1 else 'are'} set without {' and '.join(missing)}, as in a "
        f"torch.multiprocessing.spawn launch; dptc will not make each process a world of its "
        f"own there.  Call dptc.init_process_group(backend, rank=..., world_size=...) or "
        f"torch.distributed.init_process_group(backend, rank=..., world_size=...) in each "
        f"process first, or launch with torchrun (a plain `python script.py`, without these "
        f"variables, runs as one rank)")


def _restart_attempt():
    """The torchrun restart this process belongs to (TORCHELASTIC_RESTART_COUNT), as a store
    prefix; "" outside torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"attempt_{attempt}/" if attempt is not None else ""


def _agent_store(delta):
    """init_process_group's store under torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE):
    a client of the agent's TCPStore, as torch's env:// rendezvous makes it, under a prefix of
    this restart and this initialisation once there was an earlier one; {} elsewhere.

    [Note: torchrun restarts]
    torchrun --max-restarts starts every worker again after a failure, on the same agent
    TCPStore, whose keys outlive the workers that wrote them.  torch 2.13's env:// rendezvous
    hands the workers that store as it is, so a worker of the second attempt may read a key
    of the first: gloo's connectFullMesh then dials a dead peer's address (seen with torch
    alone, in 5 of 6 restarts here), and dptc's own bootstrap would open a dead peer's
    shared segment.  dptc's keys carry the attempt (init_process_group), and when dptc
    initialises torch.distributed itself it hands gloo the store under the attempt's prefix
    as well.  The same holds within one attempt for a script that initialises again after
    destroy_process_group (a tutorial's setup() and cleanup() in a loop): the agent's store
    still holds the last initialisation's gloo addresses, and the second one failed in
    connectFullMesh ("Connection refused") under torchrun, so every initialisation after the
    first gets a prefix of its own.  Every rank counts its initialisations alike, as every rank
    runs the same loop.  The agent serves the store all along, so no rank meets a retired one
    here ([Note: the last store] is for rank 0's own).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=delta)
    store = client
    if _restart_attempt() or _torch_inits:
        store = dist.PrefixStore(f"/dptc/{_restart_attempt()}init_{_torch_inits}/", client)
    return {"store": store, "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def _world_layout(store, rank, size):
    """The node index of every global rank, agreed by every rank.

    A rank's node key is torchrun's node index (GROUP_RANK) when set, else its host name.
    Nodes are numbered by their lowest rank.  Every rank publishes its LOCAL_RANK with its key
    and checks every rank's against the layout, so that a contradiction (say LOCAL_RANK set by
    hand as for two hosts, on processes that share one host name) is the same ValueError on
    every rank at once, not an error on some ranks and a store timeout on the others.
    """
    key = os.environ.get("GROUP_RANK")
    key = f"node{key}" if key is not None else f"host:{socket.gethostname()}"
    # A host name holds no newline, so one value carries both.
    store.set(f"node_key/{rank}", f"{os.environ.get('LOCAL_RANK', '')}\n{key}")
    values = [store.get(f"node_key/{r}").decode().split("\n", 1) for r in range(size)]
    keys = [k for _, k in values]
    order = []
    for k in keys:
        if k not in order:
            order.append(k)
    nodes = [order.index(k) for k in keys]
    local_ranks = [nodes[:r].count(nodes[r]) for r in range(size)]
    wrong = [f"rank {r} has LOCAL_RANK={given} but is local rank {local_ranks[r]} of node "
             f"{nodes[r]} ({keys[r].replace('host:', 'host ', 1)})"
             for r, (given, _) in enumerate(values) if given and given != str(local_ranks[r])]
    if wrong:
        how = ("their host names" if all(k.startswith("host:") for k in keys) else
               "GROUP_RANK, or their host names where it is unset")
        raise ValueError(
            f"LOCAL_RANK disagrees with the node layout dptc derived from {how}: "
            f"{'; '.join(wrong[:4])}{'; ...' if len(wrong) > 4 else ''}.  Ranks with one host "
            f"name count as one node; launch with torchrun, or set GROUP_RANK to each "
            f"process's node index (and LOCAL_RANK to its index within the node) when setting "
            f"RANK and WORLD_SIZE by hand")
    return nodes


def _group_layout(ranks, me):
    """(rank, node, nnodes, local_rank, local_size) of global rank `me` in the group `ranks`.

    The engine numbers a group's ranks node by node with the same number of members on every
    node (csrc/engine.h); sorted ranks of a node-major world are numbered that way whenever
    every node holds as many members.  A group spanning nodes with unequal member counts
    (say [0, 1, 2] on nodes of two) is laid out one member per "node" instead: every member
    then moves its bytes through the gloo bridge, slower but correct for any set of ranks.
    """
    nodes = []
    for r in ranks:
        if _world_nodes[r] not in nodes:
            nodes.append(_world_nodes[r])
    counts = [sum(1 for r in ranks if _world_nodes[r] == n) for n in nodes]
    local_size = counts[0]
    even = len(set(counts)) == 1 and all(
        _world_nodes[r] == nodes[i // local_size] for i, r in enumerate(ranks))
    rank = ranks.index(me)
    if not even:
        logger.info("dptc group %s spans nodes with %s members: every member crosses through "
                    "gloo", ranks, counts)
        return rank, rank, len(ranks), 0, 1
    return rank, rank // local_size, len(nodes), rank % local_size, local_size


# ---------------------------------------------------------------------------------------------
# The cross-node bridge

def _cross_group(store, stream, local_rank, node, nnodes, timeout):
    """The gloo group of the members with my local index on every node, for one stream: only
    they build it, through the group's store."""
    prefix = dist.PrefixStore(f"cross/{stream}/{local_rank}/", store)
    return dist.ProcessGroupGloo(prefix, node, nnodes, datetime.timedelta(seconds=timeout))


def _abort_reason(store):
    """The reason written under the group store's abort key, else under the world's (a group
    whose only member on the failed node is the one that died has nobody to write its key;
    its node peers write the world's), else None."""
    for candidate in (store, getattr(_default, "_store", None)):
        if candidate is not None and candidate.check(["abort"]):
            return candidate.get("abort").decode(errors="replace")
    return None


def _run_bridged(issue, engine, store, what):
    """Issues a gloo operation (issue() -> work) and waits for it, giving up when the group
    failed here or a member elsewhere wrote the abort key (see _watch_failure): a gloo op
    whose peer aborted would wait for gloo's timeout otherwise.  gloo's own failures (a peer's
    connection closed) become PeerLostError, naming the first failure known, if any."""
    from . import PeerLostError

    def lost(error):
        # gloo's own error says only that a connection closed.  A member that died is seen
        # first by its cross-node peers; its node peers notice within their wait's slice and
        # write the reason to the store within ABORT_POLL_S (_watch_failure): wait for it a
        # little, so the error names who failed and how.
        failure = engine.failure()
        deadline = time.monotonic() + LOST_REASON_WAIT_S
        while failure is None:
            failure = _abort_reason(store)
            if failure is None and time.monotonic() < deadline:
                time.sleep(ABORT_POLL_S / 5)
                failure = engine.failure()
            elif failure is None:
                break
        cause = f"{failure} (gloo: {error})" if failure else f"gloo failed: {error}"
        return PeerLostError(f"{what} lost a member on another node: {cause}")

    try:
        work = issue()
    except RuntimeError as error:
        raise lost(error) from error
    poll = datetime.timedelta(seconds=ABORT_POLL_S)
    while True:
        try:
            work.wait(poll)
            return
        except RuntimeError:
            # The poll ran out, or the op failed; it may also have completed just after the
            # poll ran out: a wait on a completed work returns, or raises the op's own error.
            if work.is_completed():
                try:
                    work.wait()
                    return
                except RuntimeError as error:
                    raise lost(error) from error
        failure = engine.failure()
        if failure is not None:
            raise PeerLostError(f"{what} stopped: {failure}")
        if store.check(["abort"]):
            raise PeerLostError(f"{what} stopped: a member on another node failed: "
                                f"{store.get('abort').decode(errors='replace')}")


_BOOL_BRIDGE_REDOPS = {REDOP_SUM: REDOP_MAX, REDOP_PRODUCT: REDOP_MIN}


def _make_bridge(engine, store, stream, local_rank, local_size, nnodes, cross, ranks):
    """The cross-node step of one stream: gloo on byte ranges of this rank's staging slots."""
    slot = torch.frombuffer(engine.slot(stream, local_rank), dtype=torch.uint8)

    def global_rank(node):
        return ranks[node * local_size + local_rank]

    def gloo(issue, what):
        _run_bridged(issue, engine, store, what)

    def check(collective, dtype, redop, count, seq, root, text, pieces):
        # pieces: the digest of an all-gather's pieces (see [Note: several pieces] in
        # csrc/shm.c), 0 for other collectives.
        mine = torch.tensor([collective, dtype, redop, count, seq, root, pieces],
                            dtype=torch.int64)
        every = torch.empty(nnodes * mine.numel(), dtype=torch.int64)
        gloo(lambda: cross._allgather_base(every, mine), "the cross-node order check")
        every = every.view(nnodes, mine.numel())
        for node in range(nnodes):
            if not torch.equal(every[node], mine):
                c, d, r, n, q, root_, p = every[node].tolist()
                dtype_name = str(torch_dtype(d)).replace("torch.", "") if 0 <= d < 9 else d
                split = f", pieces digest {p:#x}" if p else ""
                theirs = (f"{_OP_NAMES.get(c, c)}({dtype_name}, count={n}, op code {r}, "
                          f"root {root_}{split}) (collective #{q} of stream {stream})")
                me = [n_ for n_ in range(nnodes) if torch.equal(every[n_], mine)][0]
                return (f"collective mismatch: global rank {global_rank(me)} issued {text} but "
                        f"global rank {global_rank(node)} issued {theirs}; every rank must "
                        f"issue the same collectives in the same order")
        return None

    def bridge(op, dtype, redop, offset, offset2=0, count=0, root=0, text=None, pieces=0):
        if op == BRIDGE_CHECK:
            return check(dtype, redop, offset, offset2, count, root, text, pieces)
        dt = torch_dtype(dtype)
        nbytes = count * element_size(dt)
        view = slot[offset:offset + nbytes].view(dt)
        if op == 0:
            if dt is torch.bool:
                # gloo's bool SUM stores the byte 2 where two nodes send True; its MAX and MIN
                # are the same or and and with bytes 0 and 1, as dptc's kernels leave them.
                redop = _BOOL_BRIDGE_REDOPS.get(redop, redop)
            options = dist.AllreduceOptions()
            options.reduceOp = torch_reduce_op(redop)
            gloo(lambda: cross.allreduce([view], options), "a cross-node all_reduce")
        elif op == 1:
            options = dist.BroadcastOptions()
            options.rootRank = root
            gloo(lambda: cross.broadcast([view], options), "a cross-node broadcast")
        elif op == 2:
            out = slot[offset2:offset2 + nnodes * nbytes].view(dt)
            gloo(lambda: cross._allgather_base(out, view), "a cross-node all_gather")
        elif op == 4:
            source = slot[offset:offset + nnodes * nbytes].view(dt)
            out = slot[offset2:offset2 + nnodes * nbytes].view(dt)
            gloo(lambda: cross.alltoall_base(out, source, [], [], dist.AllToAllOptions()),
                 "a cross-node all_to_all")
        else:
            raise ValueError(f"unknown bridge operation {op}")

    return bridge


class _Watcher:
    """A thread that calls `check(engine, store)` every ABORT_POLL_S until it returns True,
    the engine closes, or stop() is called.  stop() joins it, so no store call is still
    running when the group's owner tears the store down (at exit, that aborts the process)."""

    JOIN_S = 10.0      # a store call on a live store returns in milliseconds

    def __init__(self, name, check, engine, store):
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(check, engine, store),
                                        name=name, daemon=True)
        self._thread.start()

    def _run(self, check, engine, store):
        while not self._stopping.wait(ABORT_POLL_S) and not engine.closed:
            try:
                if check(engine, store):
                    return
            except Exception:  # noqa: BLE001 - the store or the engine went with the job
                return

    def stop(self):
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.JOIN_S)


def _watch_failure(engine, store):
    """Writes the group's first failure under the store's "abort" key, so that members on
    other nodes stop waiting in gloo within ABORT_POLL_S (see _wait_bridged).  True when
    done."""
    failure = engine.failure()
    if failure is None:
        return False
    store.compare_set("abort", "", failure)
    return True


def _watch_device_failure(engine, store):
    """A NCCL group's failure on one rank reaches the others through the store: the failing
    rank writes its message under "abort", and every other rank aborts its own communicator
    when it sees one, so its waits end within ABORT_POLL_S instead of at its deadline (NCCL
    itself need not notice a peer that stopped).  True when done."""
    failure = engine.failure()
    if failure is not None:
        store.compare_set("abort", "", failure)
        return True
    if store.check(["abort"]):
        reason = store.get("abort").decode("utf-8", "replace")
        if not engine.closed:
            engine.abort(f"a peer's NCCL group failed: {reason}")
        return True
    return False


# ---------------------------------------------------------------------------------------------
# Building a group

def _open_engine(store, ranks, me, timeout, num_streams):
    """Creates this node's shared segment for the group `ranks` and the C engine over it.

    Only members call it; they meet through `store`, a prefix of the job's store unique to the
    group.  See [Note: segments] in csrc/shm.c: the segment is unlinked as soon as every local
    member has mapped it, and on every failure path.
    """
    staging = _env_choice("DPTC_SHM_STAGING", STAGINGS, "auto")
    _check_c_settings()
    rank, node, nnodes, local_rank, local_size = _group_layout(ranks, me)
    if rank == 0:
        store.set("token", secrets.token_hex(12))
    token = store.get("token").decode()
    name = f"/dptc-{token}-n{node}"
    slot_bytes = _env_int("DPTC_SLOT_BYTES", DEFAULT_SLOT_BYTES, 1 << 16, 1 << 40)
    engine = None
    try:
        if local_rank != 0:
            _wait_members(store, [f"created/{node}"], timeout, node, local_size)
            name = store.get(f"created/{node}").decode()
        engine = _C.Group(rank, len(ranks), local_rank, local_size, node, nnodes, name,
                          local_rank == 0, slot_bytes, timeout, num_streams, list(ranks),
                          staging=staging)
        if local_rank == 0:
            store.set(f"created/{node}", engine.segment_path() or name)
        store.set(f"mapped/{node}/{local_rank}", "1")
        _wait_members(store, [f"mapped/{node}/{r}" for r in range(local_size)], timeout, node,
                      local_size)
        engine.unlink()
        if nnodes > 1:
            for stream in range(num_streams):
                cross = _cross_group(store, stream, local_rank, node, nnodes, timeout)
                engine.set_bridge(stream, _make_bridge(engine, store, stream, local_rank,
                                                       local_size, nnodes, cross, ranks))
    except BaseException as error:
        # A creator whose engine failed to open has removed its segment already (shm.c).
        if engine is not None:
            engine.unlink()
            engine.close()
        remedy = _open_remedy(str(error))
        if engine is None and not getattr(error, "_dptc_peer_failed", False):
            try:   # see [Note: a member that cannot open]
                store.set(f"failed/{node}/{local_rank}", f"global rank {me}: {error}")
            except Exception:  # noqa: BLE001 - the store itself may be what failed
                pass
            if remedy and isinstance(error, _C.DistError):
                raise type(error)(f"{error}; {remedy}") from error
        raise
    return engine, (rank, node, nnodes, local_rank, local_size)


# [Note: a member that cannot open]
# A member whose engine fails to open (EMFILE: the open-file limit; ENOMEM or ENOSPC: mapping
# the segment) writes why under failed/<node>/<local rank> in the group's store, and the local
# members waiting for it to create or map the segment poll for that key beside theirs: they
# raise at once, naming the member, its error and the remedy, instead of waiting out the
# group's timeout (tests/test_soak.py: 0.02 s where rank 0 waited its 20 s).

# Seconds between a waiting member's looks at the store.
OPEN_POLL_S = 0.01
_REMEDIES = (
    (("Too many open files",), "raise the open-file limit (ulimit -n, e.g. ulimit -n 65536) "
                               "for every rank"),
    (("Cannot allocate memory", "No space left on device"),
     "free memory or lower DPTC_SLOT_BYTES (with DPTC_SHM=posix: enlarge /dev/shm, "
     "docker run --shm-size)"),
)


def _open_remedy(message):
    for words, remedy in _REMEDIES:
        if any(word in message for word in words):
            return remedy
    return ""


def _wait_members(store, keys, timeout, node, local_size):
    """store.wait(keys) within timeout, raising at once when a local member reported that it
    could not open the group (see [Note: a member that cannot open])."""
    failed = [f"failed/{node}/{r}" for r in range(local_size)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        for key in failed:
            if store.check([key]):
                why = store.get(key).decode()
                remedy = _open_remedy(why)
                error = _C.PeerLostError(f"a member of this group failed to open it: {why}"
                                         + (f"; {remedy}" if remedy else ""))
                error._dptc_peer_failed = True
                raise error
        left = deadline - time.monotonic()
        if left <= 0:
            store.wait(keys, datetime.timedelta(seconds=0.001))   # torch's timeout error
            return
        time.sleep(min(OPEN_POLL_S, left))


def _make_group(store, ranks, timeout, torch_group):
    me = dist.get_rank()
    num_streams = _env_int("DPTC_STREAMS", DEFAULT_STREAMS, 1, 4)
    engine, (rank, node, nnodes, local_rank, local_size) = _open_engine(
        store, ranks, me, timeout, num_streams)
    pg = ProcessGroup(ranks=ranks, rank=rank, local_rank=local_rank, local_size=local_size,
                      node=node, nnodes=nnodes, timeout=timeout, engine=engine,
                      torch_group=torch_group, store=store, num_streams=num_streams)
    if nnodes > 1:
        pg._watchers.append(_Watcher("dptc-abort-watch", _watch_failure, engine, store))
    return pg


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, **kwargs):
    """Initialises dptc's default group (idempotent).

    Arguments mirror ``torch.distributed.init_process_group``; ``backend`` may
    be None, "dptc", "gloo" or "cpu:gloo" (dptc always uses gloo for the
    torch.distributed group it builds on).  ``timeout`` (seconds or timedelta;
    default $DPTC_TIMEOUT or 300 s) bounds every wait.
    """
    global _default, _generation, _world_nodes, _owner_pid, _destroyed
    if _default is not None:
        if dist.is_initialized():
            _check_reinit(_default, backend, timeout, world_size, rank)
            return _default
        # torch.distributed's default group, which dptc's builds on, was destroyed under it
        # (torch's destroy_process_group in a script set up with dptc's init): start again.
        _retire_torch_store()
        _close_all()
        gc.collect()
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
    # See [Note: torchrun restarts].
    prefix_store = dist.PrefixStore(f"dptc/{_restart_attempt()}{_generation}/", base_store)
    _world_nodes = _world_layout(prefix_store, rank, size)
    _default = _make_group(dist.PrefixStore("world/", prefix_store), list(range(size)),
                           seconds, dist.group.WORLD)
    _default._prefix_store = prefix_store
    _owner_pid = os.getpid()
    _destroyed = None               # only once the new group is up: see _refuse_use_after_destroy
    logger.info("dptc process group: rank %d of %d, node %d of %d, local rank %d of %d",
                rank, size, _default.node, _default.nnodes, _default.local_rank,
                _default.local_size)
    return _default


def _check_reinit(group, backend, timeout, world_size, rank):
    """init_process_group on a default group that is up returns it (dptc initialises itself on
    first use, so a script's own call often comes second), unless the call asks for something
    else, which would otherwise be ignored in silence: another backend, timeout, world size
    or rank is a ValueError naming it."""
    if backend not in (None, "dptc", "gloo", "cpu:gloo"):
        raise ValueError(f"backend must be None, 'dptc' or 'gloo', got {backend!r}; dptc "
                         f"moves CPU bytes itself and uses gloo only between nodes")
    asked = {"world_size": (world_size, group.size), "rank": (rank, group.rank)}
    if timeout is not None:
        asked["timeout"] = (_timeout_seconds(timeout), group.timeout)
    for name, (wanted, actual) in asked.items():
        if wanted not in (-1, actual):
            raise ValueError(
                f"init_process_group({name}={timeout if name == 'timeout' else wanted!r}): "
                f"dptc's default group is already initialised with {name} {actual!r} (dptc "
                f"initialises itself on the first call that needs a group, e.g. get_rank() or "
                f"a wrapper); call init_process_group before any other dptc call, or "
                f"destroy_process_group() first")


def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization=False, group_desc=None, device_id=None):
    """A group of the given global ranks, with torch.distributed.new_group's semantics.

    Every rank of the default group calls it, in the same order (with
    ``use_local_synchronization=True``, only the members).  Members get a dptc ProcessGroup;
    the others get ``torch.distributed.GroupMember.NON_GROUP_MEMBER``.  ``backend``,
    ``pg_options`` and ``device_id`` are accepted for compatibility; dptc's engine carries the
    group either way.
    """
    global _new_groups
    world = default_group()
    if backend not in (None, "dptc", "gloo", "cpu:gloo"):
        raise ValueError(f"backend must be None, 'dptc' or 'gloo', got {backend!r}")
    members = list(range(world.size)) if ranks is None else sorted(_rank_list(ranks))
    if len(set(members)) != len(members):
        raise ValueError(f"ranks must not repeat a rank, got {ranks}")
    for r in members:
        if not isinstance(r, int) or not 0 <= r < world.size:
            raise ValueError(f"ranks must hold global ranks in [0, {world.size}), got {ranks}")
    if not members:
        raise ValueError("ranks must name at least one rank")
    seconds = _timeout_seconds(timeout if timeout is not None else world.timeout)
    if use_local_synchronization:
        key = tuple(members)
        _local_groups[key] = _local_groups.get(key, 0) + 1
        tag = "local/" + "_".join(map(str, members)) + f"/{_local_groups[key]}"
    else:
        _new_groups += 1
        tag = f"group/{_new_groups}"
    if world.rank not in members:
        return dist.GroupMember.NON_GROUP_MEMBER
    store = dist.PrefixStore(tag + "/", world._prefix_store)
    group = _make_group(store, members, seconds, None)
    logger.info("dptc group %s: rank %d of %d", members, group.rank, group.size)
    return group


def _rank_list(ranks):
    """new_group's ranks as a list of ints; TypeError naming the argument for anything else (an
    int, a string, a list holding floats or bools)."""
    try:
        listed = None if isinstance(ranks, (str, bytes)) else list(ranks)
    except TypeError:
        listed = None
    if listed is None or not all(isinstance(r, int) and not isinstance(r, bool) for r in listed):
        raise TypeError(f"ranks must be None or a list of global ranks (ints), got {ranks!r}")
    return listed


def is_initialized():
    return _default is not None


def default_group():
    """The default group, initialised on first use."""
    if _default is not None:
        return _default
    _refuse_use_after_destroy()
    return init_process_group()


def _refuse_use_after_destroy():
    """[Note: use after destroy]
    dptc initialises itself on a script's first call that needs a group, but not again after
    the script's own destroy_process_group(): a collective, a wrapper or get_rank() then
    raises torch's ValueError, as torch.distributed does after its destroy_process_group,
    instead of starting a new group that the other ranks, done, never join (a wait of the
    whole timeout).  An init_process_group call starts again, as does a torch.distributed
    default group made since the destroy (the script's own dist.init_process_group)."""
    if _destroyed is None:
        return
    if not dist.is_initialized() or dist.group.WORLD is _destroyed():
        raise ValueError("Default process group has not been initialized, please make sure "
                         "to call init_process_group. (dptc.destroy_process_group() destroyed "
                         "it; call dptc.init_process_group() to start again.)")


def _from_torch(group, argname):
    """The dptc group over the same ranks as a torch ProcessGroup, built on its first use by
    its members (they meet under the torch group's name, the same on every member)."""
    world = default_group()
    if dist.get_world_size(group) == world.size:
        return world
    name = group.group_name
    pg = _mapped.get(name)
    if pg is None or pg._c.closed:
        members = sorted(dist.get_process_group_ranks(group))
        store = dist.PrefixStore(f"torch/{name}/", world._prefix_store)
        pg = _make_group(store, members, world.timeout, group)
        _mapped[name] = pg
    return pg


def resolve(group, argname="group"):
    """Maps what torch accepts as a group to a dptc ProcessGroup, or None for a non-member.

    None means the default group; also accepted: a dptc ProcessGroup, a torch ProcessGroup
    (from torch.distributed.new_group, or a DeviceMesh dimension's get_group()), and a
    one-dimensional DeviceMesh.
    """
    if group is None:
        return default_group()
    if isinstance(group, ProcessGroup):
        if group._c.closed:
            raise ValueError(f"{argname} was destroyed; create a new group")
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    mesh_type = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            raise ValueError(f"{argname} is a {group.ndim}-D DeviceMesh; pass one dimension's "
                             f"group, mesh.get_group(dim)")
        group = group.get_group()
    if dist.is_initialized() and isinstance(group, dist.ProcessGroup):
        if dist.get_rank() not in dist.get_process_group_ranks(group):
            return None
        return _from_torch(group, argname)
    raise TypeError(f"{argname} must be None, a dptc.ProcessGroup, a torch.distributed "
                    f"ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")


def get_rank(group=None):
    """This rank in `group` (the default group when None); -1 when it is not a member."""
    pg = resolve(group)
    return -1 if pg is None else pg.rank


def get_world_size(group=None):
    """Ranks in `group`; -1 when this rank is not a member (as torch)."""
    pg = resolve(group)
    return -1 if pg is None else pg.size


def destroy_process_group(group=None):
    """Stops dptc's engine and releases its shared memory: of `group`, or of every group.

    A torch.distributed group that dptc initialised itself stays up, so that a later
    init_process_group reuses it, and is torn down at exit: tearing it down here would make
    rank 0 restart the TCPStore server on MASTER_PORT while peers may still reach the old one,
    and a re-initialisation then waits on keys nobody writes.
    """
    global _destroyed
    if _default is None:
        return
    if group is not None and group is not _default:
        pg = resolve(group)
        if pg is not _default:      # torch's WORLD (or a mesh over every rank) is the default
            if pg is not None:
                pg.close()
            return
    _destroyed = weakref.ref(dist.group.WORLD) if dist.is_initialized() else (lambda: None)
    _close_all()


def _close_all():
    """Closes every group; the next call that needs the default group initialises it."""
    global _default
    if _default is None:
        return
    for pg in list(_groups):
        pg.close()
    _mapped.clear()
    _default = None


def _forked_child():
    """Whether this process is a fork of the rank that set dptc up (a DataLoader worker, a
    script's os.fork()): the groups, dptc's and torch's, are the rank's, and the child's exit
    must neither close nor abort them ([Note: forked children] in csrc/module.c)."""
    return _owner_pid is not None and _owner_pid != os.getpid()


def _shutdown():
    global _owns_torch_group, _torch_store
    if _forked_child():
        return
    _close_all()
    if _owns_torch_group and dist.is_initialized():
        dist.destroy_process_group()
        for pg in list(_groups):
            pg.torch_group = None
        _release_mesh_groups()
        gc.collect()
    _owns_torch_group = False
    _torch_store = None


def _release_mesh_groups():
    """Drops the torch groups every DeviceMesh still holds, so that they are freed now.

    [Note: torch groups at exit]
    The gloo groups dptc made (the world's, and those of torch.distributed.new_group) must be
    freed at exit, before the interpreter's finalisation: a gloo worker thread that drops the
    last reference to a finished work's tensor then needs the GIL, and a thread that asks for
    it during finalisation is ended by pthread_exit, which libstdc++ turns into an abort
    ("terminate called without an active exception", SIGABRT after the script's last line).
    Freeing a group from Python joins its threads with the GIL released, so it is safe here.
    torch's destroy_process_group forgets its groups, but a DeviceMesh keeps its own
    references (`_pg_registry`) to them: every fully_shard model has one, so its gloo
    threads outlived the atexit handlers and aborted the process about once in a few
    thousand exits.  The groups are destroyed by now, so the meshes lose nothing usable.
    torch.distributed.nn's functions (imported by torch's FSDP) hold the world group in
    their default arguments when imported after it was made, so dptc imports them first.
    """
    mesh_type = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if mesh_type is None:
        return
    types = [mesh_type]
    for each in types:
        types.extend(each.__subclasses__())
    # The instances refer to their class.  Not a scan with isinstance: DeviceMesh's metaclass
    # answers it slowly (0.1 s over a training script's objects, against 0.02 s for this)
    # and prints torch's deprecation warnings.
    for obj in gc.get_referrers(*types):
        if type(obj) in types:
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


atexit.register(_shutdown)


def _abort_on_uncaught(exc_type, exc, traceback):
    """A rank that stops with an uncaught exception aborts its groups first, so its peers
    raise PeerLostError at once (naming this rank and the exception) instead of when its
    process has finished exiting, which takes seconds with torch loaded."""
    if _default is not None and not _forked_child():
        text = f"{exc_type.__name__}: {exc}"
        if len(text) > 200:
            text = text[:197] + "..."
        reason = f"rank {_default.rank} stopped with an uncaught {text}"
        for pg in list(_groups):
            try:
                pg.abort(reason)
            except Exception:  # noqa: BLE001 - the original exception is what matters
                pass
    _previous_excepthook(exc_type, exc, traceback)


_previous_excepthook = sys.excepthook
sys.excepthook = _abort_on_uncaught
