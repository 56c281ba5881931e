"""Rank processes forked from one that has already imported torch (see tests/_launch.py).

    python -m tests._zygote <request fd> <reply fd>

Importing torch takes each rank process about 1.5 s of CPU; a test launch of 4 ranks on this
machine's 2 cores spends 3 s on it before any rank does its work.  This process imports torch
once, then forks one child per request, and the child becomes the rank process that
`python -m tests._rank ...` would have been: its own session, the requested environment,
working directory, stdin (/dev/null), stdout and stderr files, and sys.argv; the rank module
itself is imported fresh in the child, which exits through the interpreter's normal shutdown.

Only environments the imports cannot have seen differently are forked (the harness decides,
see _Zygote.unforkable in tests/_launch.py): the launch variables, DPTC_*, TORCHELASTIC_*,
PYTEST_* and TORCHINDUCTOR_CACHE_DIR, which are read at run time.  Anything else, a different OMP_NUM_THREADS or
LD_PRELOAD for instance, gets a real exec.

Requests are JSON lines on <request fd>:
    {"argv": [...], "env": {...}, "cwd": path, "stdout": path, "stderr": path}
where argv is what follows `python -m`: a module and its arguments, or "-c", the code and its
arguments (a child that runs `python -c <code>`).
Replies on <reply fd>, one line each: "ready" first (or "unsafe: ..." if the imports left
another thread running, and the process exits), "started <pid>" for every request, in order, and
"exit <pid> <code>" when a child ends (the code as subprocess reports it: negative for a
signal).  The process exits when the request pipe closes.
"""

import gc
import json
import os
import runpy
import select
import sys
import types

# The point: imported once, before the forks (what the workers import; DTensor imports
# dynamo on first use, 0.6 s of CPU per rank).
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torch.nn  # noqa: F401

POLL_S = 0.005


def _reap(reply):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(reply, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _become(job, request, reply):
    """In the forked child: the rank process's session, files and environment."""
    os.close(request)
    os.close(reply)
    os.setsid()
    stdin = os.open(os.devnull, os.O_RDONLY)
    stdout = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stderr = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])


def serve(request, reply):
    """Forks a child per request; returns only in a child, with its job."""
    pending = b""
    # A fork copies only the calling thread: with another one (a BLAS pool started by an
    # import), a lock it held would stay held in every child.  The harness then execs.
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        os.write(reply, f"unsafe: {threads} threads\n".encode())
        os._exit(0)
    # The imports' ~300k objects live as long as the process: frozen out of the collector, a
    # child's full collection (gc.collect() before a memory reading, or the automatic ones)
    # scans only its own objects, microseconds instead of 0.15 s.
    gc.freeze()
    os.write(reply, b"ready\n")
    while True:
        readable, _, _ = select.select([request], [], [], POLL_S)
        _reap(reply)
        if not readable:
            continue
        chunk = os.read(request, 65536)
        if not chunk:
            os._exit(0)   # the harness is gone; its ranks are its to kill
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become(job, request, reply)
                return job
            os.write(reply, f"started {pid}\n".encode())


def main():
    request, reply = int(sys.argv[1]), int(sys.argv[2])
    job = serve(request, reply)
    if job["argv"][0] == "-c":
        # `python -c <code> <args...>`: the code runs as __main__, sys.argv[0] is "-c".
        code, args = job["argv"][1], job["argv"][2:]
        sys.argv = ["-c"] + args
        main_module = types.ModuleType("__main__")
        sys.modules["__main__"] = main_module
        exec(compile(code, "<string>", "exec"), main_module.__dict__)
        return
    # The rank process proper: `python -m <module> <args...>`, exiting as that would.
    module, args = job["argv"][0], job["argv"][1:]
    sys.argv = [module] + args
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
