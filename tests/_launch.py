"""Multi-rank test harness: start N rank processes the way torchrun would, collect their results.

Every multi-process test goes through `run_ranks` (or `run_torchrun_nodes` for a real torchrun
command line).  Both promise the same hygiene, whatever happens:

- every process starts in its own session, and every process it starts is tracked, so one kill
  takes down the whole tree: no orphans after a timeout, a failure or a KeyboardInterrupt;
- a run has a deadline; ranks still running at the deadline get SIGUSR1 first, which makes
  tests/_rank.py dump every thread's Python stack to stderr, so a hang fails with a stack trace;
- no /dev/shm/dptc* entry may outlive the run; leftovers are removed, then reported as a failure,
  so one leaking test does not poison the tests after it.

The rank-side half lives in tests/_rank.py.  Rank processes are forked from tests/_zygote.py,
which imported torch once, when their environment differs from the harness's only in variables
read at run time (see _Zygote.unforkable); otherwise, and with DPTC_TEST_ZYGOTE=0 (in the
harness's environment, or in one run's `env`), each is a fresh `python -m tests._rank`.  Segments of runs that go on concurrently on the same
machine are told apart from leaks by being mapped or short-lived (see _remove_new_shm); still,
run the suite serially (no pytest-xdist).
"""

from __future__ import annotations

import collections
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["REPO_ROOT", "run_ranks", "once", "run_torch_then_dptc", "run_torchrun_nodes",
           "run_python", "free_port", "rank_env"]

REPO_ROOT = Path(__file__).resolve().parent.parent

# Seconds the other ranks get to finish after one rank failed (expect_failure=False): long enough
# for an error to propagate through a collective engine, short enough not to wait for a timeout.
FAILURE_GRACE_S = 5.0
# The same for a torchrun node: its agent needs a while to notice its workers' failure.
TORCHRUN_FAILURE_GRACE_S = 15.0
# Seconds between SIGUSR1 (stack dump) and SIGKILL for ranks past their deadline.
STACK_DUMP_WAIT_S = 1.0
POLL_S = 0.05
STDERR_TAIL_CHARS = 4000
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dptc"
# How long a new, unmapped /dev/shm/dptc* entry may take to disappear before it counts as leaked.
SHM_SETTLE_S = 2.0
# Variables besides the launch variables, DPTC_*, TORCHELASTIC_* and PYTEST_* that torch reads
# only when it uses them, not at import: a rank forked from the zygote sees them as set.
_RUN_TIME_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR",)
# How the harness started each python process, "forked from the zygote" or "fresh (why)": the
# suite's summary reports it (tests/conftest.py), since a fresh start costs seconds.
PYTHON_STARTS = collections.Counter()
# Lower-case text of the error a TCP store reports when its port was taken meanwhile.
_ADDRESS_IN_USE = "address already in use"

# Variables torchrun sets for its workers; removed from the inherited environment before the
# harness sets its own, so an outer launcher cannot leak into the ranks.
_LAUNCH_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
)


# ---------------------------------------------------------------------------------------------
# Small helpers

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _base_env() -> dict:
    env = {
        key: value for key, value in os.environ.items()
        if key not in _LAUNCH_VARIABLES and not key.startswith("TORCHELASTIC")
    }
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    env["OMP_NUM_THREADS"] = "1"
    env["DPTC_TIMEOUT"] = "30"
    env["PYTHONUNBUFFERED"] = "1"   # stdout/stderr tails are complete even when a rank is killed
    env["PYTHONFAULTHANDLER"] = "1"  # a crash in C prints the Python stack of every thread
    # DDP launches buckets during backward, as on a node with a spare core per rank; on this
    # machine's 2 cores it would launch them all at the end (see [Note: overlap] in
    # csrc/reducer.c), leaving the concurrent path untested.  tests/test_ddp_reducer.py runs
    # both and the automatic choice.
    env.setdefault("DPTC_DDP_OVERLAP", "1")
    return env


def _apply_overrides(env: dict, overrides: dict | None) -> dict:
    for key, value in (overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


def rank_env(rank: int, world_size: int, *, nnodes: int = 1, master_port: int,
             env: dict | None = None) -> dict:
    """The environment torchrun would give `rank`, with the harness defaults and `env` on top."""
    local_size = world_size // nnodes
    node, local_rank = divmod(rank, local_size)
    result = _base_env()
    result.update({
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    })
    return _apply_overrides(result, env)


def _shm_entries() -> set:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def _mapped_shm() -> set:
    """Names of /dev/shm/dptc* files that some live process has mapped."""
    names = set()
    marker = str(SHM_DIR / SHM_PREFIX)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as file:
                maps = file.read().decode("utf-8", "replace")
        except OSError:
            continue
        for line in maps.splitlines():
            start = line.find(marker)
            if start >= 0:
                names.add(line[start + len(str(SHM_DIR)) + 1:].split(" ")[0])
    return names


def _remove_new_shm(before: set) -> list:
    """Removes the /dev/shm/dptc* entries the run left behind; returns their names.

    Called once every process of the run is dead.  The machine may be shared with other test
    runs, whose segments exist for a moment between creation and unlinking: an entry counts as
    left behind when it is new, no live process maps it, and it is still there after
    SHM_SETTLE_S seconds.
    """
    deadline = time.monotonic() + SHM_SETTLE_S
    while True:
        leaked = sorted(_shm_entries() - before - _mapped_shm())
        if not leaked or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for name in leaked:
        path = SHM_DIR / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
    return leaked


def _tail(path: Path, limit: int = STDERR_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - limit))
            text = file.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return ("..." if size > limit else "") + text


def _describe_exit(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---------------------------------------------------------------------------------------------
# Process trees

def _proc_stat(pid: int, with_state: bool = False):
    """(parent pid, start time in clock ticks[, state letter]) of a process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields resume after the last ')'.
    fields = data[data.rindex(")") + 2:].split()
    if with_state:
        return int(fields[1]), int(fields[19]), fields[0]
    return int(fields[1]), int(fields[19])


class _Zygote:
    """The client of tests/_zygote.py: rank processes forked from one that imported torch.

    Started on first use, with the harness's base environment; it lives as long as this
    process (its request pipe closes at exit).  DPTC_TEST_ZYGOTE=0 turns it off."""

    _instance = None
    _failed = False

    @classmethod
    def get(cls):
        if cls._instance is None and not cls._failed:
            setting = os.environ.get("DPTC_TEST_ZYGOTE", "1")
            if setting not in ("0", "1"):
                raise ValueError(f"DPTC_TEST_ZYGOTE must be 0 (a fresh interpreter for every "
                                 f"rank) or 1 (ranks forked from the zygote), got {setting!r}")
            if setting == "0":
                cls._failed = True
                return None
            try:
                cls._instance = cls()
            except (OSError, RuntimeError):
                cls._failed = True
        return cls._instance

    def __init__(self):
        request_read, self._request = os.pipe()
        self._reply, reply_write = os.pipe()
        self.env = _base_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._zygote", str(request_read), str(reply_write)],
            cwd=REPO_ROOT, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, pass_fds=(request_read, reply_write),
            start_new_session=True)
        os.close(request_read)
        os.close(reply_write)
        self._buffer = b""
        self._started = []
        self.exits = {}
        if self._next_line(timeout=60) != "ready":
            self.proc.kill()
            raise RuntimeError("the test zygote did not start")

    def unforkable(self, env: dict) -> str | None:
        """Why a process with `env` cannot be forked from the zygote, or None when `env`
        differs from the zygote's only in what is read after the imports (pytest's
        PYTEST_CURRENT_TEST changes with every test; inductor's first cache lookup in this
        process sets TORCHINDUCTOR_CACHE_DIR, which it reads at every lookup)."""
        if self.proc.poll() is not None:
            return "the zygote exited"
        if env.get("DPTC_TEST_ZYGOTE") == "0":
            return "the run asks for a fresh interpreter (DPTC_TEST_ZYGOTE=0)"
        changed = sorted(key for key in env.keys() | self.env.keys()
                         if env.get(key) != self.env.get(key)
                         and key not in _LAUNCH_VARIABLES and key not in _RUN_TIME_VARIABLES
                         and not key.startswith(("DPTC_", "TORCHELASTIC_", "PYTEST_")))
        return f"{', '.join(changed)} differ" if changed else None

    def spawn(self, argv, env, cwd, stdout, stderr) -> int:
        job = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(stdout),
               "stderr": str(stderr)}
        os.write(self._request, (json.dumps(job) + "\n").encode())
        while not self._started:
            if self._next_line(timeout=30) is None:
                raise RuntimeError("the test zygote did not fork")
        return self._started.pop(0)

    def poll(self):
        """Takes in what the zygote reported so far, without waiting."""
        self._next_line(timeout=0)

    def _next_line(self, timeout):
        """Reads replies until a line other than an exit is complete, or the time runs out;
        exits are recorded on the way, a start as well when it is that line.  Returns the
        line or None."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                word, *rest = line.decode().split()
                if word == "exit":
                    self.exits[int(rest[0])] = int(rest[1])
                    continue
                if word == "started":
                    self._started.append(int(rest[0]))
                return line.decode()
            left = deadline - time.monotonic()
            if not select.select([self._reply], [], [], max(0.0, left))[0]:
                return None
            chunk = os.read(self._reply, 65536)
            if not chunk:
                return None
            self._buffer += chunk


class _ForkedRank:
    """What the harness uses of a subprocess.Popen, for a rank the zygote forked."""

    def __init__(self, zygote, pid):
        self._zygote = zygote
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self._zygote.poll()
            self.returncode = self._zygote.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode


class _ProcessTree:
    """The processes a run started, and every process they started in turn.

    Children that open their own session (torchrun starts its workers that way) escape a process
    group kill, and once their parent dies they are re-parented and lost; so descendants are
    recorded on every poll, with their start time to guard against pid reuse.
    """

    def __init__(self):
        self.roots = []  # subprocess.Popen objects, in start order
        self._known = {}  # pid -> start time, every process seen in the tree

    def start(self, argv, **popen_kwargs) -> subprocess.Popen:
        return self._track(subprocess.Popen(argv, start_new_session=True, **popen_kwargs))

    def _track(self, proc):
        self.roots.append(proc)
        stat = _proc_stat(proc.pid)
        if stat is not None:
            self._known[proc.pid] = stat[1]
        return proc

    def start_python(self, argv, env, stdout, stderr):
        """`python <argv...>` (argv starts with -m or -c), forked by the zygote where its
        environment allows, else started as a fresh interpreter."""
        zygote = _Zygote.get()
        if zygote is None:
            why = "no zygote"
        elif argv[0] not in ("-m", "-c"):
            why = f"argv {argv[0]}"
        else:
            why = zygote.unforkable(env)
        if why is None:
            try:
                pid = zygote.spawn(argv[1:] if argv[0] == "-m" else argv, env, REPO_ROOT,
                                   stdout, stderr)
            except (OSError, RuntimeError) as error:
                _Zygote._instance, _Zygote._failed = None, True
                why = f"the zygote failed: {error}"
            else:
                PYTHON_STARTS["forked from the zygote"] += 1
                return self._track(_ForkedRank(zygote, pid))
        PYTHON_STARTS[f"fresh ({why})"] += 1
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            return self.start([sys.executable, *argv], cwd=REPO_ROOT,
                              stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)

    def refresh(self):
        """Records the current descendants of every process seen so far."""
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _proc_stat(int(entry))
                if stat is not None:
                    children.setdefault(stat[0], []).append((int(entry), stat[1]))
        pending = list(self._known)
        while pending:
            for pid, started in children.get(pending.pop(), ()):
                if pid not in self._known:
                    self._known[pid] = started
                    pending.append(pid)

    def signal_roots(self, sig, only_running=True):
        for proc in self.roots:
            if only_running and proc.poll() is not None:
                continue
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_all(self):
        """SIGKILL to every recorded process and its process group, then reap the roots."""
        try:
            self.refresh()
        except OSError:
            pass
        for pid, started in list(self._known.items()):
            stat = _proc_stat(pid)
            if stat is None or stat[1] != started:
                continue  # gone, or the pid now belongs to someone else
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.roots:
            # A session leader's group id is its pid: this reaches grandchildren that stayed in the
            # group even when the leader itself has already exited.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # Descendants are reaped by whoever adopted them; wait until they are at least zombies.
        deadline = time.monotonic() + 5.0
        for pid, started in self._known.items():
            while time.monotonic() < deadline:
                stat = _proc_stat(pid, with_state=True)
                if stat is None or stat[1] != started or stat[2] in "ZX":
                    break
                time.sleep(0.01)


def _supervise(tree: _ProcessTree, deadline: float, grace_after_failure: float | None,
               last_word=(signal.SIGUSR1, STACK_DUMP_WAIT_S)):
    """Waits until every root exited, the deadline passed, or a root failed and the grace ran out.

    Returns (timed_out, first_failure_time).  Roots still running on return are left to the
    caller (who kills them), after being sent last_word[0] and given last_word[1] seconds: SIGUSR1
    makes a rank dump its stacks; SIGTERM makes torchrun stop its workers.
    """
    first_failure = None
    while True:
        codes = [proc.poll() for proc in tree.roots]
        if all(code is not None for code in codes):
            return False, first_failure
        now = time.monotonic()
        if first_failure is None and any(code not in (None, 0) for code in codes):
            first_failure = now
        stop = deadline
        if grace_after_failure is not None and first_failure is not None:
            stop = min(stop, first_failure + grace_after_failure)
        if now >= stop:
            tree.refresh()
            tree.signal_roots(last_word[0])
            time.sleep(last_word[1])
            return now >= deadline, first_failure
        tree.refresh()
        time.sleep(POLL_S)


# ---------------------------------------------------------------------------------------------
# run_ranks

def _read_result(path: Path):
    try:
        with open(path) as file:
            return json.load(file)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as error:
        return {"ok": False, "error_type": "HarnessError",
                "error": f"unreadable result file: {error}", "traceback": ""}


def _rank_report(rank: int, proc, record, stderr_path: Path, killed_by_harness: bool) -> str:
    how = "killed by the harness" if killed_by_harness else _describe_exit(proc.returncode)
    lines = [f"--- rank {rank}: {how}"]
    if record is None:
        lines.append("    no result written (the process died or was killed before returning)")
    elif record.get("ok"):
        lines.append("    returned normally" + (" but did not exit" if proc.returncode else ""))
    else:
        lines.append(f"    raised {record.get('error_type')}: {record.get('error')}")
        lines.append(record.get("traceback", "").rstrip())
    tail = _tail(stderr_path).rstrip()
    if tail:
        lines.append("    stderr tail:")
        lines.append(tail)
    return "\n".join(lines)


def run_ranks(target: str, world_size: int, *, args=None, timeout: float = 120, nnodes: int = 1,
              env: dict | None = None, expect_failure: bool = False,
              reference: bool = False) -> list:
    """Runs `target` ("module:function", importable from the repo root) on `world_size` ranks.

    Each rank is `python -m tests._rank <target> <json args> <result file>` in its own process
    and session, with the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT=<free port>), plus
    OMP_NUM_THREADS=1, DPTC_TIMEOUT=30 and the repo root on PYTHONPATH; `env` is applied last
    (a value of None removes the variable).  With nnodes > 1 the ranks are split into that many
    simulated nodes: rank = node * (world_size // nnodes) + local_rank.

    Returns the ranks' return values in rank order.  If any rank raised or exited non-zero, the
    other ranks get FAILURE_GRACE_S seconds, everything is killed and AssertionError is raised
    with every failing rank's traceback and stderr tail.

    With expect_failure=True nothing is killed early (a rank that dies is the point of the test;
    the survivors must fail on their own before `timeout`) and the result is, per rank, a dict:
        exitcode    the process exit status (negative: killed by that signal)
        error_type  the exception's class name, or None when the function returned (or the
                    process died without writing a result)
        error       the exception's message (None when it returned)
        elapsed     seconds from the rank's clock start (tests._rank.start_clock(), by default
                    the call of the function) to its return or raise; None without a result
        error_mro   class names of the exception's MRO ("DistError" for any dptc error)
        value, traceback, stderr   the return value, the traceback text, the stderr tail
    A run that passes `timeout` raises AssertionError in both modes: a hang is never expected.

    After every run, a /dev/shm entry named dptc* that appeared during the run is removed and
    reported as an AssertionError (see _remove_new_shm for entries of concurrent runs).

    MASTER_PORT is a port that was free a moment before; if rank 0 then finds it taken (by a
    concurrent run), the run is repeated once on a new port.

    reference=True is for runs of torch's own wrappers: torch 2.13's gloo sometimes aborts a
    process at exit (SIGABRT, "terminate called without an active exception") after it wrote
    its result.  Such a run is judged by the results the ranks reported, and a run that failed
    anyway is repeated once.  Its ranks keep torch's groups alive and leave with os._exit once
    their result is written ([Note: torch references at teardown] in tests/_rank.py).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if nnodes < 1 or world_size % nnodes:
        raise ValueError(f"nnodes must divide world_size, got nnodes={nnodes}, "
                         f"world_size={world_size}")
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    args_json = json.dumps(args or {})
    if reference:   # see [Note: torch references at teardown] in tests/_rank.py
        env = {**(env or {}), "DPTC_TEST_REFERENCE": "1"}
    for attempt in (1, 2):
        results, problems, port_taken = _run_ranks_once(target, world_size, args_json, timeout,
                                                        nnodes, env, expect_failure, reference)
        if not ((port_taken or reference and problems) and attempt == 1):
            break
    if problems:
        raise AssertionError("\n\n".join(problems))
    return results


def _port_taken(texts) -> bool:
    return any(_ADDRESS_IN_USE in (text or "").lower() for text in texts)


def _run_ranks_once(target, world_size, args_json, timeout, nnodes, env, expect_failure,
                    reference=False):
    """One run of run_ranks: (results, problems, whether the master port was taken)."""
    shm_before = _shm_entries()
    workdir = Path(tempfile.mkdtemp(prefix="ranks-"))
    tree = _ProcessTree()
    problems = []
    results = []
    port_taken = False
    try:
        port = free_port()
        started = time.monotonic()
        for rank in range(world_size):
            result_path = workdir / f"result-{rank}.json"
            tree.start_python(["-m", "tests._rank", target, args_json, str(result_path)],
                            rank_env(rank, world_size, nnodes=nnodes, master_port=port,
                                     env=env),
                            workdir / f"stdout-{rank}.txt", workdir / f"stderr-{rank}.txt")
        timed_out, _ = _supervise(tree, started + timeout,
                                  None if expect_failure else FAILURE_GRACE_S)
        wall = time.monotonic() - started
        killed = [proc.poll() is None for proc in tree.roots]
        tree.kill_all()

        records = [_read_result(workdir / f"result-{rank}.json") for rank in range(world_size)]
        port_taken = _port_taken([(records[0] or {}).get("error"),
                                  _tail(workdir / "stderr-0.txt")])
        reports = [_rank_report(rank, proc, record, workdir / f"stderr-{rank}.txt", killed[rank])
                   for rank, (proc, record) in enumerate(zip(tree.roots, records))]
        if timed_out:
            problems.append(f"{target} on {world_size} ranks did not finish within {timeout} s "
                            f"(stacks dumped to stderr at the deadline):\n" + "\n".join(reports))
        elif expect_failure:
            for rank, (proc, record) in enumerate(zip(tree.roots, records)):
                record = record or {}
                results.append({
                    "exitcode": proc.returncode,
                    "error_type": None if record.get("ok", True) else record.get("error_type"),
                    "error": None if record.get("ok", True) else record.get("error"),
                    "elapsed": record.get("elapsed"),
                    "error_mro": record.get("error_mro", []),
                    "value": record.get("value"),
                    "traceback": record.get("traceback"),
                    "stderr": _tail(workdir / f"stderr-{rank}.txt"),
                })
        else:
            failed = [rank for rank, (proc, record) in enumerate(zip(tree.roots, records))
                      if not (record or {}).get("ok")
                      or proc.returncode != 0 and not (reference and proc.returncode < 0)]
            if failed:
                problems.append(f"{target} failed on rank(s) {failed} of {world_size} "
                                f"after {wall:.1f} s:\n" + "\n".join(reports[r] for r in failed))
            else:
                results = [record["value"] for record in records]
    finally:
        tree.kill_all()
        leaked = _remove_new_shm(shm_before)
        shutil.rmtree(workdir, ignore_errors=True)
    if leaked:
        problems.append(f"{target} left shared memory behind (now removed): "
                        + ", ".join(str(SHM_DIR / name) for name in leaked))
    return results, problems, port_taken


# ---------------------------------------------------------------------------------------------
# Real torchrun

def run_torchrun_nodes(script_args: list, nnodes: int = 2, nproc_per_node: int = 2,
                       timeout: float = 180, env: dict | None = None) -> list:
    """Runs `nnodes` torchrun invocations of one command line concurrently on this host.

    Node n is `python -m torch.distributed.run --nnodes=<nnodes> --node_rank=n
    --master_addr=127.0.0.1 --master_port=<free port> --nproc_per_node=<nproc_per_node>
    <script_args...>` with the repo root on PYTHONPATH, OMP_NUM_THREADS=1, DPTC_TIMEOUT=30 and
    `env` on top.  Returns [(returncode, stdout, stderr)] per node; a node that fails is the
    caller's to report, and the others get TORCHRUN_FAILURE_GRACE_S seconds to follow before
    they are stopped.  Past `timeout`, every node and every worker it started is killed and
    AssertionError is raised with their output tails.  A /dev/shm/dptc* entry left behind is
    removed and reported as an AssertionError.
    """
    port = free_port()
    argvs = [["-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node}",
              "--master_addr=127.0.0.1", f"--master_port={port}",
              f"--nproc_per_node={nproc_per_node}", *map(str, script_args)]
             for node in range(nnodes)]
    # Each agent forks from the zygote (it imports torch too); its workers are its own.  A node
    # that fails leaves the others waiting for it; torchrun gets SIGTERM (it stops its workers),
    # and whatever survives is killed.
    return _run_processes(argvs, env, timeout, TORCHRUN_FAILURE_GRACE_S, (signal.SIGTERM, 2.0),
                          f"torchrun {' '.join(map(str, script_args))} on {nnodes} nodes")


def _run_processes(argvs: list, env: dict | None, timeout: float, grace: float | None,
                   last_word: tuple, what: str) -> list:
    """Runs `python <argv...>` for every argv at once (see _ProcessTree.start_python) from the
    repo root, in the harness's environment with `env` applied last, and supervises them (see
    _supervise: `grace` after the first failure, then `last_word`).

    Returns [(returncode, stdout, stderr)] in argv order.  Past `timeout` everything is killed
    and AssertionError is raised with every process's output tails; a /dev/shm/dptc* entry left
    behind is removed and reported the same way.  `what` names the run in those messages.
    """
    shm_before = _shm_entries()
    workdir = Path(tempfile.mkdtemp(prefix="python-"))
    tree = _ProcessTree()
    problems = []
    outputs = []
    try:
        base = _apply_overrides(_base_env(), env)
        for index, argv in enumerate(argvs):
            tree.start_python(list(map(str, argv)), base, workdir / f"stdout-{index}.txt",
                              workdir / f"stderr-{index}.txt")
        timed_out, _ = _supervise(tree, time.monotonic() + timeout, grace, last_word)
        tree.kill_all()
        for index, proc in enumerate(tree.roots):
            outputs.append((proc.returncode,
                            (workdir / f"stdout-{index}.txt").read_text("utf-8", "replace"),
                            (workdir / f"stderr-{index}.txt").read_text("utf-8", "replace")))
        if timed_out:
            problems.append(f"{what[:200]} did not finish within {timeout} s:\n" + "\n".join(
                f"--- process {index}: {_describe_exit(code)}\nstdout:\n{out[-2000:]}\n"
                f"stderr:\n{err[-STDERR_TAIL_CHARS:]}"
                for index, (code, out, err) in enumerate(outputs)))
    finally:
        tree.kill_all()
        leaked = _remove_new_shm(shm_before)
        shutil.rmtree(workdir, ignore_errors=True)
    if leaked:
        problems.append(f"{what[:200]} left shared memory behind (now removed): "
                        + ", ".join(str(SHM_DIR / name) for name in leaked))
    if problems:
        raise AssertionError("\n\n".join(problems))
    return outputs


# ---------------------------------------------------------------------------------------------
# One process

def run_python(args: list, *, env: dict | None = None, timeout: float = 90) -> tuple:
    """Runs `python <args...>` (args start with -m or -c) from the repo root in its own process.

    The environment is the harness's (the repo root on PYTHONPATH, OMP_NUM_THREADS=1,
    DPTC_TIMEOUT=30, no launcher variables) with `env` applied last (None removes a variable);
    the process is forked from the zygote when that leaves it unchanged, as a rank is.  Returns
    (returncode, stdout, stderr).  Past `timeout` the process and everything it started are
    killed and AssertionError is raised with its output tails; a /dev/shm/dptc* entry it left
    behind is removed and reported the same way.
    """
    return _run_processes([args], env, timeout, None, (signal.SIGUSR1, STACK_DUMP_WAIT_S),
                          f"python {' '.join(map(str, args))}")[0]


def once(cache: dict, key, launch, what: str | None = None):
    """launch() once per key of `cache`, for the tests that read one launch's results.  A
    failed launch (AssertionError) is remembered, so that every test that reads it fails
    without running it again: with its own error, or as "<what> failed:" and that error."""
    if key not in cache:
        try:
            cache[key] = launch()
        except AssertionError as error:
            cache[key] = error
    outcome = cache[key]
    if isinstance(outcome, AssertionError):
        if what is None:
            raise outcome
        raise AssertionError(f"{what} failed:\n{outcome}")
    return outcome


def run_torch_then_dptc(target: str, world_size: int, args: dict, timeout: float,
                        dptc_args: dict | None = None):
    """(torch's results, dptc's) of target at world_size ranks: torch's run first, as a
    reference (judged by what it reported, see run_ranks), with args plus impl="torch", then
    dptc's with dptc_args (default: the same args) plus impl="dptc"."""
    theirs = run_ranks(target, world_size, args={"impl": "torch", **args}, timeout=timeout,
                       reference=True)
    mine = run_ranks(target, world_size,
                     args={"impl": "dptc", **(args if dptc_args is None else dptc_args)},
                     timeout=timeout)
    return theirs, mine
