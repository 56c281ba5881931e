"""Differential fuzzing across ranks: hypothesis drives long-lived rank servers that run each
generated sequence of calls on two implementations side by side (torch's, the oracle, and
dptc's) and report what each op returned or raised.

Spawning ranks costs seconds, so the ranks are not started per example.  They are servers
(`serve`, the rank side, run as an ordinary tests._rank target) that poll a directory for
`seq_<k>.json` and answer with `result_<k>_rank<r>.json`; both files are written atomically
(a `.partial` file, then os.replace).  The driver (`RankServers`, in the pytest process) hands
them one example at a time and watches them:
- a rank that dies (SIGSEGV, SIGABRT, any exit) fails the example: "dptc rank 0 died with
  SIGSEGV ...", with the op it was in (from its progress file) and its stderr tail;
- an example past its deadline is a hang: the ranks get SIGUSR1 (tests/_rank.py dumps every
  thread's stack to stderr), then everything is killed and the message carries the tails;
after either, the next example starts fresh ranks, so hypothesis can go on and shrink.

Outcomes and comparison (`compare`): a rank result is {impl: [outcome per op]}; an outcome is
{"ok": true, "value": ...} or {"ok": false, "error": "Type: message"}.  The two implementations
agree when, op by op, both raised (any exception: the rank side stops an implementation at its
first raise, so the rest of the sequence is not compared), or both returned values that match:
numbers (or {name: flat list of numbers}) within a relative tolerance (tests/_compare.py's
max_rel), anything else exactly.

Hygiene is the harness's (tests/_launch.py): ranks are forked from the zygote with the
environment torchrun would give them, every process is tracked and killed however the run
ends, and /dev/shm/dptc* entries the servers leave behind are removed; after a clean stop a
leftover is a failure, after a kill it is expected and only removed.

`fuzz` runs a hypothesis search as a plain function call (so one test can run a fixed budget in
CI and a longer search behind an environment variable) and returns its statistics.

Each fuzzer (fully_shard, FSDP1, DDP: tests/test_fuzz_*.py, their ranks' side in
tests/workers_fuzz_*.py) brings its strategy, its check and three rank-side functions (setup,
apply, final); `run_impls` runs them per example on both implementations, and
`run_fuzz_test` is the test's body.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

from tests import _launch
from tests._compare import max_rel

__all__ = ["serve", "serve_torch_and_dptc", "op_sequence", "forward_op", "run_impls",
           "error_text", "renew_failed_dptc_groups", "RankServers", "label", "disagreement",
           "compare", "fuzz", "run_fuzz_test", "budget_from_env", "skipped_from_env"]

POLL_S = 0.002
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
STDERR_TAIL_CHARS = 3000
PROGRESS_TAIL_LINES = 6


def _atomic_write(path: Path, text: str):
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


# ---------------------------------------------------------------------------------------------
# Rank side

def serve(directory: str, run_example, warm_up=None) -> dict:
    """The rank server's loop: runs `warm_up()` (group initialisation), writes
    `ready_rank<r>`, then for k = 0, 1, ... waits for `seq_<k>.json`, calls
    `run_example(example, note)` and writes its JSON-able return value to
    `result_<k>_rank<r>.json`; returns {"examples": k} once `stop` exists.

    `note(text)` appends a line to `progress_rank<r>.txt` (flushed at once), so that when the
    rank dies or hangs the driver can tell which op it was in."""
    rank = int(os.environ["RANK"])
    where = Path(directory)
    if warm_up is not None:
        warm_up()
    with open(where / f"progress_rank{rank}.txt", "a", buffering=1) as progress:
        def note(text):
            progress.write(text + "\n")

        _atomic_write(where / f"ready_rank{rank}", "")
        index = 0
        while True:
            sequence = where / f"seq_{index}.json"
            if sequence.exists():
                example = json.loads(sequence.read_text())
                note(f"example {index}")
                result = run_example(example, note)
                _atomic_write(where / f"result_{index}_rank{rank}.json", json.dumps(result))
                index += 1
                continue
            if (where / "stop").exists():
                return {"examples": index}
            time.sleep(POLL_S)


def _warm_up_torch_and_dptc():
    """torch's default group on gloo (dptc builds its own on it) and dptc's, before ready."""
    from tests._rank import load_impl
    load_impl("torch")
    import dptc
    dptc.init_process_group()


def serve_torch_and_dptc(directory: str, run_example) -> dict:
    """`serve` for a worker that runs torch's implementation and dptc's side by side: both
    groups made before ready, dptc's destroyed at the stop.  It returns through tests._rank's
    reference mode (RankServers sets DPTC_TEST_REFERENCE=1), which writes the exit record and
    leaves with os._exit without freeing torch's groups ([Note: torch references at teardown]
    in tests/_rank.py: a torch DDP's Reducer freed last can deadlock its gloo group's
    destructor, and torch 2.13's FSDP1 and gloo can abort a process at exit)."""
    stats = serve(directory, run_example, warm_up=_warm_up_torch_and_dptc)
    import dptc
    dptc.destroy_process_group()
    return stats


def error_text(error) -> str:
    """An outcome's "error": "Type: message" (the message cut at 500 characters)."""
    return f"{type(error).__name__}: {str(error)[:500]}"


def op_sequence(ops, skip, weights, max_ops):
    """The hypothesis strategy of an example's ops: lists of 1 to max_ops ops drawn from
    `ops` ({name: strategy of that op's dict}, train_step first), the names in `skip` left out.
    An op's name is drawn first, then its arguments: sampled_from draws the names in `weights`
    that many times as often as the others (st.one_of would not: it draws each distinct
    strategy alike, repeated or not), and shrinks towards the first name, so that shrinking
    moves towards plain training steps."""
    from hypothesis import strategies as st
    names = [name for name in ops if name not in skip for _ in range(weights.get(name, 1))]
    vocabulary = st.sampled_from(names).flatmap(lambda name: ops[name])
    return st.lists(vocabulary, min_size=1, max_size=max_ops)


def forward_op(mode, compute_loss, held):
    """The "forward" op every fuzzer has: compute_loss() under torch.no_grad() (mode
    "no_grad"), kept in held["losses"] for a later "backward" op ("keep"), or with its graph
    dropped ("drop"); returns the loss's value."""
    import torch
    if mode == "no_grad":
        with torch.no_grad():
            return compute_loss().item()
    loss = compute_loss()
    if mode == "keep":
        held["losses"].append(loss)
    return loss.item()


def run_impls(example, note, setup, apply, final, impls=("torch", "dptc")) -> dict:
    """The rank side of one example: {impl: [outcome per op]}, each implementation in turn.
    The sequence is "setup", the example's ops, then "final" (which reads what is compared at
    the end); `setup(impl)` returns the state the other two take: `apply(impl, state, op)` and
    `final(impl, state)` return an op's JSON-able value.  An implementation stops at its first
    raise; dptc's then runs the rest of the sequence unchecked (result["dptc_after_raise"]:
    each op's error or None), since a raise must leave a process that goes on without crashing
    or hanging.  example["torch_stop"], where given, is the index of the first op torch's
    cannot run: its sequence ends before it.  Afterwards dptc's groups are renewed where one
    failed (renew_failed_dptc_groups)."""
    result = {}
    for impl in impls:
        outcomes = result[impl] = []
        state = None
        steps = [{"op": "setup"}] + list(example["ops"]) + [{"op": "final"}]
        if impl == "torch" and "torch_stop" in example:
            steps = steps[:example["torch_stop"] + 1]
        for index, op in enumerate(steps):
            note(f"{impl} op {index} {json.dumps(op)}")
            try:
                if op["op"] == "setup":
                    state, value = setup(impl), None
                elif op["op"] == "final":
                    value = final(impl, state)
                else:
                    value = apply(impl, state, op)
                outcomes.append({"op": op["op"], "ok": True, "value": value})
            except Exception as error:  # noqa: BLE001 - every raise is an outcome to compare
                note(f"{impl} op {index} raised {error_text(error)}")
                outcomes.append({"op": op["op"], "ok": False, "error": error_text(error),
                                 "traceback": traceback.format_exc()[-2000:]})
                if impl == "dptc" and op["op"] != "setup":
                    result["dptc_after_raise"] = _after_raise(steps[index + 1:], state, apply,
                                                              final, note)
                break
        note(f"{impl} done")
        del state
        gc.collect()
    if renew_failed_dptc_groups():
        result["dptc_group_renewed"] = True
    return result


def _after_raise(steps, state, apply, final, note) -> list:
    errors = []
    for op in steps:
        note(f"dptc after raise {json.dumps(op)}")
        try:
            if op["op"] == "final":
                final("dptc", state)
            else:
                apply("dptc", state, op)
            errors.append(None)
        except Exception as error:  # noqa: BLE001 - any raise is fine here
            errors.append(error_text(error))
    return errors


def renew_failed_dptc_groups() -> bool:
    """dptc aborts its group on purpose where ranks could otherwise fall out of step (DDP's
    unused-parameter error, for one: "The process group has been aborted so that every rank
    raises"), and an aborted group raises PeerLostError from then on.  torch's gloo group
    stays usable, so the next example would fail at dptc's setup for a reason of this one's.
    Where a dptc group failed on any rank (agreed over torch's gloo group, so that every rank
    decides alike), dptc's groups are destroyed and the default one made again; returns
    whether they were."""
    import dptc
    import torch
    import torch.distributed as dist
    from dptc import group as dptc_group
    failed = any(pg._c.failure() is not None for pg in list(dptc_group._groups)
                 if not pg._c.closed)
    flag = torch.tensor([int(failed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return False
    dptc.destroy_process_group()
    dptc.init_process_group()
    return True


# ---------------------------------------------------------------------------------------------
# Driver side

class RankServers:
    """`world_size` rank servers running `target` (a "module:function" that calls `serve`
    with the `directory` keyword it is given), started on first use and again after every
    failure.

    run(example) returns the ranks' results in rank order or raises AssertionError naming the
    crash or the hang; close() stops the servers and returns the problems found at the stop
    (a server that did not exit cleanly, shared memory left behind).  Use as a context manager:
    every process it started is killed on the way out, whatever happened."""

    def __init__(self, target: str, world_size: int = 2, *, example_timeout: float = 15.0,
                 env: dict | None = None, label=None):
        self.target = target
        self.world_size = world_size
        self.example_timeout = example_timeout
        self.env = {"DPTC_TEST_REFERENCE": "1", **(env or {})}
        # label(rank_progress_line) -> which implementation a rank was in, for messages.
        self.label = label
        self.starts = 0
        self.start_seconds = 0.0
        self._tree = None
        self._dir = None
        self._index = 0
        self._shm_before = _launch._shm_entries()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._kill()

    # -- process management -------------------------------------------------------------------

    def _start(self):
        began = time.monotonic()
        self._dir = Path(tempfile.mkdtemp(prefix="fuzz-"))
        self._tree = _launch._ProcessTree()
        self._index = 0
        port = _launch.free_port()
        args = json.dumps({"directory": str(self._dir)})
        for rank in range(self.world_size):
            self._tree.start_python(
                ["-m", "tests._rank", self.target, args, str(self._dir / f"exit_rank{rank}.json")],
                _launch.rank_env(rank, self.world_size, master_port=port, env=self.env),
                self._dir / f"stdout_rank{rank}.txt", self._dir / f"stderr_rank{rank}.txt")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all((self._dir / f"ready_rank{r}").exists() for r in range(self.world_size)):
            dead = self._dead()
            if dead or time.monotonic() > deadline:
                report = self._report(dead or list(range(self.world_size)))
                self._kill()
                raise AssertionError(f"the fuzz rank servers ({self.target}) did not start:\n"
                                     + report)
            time.sleep(0.01)
        self.starts += 1
        self.start_seconds += time.monotonic() - began

    def _dead(self) -> list:
        return [rank for rank, proc in enumerate(self._tree.roots) if proc.poll() is not None]

    def _kill(self) -> list:
        """Kills every process and removes the run directory; returns the shm entries removed."""
        leaked = []
        if self._tree is not None:
            self._tree.kill_all()
            self._tree = None
            leaked = _launch._remove_new_shm(self._shm_before)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        return leaked

    def close(self) -> list:
        """Stops the servers (if running): they finish, exit, and leave no shared memory.
        Returns a list of problems (empty when all is well)."""
        if self._tree is None:
            return []
        problems = []
        _atomic_write(self._dir / "stop", "")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while len(self._dead()) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
        for rank, proc in enumerate(self._tree.roots):
            if proc.poll() != 0:
                problems.append(f"fuzz rank server {rank} did not stop cleanly "
                                f"({_launch._describe_exit(proc.poll())}):\n"
                                + self._report([rank]))
        leaked = self._kill()
        if leaked:
            problems.append("the fuzz rank servers left shared memory behind (now removed): "
                            + ", ".join(leaked))
        return problems

    # -- one example -----------------------------------------------------------------------------

    def _progress(self, rank) -> list:
        try:
            return (self._dir / f"progress_rank{rank}.txt").read_text().splitlines()
        except FileNotFoundError:
            return []

    def _report(self, ranks) -> str:
        lines = []
        for rank in ranks:
            proc = self._tree.roots[rank]
            lines.append(f"--- rank {rank}: {_launch._describe_exit(proc.poll())}; last ops:")
            lines.extend("    " + line for line in self._progress(rank)[-PROGRESS_TAIL_LINES:])
            tail = _launch._tail(self._dir / f"stderr_rank{rank}.txt", STDERR_TAIL_CHARS).rstrip()
            if tail:
                lines.append("    stderr tail:")
                lines.append(tail)
        return "\n".join(lines)

    def _where(self, rank) -> str:
        """"dptc rank 0" / "torch rank 0": the implementation rank was running, when known."""
        progress = self._progress(rank)
        name = self.label(progress[-1]) if progress and self.label else None
        return f"{name} rank {rank}" if name else f"rank {rank}"

    def run(self, example: dict) -> list:
        """The ranks' results for `example`, in rank order.  A rank that dies or an example
        past example_timeout raises AssertionError; the servers are restarted for the next."""
        if self._tree is None:
            self._start()
        index = self._index
        self._index += 1
        _atomic_write(self._dir / f"seq_{index}.json", json.dumps(example))
        paths = [self._dir / f"result_{index}_rank{r}.json" for r in range(self.world_size)]
        deadline = time.monotonic() + self.example_timeout
        while True:
            if all(path.exists() for path in paths):
                return [json.loads(path.read_text()) for path in paths]
            dead = self._dead()
            if dead:
                time.sleep(0.2)   # let a second rank's death, if any, show too
                dead = self._dead()
                what = "; ".join(f"{self._where(rank)} died with "
                                 + _launch._describe_exit(self._tree.roots[rank].poll())
                                     .replace("killed by ", "") for rank in dead)
                report = self._report(range(self.world_size))
                self._kill()
                raise AssertionError(f"crash: {what}\n{report}")
            if time.monotonic() > deadline:
                stuck = [r for r, path in enumerate(paths) if not path.exists()]
                what = ", ".join(self._where(rank) for rank in stuck)
                self._tree.signal_roots(signal.SIGUSR1)
                time.sleep(_launch.STACK_DUMP_WAIT_S)
                report = self._report(range(self.world_size))
                self._kill()
                raise AssertionError(f"hang: {what} did not finish the example within "
                                     f"{self.example_timeout} s (stacks dumped):\n{report}")
            time.sleep(POLL_S)


# ---------------------------------------------------------------------------------------------
# Comparison

def _numbers(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                        for v in value))


def _differences(got, want, tolerance, where) -> list:
    """Why `got` (the subject's value) does not match `want` (the reference's)."""
    if isinstance(want, dict) and isinstance(got, dict):
        if got.keys() != want.keys():
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        out = []
        for key in want:
            out += _differences(got[key], want[key], tolerance, f"{where}.{key}")
        return out
    if _numbers(want) and _numbers(got):
        got_list = got if isinstance(got, list) else [got]
        want_list = want if isinstance(want, list) else [want]
        if len(got_list) != len(want_list):
            return [f"{where}: {len(got_list)} values != {len(want_list)}"]
        if any(not math.isfinite(v) for v in got_list + want_list):
            same = all(a == b or (math.isnan(a) and math.isnan(b))
                       for a, b in zip(got_list, want_list))
            return [] if same else [f"{where}: {got} != {want} (non-finite)"]
        rel = max_rel({"v": got_list}, {"v": want_list})
        return [] if rel <= tolerance else [f"{where}: max relative difference {rel:.3g} > "
                                            f"{tolerance:g}"]
    return [] if got == want else [f"{where}: {_short(got)} != {_short(want)}"]


def _short(value) -> str:
    if isinstance(value, list) and len(value) > 4:
        return f"[{len(value)} values: {', '.join(map(repr, value[:3]))}, ...]"
    return repr(value)[:200]


def compare(results: list, tolerance: float, reference: str = "torch",
            subject: str = "dptc") -> list:
    """The disagreements between `subject` and `reference` in the rank results, as lines;
    empty when they agree (see the module docstring)."""
    problems = []
    for rank, result in enumerate(results):
        mine, theirs = result[subject], result[reference]
        for index in range(max(len(mine), len(theirs))):
            a = mine[index] if index < len(mine) else None
            b = theirs[index] if index < len(theirs) else None
            where = f"rank {rank} op {index}" + (f" ({b.get('op') or a.get('op')})"
                                                  if a and b else "")
            if a is None or b is None:
                problems.append(f"{where}: {subject} ran {len(mine)} ops, {reference} "
                                f"{len(theirs)}")
                break
            if a["ok"] != b["ok"]:
                problems.append(
                    f"{where}: {subject} " + ("returned" if a["ok"] else f"raised {a['error']}")
                    + f", {reference} " + ("returned" if b["ok"] else f"raised {b['error']}"))
                break
            if not a["ok"]:
                break     # both raised: the rest is not compared
            problems += _differences(a.get("value"), b.get("value"), tolerance, where)
    # Both ranks must have taken the same path; a raise on one rank only is a divergence.
    for impl in (reference, subject):
        paths = {tuple(o["ok"] for o in result[impl]) for result in results}
        if len(paths) > 1:
            problems.append(f"{impl}: ranks disagree on which ops raised: "
                            + "; ".join(f"rank {r}: {[o['ok'] for o in result[impl]]}"
                                        for r, result in enumerate(results)))
    return problems


# ---------------------------------------------------------------------------------------------
# The search

def budget_from_env(default_examples: int, prefix: str = "DPTC_FUZZ"):
    """(max examples, seconds or None) for one fuzz test: `<prefix>_EXAMPLES=N` or
    `<prefix>_SECONDS=S` for a longer run (rounds of fresh seeds until S seconds passed), else
    the CI default."""
    seconds = os.environ.get(f"{prefix}_SECONDS")
    examples = os.environ.get(f"{prefix}_EXAMPLES")
    return (int(examples) if examples else default_examples,
            float(seconds) if seconds else None)


def _kind(error) -> str:
    """What a finding is, for the deletion pass: "crash", "hang" or its first line."""
    first = str(error).split("\n", 1)[0]
    return first.split(":", 1)[0] if first.startswith(("crash:", "hang:")) else first[:40]


def _delete_ops(case, check, kind):
    """Hypothesis's shrinker is not exhaustive; this deletes ops of case["ops"] one at a time
    while the same kind of finding remains.  Returns (a 1-minimal case: no single op can go,
    its error)."""
    error = None
    changed = True
    while changed:
        changed = False
        for index in range(len(case["ops"])):
            candidate = {**case, "ops": case["ops"][:index] + case["ops"][index + 1:]}
            try:
                check(candidate)
            except AssertionError as found:
                if _kind(found) == kind:
                    case, error, changed = candidate, found, True
                    break
    return case, error


def fuzz(strategy, check, *, max_examples: int, seconds: float | None = None, seed: int = 0,
         explicit=(), log=print) -> dict:
    """Runs hypothesis over `strategy` with `check(example)` (raises AssertionError on a
    finding), as one plain call.  DPTC_FUZZ_VERBOSE=1 logs every example and its verdict.

    The explicit examples run first (each once, outside hypothesis: a finding there is
    recorded and the search still runs), then one round of max_examples generated examples
    from the fixed `seed` (reproducible in CI).  With `seconds`, rounds with seeds seed,
    seed + 1, ... go on until that much time has passed, and every round's finding is
    collected instead of stopping at the first.  Returns {"examples": calls of check,
    shrinking included, "rounds": n, "failures": [messages], "seconds": s}; the caller
    asserts on it.  A finding's message carries hypothesis's shrunk case and, for a case
    with a list "ops", first a 1-minimal one: deleting any single op from it makes the
    finding go away (`_delete_ops`)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seed_decorator

    stats = {"examples": 0, "rounds": 0, "failures": []}

    verbose = os.environ.get("DPTC_FUZZ_VERBOSE") == "1"

    def counted(case):
        stats["examples"] += 1
        try:
            check(case)
        except AssertionError as error:
            stats["last_failing"] = case
            if verbose:
                log(f"fuzz example {stats['examples']}: FAIL {json.dumps(case)}\n    "
                    + str(error).splitlines()[0][:300])
            raise
        if verbose:
            log(f"fuzz example {stats['examples']}: pass {json.dumps(case)}")

    began = time.monotonic()
    for number, case in enumerate(explicit):
        try:
            counted(case)
        except AssertionError as error:
            stats["failures"].append(f"explicit example {number}: {error}\n{case!r}")
    round_seed = seed
    while True:
        def body(case):
            counted(case)
        test = settings(max_examples=max_examples, deadline=None, database=None,
                        derandomize=False, report_multiple_bugs=False, print_blob=False,
                        phases=(Phase.generate, Phase.shrink),
                        suppress_health_check=list(HealthCheck))(given(strategy)(body))
        test = seed_decorator(round_seed)(test)
        stats["rounds"] += 1
        try:
            test()
        except AssertionError as error:   # the shrunk finding, falsifying example in notes
            notes = "\n".join(getattr(error, "__notes__", []))
            message = f"{error}\n{notes}".strip()
            shrunk = stats.get("last_failing")   # hypothesis replays its minimal case last
            if isinstance(shrunk, dict) and isinstance(shrunk.get("ops"), list):
                smaller, smaller_error = _delete_ops(shrunk, counted, _kind(error))
                if smaller_error is None:
                    smaller, smaller_error = shrunk, error
                message = (f"minimal sequence (no single op can be deleted):\n"
                           f"{json.dumps(smaller)}\n{smaller_error}\n(hypothesis shrank it "
                           f"to {json.dumps(shrunk)})")
            stats["failures"].append(message)
            if seconds is None:
                break
            log(f"fuzz round {stats['rounds']} (seed {round_seed}): finding after "
                f"{stats['examples']} examples so far:\n{stats['failures'][-1][:3000]}")
        if seconds is None or time.monotonic() - began >= seconds:
            break
        round_seed += 1
    stats["seconds"] = time.monotonic() - began
    return stats


def skipped_from_env() -> set:
    """The names in DPTC_FUZZ_SKIP (comma-separated): ops or known findings to leave out."""
    return {name.strip() for name in os.environ.get("DPTC_FUZZ_SKIP", "").split(",")
            if name.strip()}


def label(progress_line):
    """RankServers' label: the implementation a rank's progress line names."""
    word = progress_line.split(" ", 1)[0]
    return word if word in ("torch", "dptc") else None


def disagreement(problems: list, results: list, preface: str = "") -> AssertionError:
    """The finding for compare's problems: the first ten, and the tracebacks of the last op
    of the first two outcomes that raised."""
    tracebacks = [f"{impl} rank {rank}:\n{outcome['traceback']}"
                  for rank, result in enumerate(results) for impl in ("dptc", "torch")
                  for outcome in result[impl][-1:] if not outcome["ok"]]
    return AssertionError("dptc and torch disagree:\n" + preface + "\n".join(problems[:10])
                          + ("\n" + "\n".join(tracebacks[:2]) if tracebacks else ""))


def run_fuzz_test(name, target, world_size, strategy, check, *, ci_examples, explicit=(),
                  example_timeout, report=None):
    """A fuzz test's body: rank servers of `target`, then `fuzz` of strategy with
    check(servers, example), ci_examples examples (or the budget DPTC_FUZZ_EXAMPLES /
    DPTC_FUZZ_SECONDS gives) from the seed DPTC_FUZZ_SEED (default 0) after the explicit
    examples.  Prints "fuzz <name>: N examples ..." (and whatever report() returns), then
    asserts: no finding, the whole budget run, the servers stopped cleanly."""
    max_examples, seconds = budget_from_env(ci_examples)
    seed = int(os.environ.get("DPTC_FUZZ_SEED", "0"))
    began = time.monotonic()
    with RankServers(target, world_size, example_timeout=example_timeout,
                     label=label) as servers:
        try:
            stats = fuzz(strategy, lambda example: check(servers, example),
                         max_examples=max_examples, seconds=seconds, seed=seed,
                         explicit=explicit)
        finally:
            stop_problems = servers.close()
            print(f"\nfuzz {name}: {servers.starts} rank server start(s) "
                  f"({servers.start_seconds:.1f} s), {time.monotonic() - began:.1f} s in all")
    print(f"fuzz {name}: {stats['examples']} examples in {stats['rounds']} round(s), "
          f"{stats['seconds']:.1f} s, {len(stats['failures'])} finding(s)")
    if report is not None:
        print(report())
    assert not stats["failures"], "\n\n".join(stats["failures"])
    assert stats["examples"] >= max_examples + len(explicit), stats
    assert not stop_problems, "\n".join(stop_problems)
