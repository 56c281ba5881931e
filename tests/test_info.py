"""NCCL and the CUDA runtime loaded at run time, and ``python -m dptc.info``, on a CPU machine.

Layered by what they need:
- pure functions (version texts, the order in which files are chosen), in this process;
- one process: each case runs in a fresh ``python`` (a library is loaded once per process, so
  every loading case needs its own), against stub libraries this file builds with
  ``cc -shared -fPIC``: an NCCL and a CUDA runtime whose functions do nothing but report
  versions (NCCL 2.27.3, runtime 12.8, driver 12.9, 3 devices), and copies missing one function;
- several ranks: ``python -m dptc.info`` under torchrun prints every rank's row on rank 0.

Import never loads a CUDA library, and a missing file or function is a dptc.CudaLibraryError
naming it, raised when a CUDA tensor first meets dptc (a FakeTensor on "cuda" stands in for one:
this machine has no CUDA).
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

import dptc
from dptc import _cuda
from tests._cc import c_compiler
from tests._launch import run_python, run_torchrun_nodes

TIMEOUT_S = 90
TORCHRUN_TIMEOUT_S = 150
MISSING_NCCL = "/nonexistent/libnccl.so.2"
MISSING_CUDART = "/nonexistent/libcudart.so.12"

NCCL_FUNCTIONS = ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank",
                  "ncclCommInitRankConfig", "ncclCommAbort", "ncclCommDestroy",
                  "ncclCommGetAsyncError", "ncclAllReduce", "ncclReduceScatter", "ncclAllGather",
                  "ncclBroadcast", "ncclGroupStart", "ncclGroupEnd", "ncclGetErrorString")
CUDART_FUNCTIONS = ("cudaGetDeviceCount", "cudaGetDevice", "cudaSetDevice",
                    "cudaStreamCreateWithPriority", "cudaStreamDestroy",
                    "cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery",
                    "cudaEventSynchronize", "cudaStreamWaitEvent", "cudaEventDestroy",
                    "cudaGetErrorString", "cudaMalloc", "cudaFree", "cudaHostAlloc",
                    "cudaFreeHost", "cudaMemcpyAsync", "cudaRuntimeGetVersion",
                    "cudaDriverGetVersion")
# Bodies of the functions the loader calls; every other function is `int f(void) { return 0; }`.
STUB_BODIES = {
    "ncclGetVersion": "int ncclGetVersion(int *v) { *v = 22703; return 0; }",
    "ncclGetErrorString": 'const char *ncclGetErrorString(int r) { (void)r; return "stub"; }',
    "cudaGetDeviceCount": "int cudaGetDeviceCount(int *n) { *n = 3; return 0; }",
    "cudaRuntimeGetVersion": "int cudaRuntimeGetVersion(int *v) { *v = 12080; return 0; }",
    "cudaDriverGetVersion": "int cudaDriverGetVersion(int *v) { *v = 12090; return 0; }",
    "cudaGetErrorString": 'const char *cudaGetErrorString(int e) { (void)e; return "stub"; }',
}


# ---------------------------------------------------------------------------------------------
# Helpers

def _env(**overrides):
    """A child's environment on top of the harness's: no library overrides unless given."""
    env = {_cuda.NCCL_ENV: None, _cuda.CUDART_ENV: None}
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def _python(args, env):
    """Runs `python args...` from the repo root (forked from the test zygote, which has imported
    torch but no CUDA library); returns (returncode, stdout, stderr)."""
    return run_python(args, env=env, timeout=TIMEOUT_S)


def _run_json(*code, **env):
    """Runs the code blocks (the last prints one JSON object) in a fresh python; returns the
    object."""
    rc, out, err = _python(["-c", "".join(map(textwrap.dedent, code))], _env(**env))
    assert rc == 0, f"child failed ({rc}):\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def _compiler():
    return c_compiler("build the stub libraries")


def _build_stub(directory, soname, functions, omit=()):
    """A shared library defining `functions` (but not `omit`) with trivial bodies."""
    lines = [STUB_BODIES.get(name, f"int {name}(void) {{ return 0; }}")
             for name in functions if name not in omit]
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "stub.c"
    source.write_text("\n".join(lines) + "\n")
    library = directory / soname
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # tools/sanitize.sh's ASan
    done = subprocess.run([_compiler(), "-shared", "-fPIC", "-o", str(library), str(source)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert done.returncode == 0, f"building {library} failed:\n{done.stderr}"
    return str(library)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_stubs")
    return {
        "nccl": _build_stub(root / "nccl", "libnccl.so.2", NCCL_FUNCTIONS),
        "cudart": _build_stub(root / "cudart", "libcudart.so.12", CUDART_FUNCTIONS),
        "nccl_no_async_error": _build_stub(root / "nccl_partial", "libnccl.so.2", NCCL_FUNCTIONS,
                                           omit=("ncclCommGetAsyncError",)),
        "nccl_no_config": _build_stub(root / "nccl_old", "libnccl.so.2", NCCL_FUNCTIONS,
                                      omit=("ncclCommInitRankConfig",)),
        "cudart_no_wait_event": _build_stub(root / "cudart_partial", "libcudart.so.12",
                                            CUDART_FUNCTIONS, omit=("cudaStreamWaitEvent",)),
    }


# A CUDA tensor's stand-in on this CPU machine, and the calls where a CUDA tensor meets dptc.
FAKE_CUDA = """
    import json, torch, dptc
    from dptc import _C, _cuda
    from dptc.collectives import _check_tensor
    from dptc.ddp import _check_devices
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cuda_tensor = torch.empty(4, device="cuda")
    assert cuda_tensor.device.type == "cuda"

    def attempt(call):
        try:
            call()
        except Exception as error:
            return {"type": type(error).__name__, "module": type(error).__module__,
                    "message": str(error)}
        return None
"""


# ---------------------------------------------------------------------------------------------
# Pure functions

@pytest.mark.parametrize("code,text", [(22703, "2.27.3"), (21803, "2.18.3"), (2708, "2.7.8"),
                                       (None, None)])
def test_nccl_version_text(code, text):
    assert _cuda.nccl_version_text(code) == text


@pytest.mark.parametrize("code,text", [(12080, "12.8"), (12040, "12.4"), (11080, "11.8"),
                                       (13000, "13.0"), (0, None), (None, None)])
def test_cuda_version_text(code, text):
    assert _cuda.cuda_version_text(code) == text


def test_file_choice_order(tmp_path, monkeypatch):
    """$DPTC_NCCL_LIBRARY, then a copy already loaded, then the nvidia wheel, then the soname."""
    monkeypatch.delenv(_cuda.NCCL_ENV, raising=False)
    monkeypatch.setattr(_cuda, "_mapped_library", lambda pattern: None)
    assert _cuda.find_nccl() == ("libnccl.so.2", "the dynamic loader's search path")

    wheel = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere"), str(tmp_path)])
    assert _cuda.find_nccl() == (str(wheel), "nvidia wheel on sys.path")

    monkeypatch.setattr(_cuda, "_mapped_library", lambda pattern: "/opt/torch/libnccl.so.2")
    assert _cuda.find_nccl() == ("/opt/torch/libnccl.so.2", "already loaded in this process")

    monkeypatch.setenv(_cuda.NCCL_ENV, MISSING_NCCL)
    assert _cuda.find_nccl() == (MISSING_NCCL, "$DPTC_NCCL_LIBRARY")


# ---------------------------------------------------------------------------------------------
# One process

def test_import_loads_no_cuda_library():
    result = _run_json("""
        import json, dptc, dptc.fsdp, dptc.ddp
        from dptc import _C
        with open("/proc/self/maps") as maps:
            mapped = sorted({line.split()[-1] for line in maps
                             if "libnccl" in line or "libcudart" in line})
        print(json.dumps({"mapped": mapped, "states": {name: info["state"] for name, info
                                                        in _C.cuda_libraries().items()}}))
    """)
    assert result == {"mapped": [], "states": {"nccl": "untried", "cudart": "untried"}}


def test_info_reports_nccl_not_found():
    env = _env(**{_cuda.NCCL_ENV: MISSING_NCCL, _cuda.CUDART_ENV: MISSING_CUDART})
    rc, out, err = _python(["-m", "dptc.info", "--json"], env)
    assert rc == 0, f"{out}\n{err}"
    report = json.loads(out)
    shm = os.statvfs("/dev/shm")
    assert report["dptc"]["version"] == dptc.__version__
    assert "shm" in report["transports"]
    assert "nccl" in report["transports"] and report["nccl_transport"] == "built"
    assert report["nccl"]["state"] == "failed"
    assert report["nccl"]["path"] == MISSING_NCCL
    assert report["nccl"]["source"] == "$DPTC_NCCL_LIBRARY"
    assert MISSING_NCCL in report["nccl"]["error"]
    assert "DPTC_NCCL_LIBRARY" in report["nccl"]["error"]
    assert report["cudart"]["state"] == "failed" and MISSING_CUDART in report["cudart"]["reason"]
    assert report["cuda_devices"]["count"] == 0
    assert report["dev_shm"]["size"] == shm.f_blocks * shm.f_frsize
    assert report["dev_shm"]["needed"] is False
    assert report["torchrun"] is None

    rc, text, err = _python(["-m", "dptc.info"], env)
    assert rc == 0, f"{text}\n{err}"
    assert text.startswith(f"dptc {dptc.__version__} at ")
    assert "not found" in text and MISSING_NCCL in text
    assert "not under torchrun" in text


@pytest.mark.parametrize("which", ["nonexistent", "no_async_error", "no_wait_event"])
def test_missing_library_or_function_names_it(which, stubs):
    """The first CUDA tensor raises CudaLibraryError naming the file or the function, at every
    place a CUDA tensor meets dptc, and the same error again later (the failure is kept)."""
    nccl, cudart, named = {
        "nonexistent": (MISSING_NCCL, stubs["cudart"], [MISSING_NCCL, "DPTC_NCCL_LIBRARY"]),
        "no_async_error": (stubs["nccl_no_async_error"], stubs["cudart"],
                           [stubs["nccl_no_async_error"], "ncclCommGetAsyncError"]),
        "no_wait_event": (stubs["nccl"], stubs["cudart_no_wait_event"],
                          [stubs["cudart_no_wait_event"], "cudaStreamWaitEvent",
                           "DPTC_CUDART_LIBRARY"]),
    }[which]
    result = _run_json(FAKE_CUDA, """
        first = attempt(lambda: _check_tensor(cuda_tensor, "tensor"))
        print(json.dumps({
            "first": first,
            "again": attempt(lambda: _check_tensor(cuda_tensor, "tensor")),
            "ddp": attempt(lambda: _check_devices([cuda_tensor], None, None)),
            "all_reduce": attempt(lambda: dptc.all_reduce(cuda_tensor)),
            "is_dist_error": issubclass(dptc.CudaLibraryError, dptc.DistError),
            "libraries": _C.cuda_libraries(),
        }))
        dptc.destroy_process_group()
    """, **{_cuda.NCCL_ENV: nccl, _cuda.CUDART_ENV: cudart})
    first = result["first"]
    assert (first["module"], first["type"]) == ("dptc", "CudaLibraryError")
    for part in named:
        assert part in first["message"], (part, first["message"])
    assert result["again"] == first
    assert result["ddp"] == first
    assert result["all_reduce"] == first
    assert result["is_dist_error"]
    failed = "cudart" if which == "no_wait_event" else "nccl"
    other = "nccl" if failed == "cudart" else "cudart"
    assert result["libraries"][failed]["state"] == "failed"
    assert result["libraries"][other]["state"] == "loaded"


def test_found_libraries_report_versions(stubs):
    """Complete stubs load: versions, device count through the loaded cudaGetDeviceCount, one
    outcome for concurrent first loads and for later paths; a CUDA tensor then passes the
    collectives' and DistributedDataParallel's checks (it goes to NCCL)."""
    result = _run_json(FAKE_CUDA, """
        import threading
        paths = (_cuda.find_nccl().path, _cuda.find_cudart().path)
        outcomes = []
        threads = [threading.Thread(target=lambda: outcomes.append(_C.load_cuda(*paths)))
                   for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(json.dumps({
            "same": all(outcome == outcomes[0] for outcome in outcomes) and len(outcomes) == 8,
            "later": _C.load_cuda("/elsewhere/libnccl.so.2", "/elsewhere/libcudart.so.12"),
            "load": _cuda.load(),
            "devices": _C.cuda_device_count(),
            "check": attempt(lambda: _check_tensor(cuda_tensor, "tensor")),
            "ddp": attempt(lambda: _check_devices([cuda_tensor], None, None)),
        }))
    """, **{_cuda.NCCL_ENV: stubs["nccl"], _cuda.CUDART_ENV: stubs["cudart"]})
    assert result["same"]
    nccl, cudart = result["load"]["nccl"], result["load"]["cudart"]
    assert (nccl["state"], nccl["path"], nccl["version"], nccl["version_text"]) == (
        "loaded", stubs["nccl"], 22703, "2.27.3")
    assert nccl["source"] == "$DPTC_NCCL_LIBRARY" and nccl["error"] is None
    assert (cudart["state"], cudart["path"], cudart["version_text"]) == (
        "loaded", stubs["cudart"], "12.8")
    assert (cudart["driver_version"], cudart["driver_version_text"]) == (12090, "12.9")
    assert result["later"]["nccl"]["path"] == stubs["nccl"]
    assert result["devices"] == 3
    # Once both load, a CUDA tensor passes the collectives' and DDP's checks (it goes to NCCL).
    assert result["check"] is None and result["ddp"] is None, result


def test_optional_function_may_be_missing(stubs):
    """ncclCommInitRankConfig (NCCL >= 2.14) is optional: an NCCL without it loads."""
    result = _run_json("""
        import json
        from dptc import _cuda
        print(json.dumps(_cuda.load()["nccl"]))
    """, **{_cuda.NCCL_ENV: stubs["nccl_no_config"], _cuda.CUDART_ENV: stubs["cudart"]})
    assert result["state"] == "loaded" and result["version_text"] == "2.27.3"


def test_copy_already_loaded_is_chosen(stubs):
    """A libnccl already mapped into the process (as torch's CUDA build maps its own) is the
    one chosen when $DPTC_NCCL_LIBRARY is unset, found through /proc/self/maps."""
    result = _run_json(f"""
        import ctypes, json, os
        ctypes.CDLL({stubs["nccl"]!r}, mode=os.RTLD_LOCAL)
        from dptc import _cuda
        print(json.dumps(_cuda.find_nccl()))
    """)
    assert result == [stubs["nccl"], "already loaded in this process"]


def test_info_reports_found_libraries(stubs):
    env = _env(**{_cuda.NCCL_ENV: stubs["nccl"], _cuda.CUDART_ENV: stubs["cudart"]})
    rc, out, err = _python(["-m", "dptc.info", "--json"], env)
    assert rc == 0, f"{out}\n{err}"
    report = json.loads(out)
    assert report["nccl"]["version_text"] == "2.27.3"
    assert report["cudart"]["version_text"] == "12.8"
    assert report["cuda_devices"] == {"count": 3, "source": "cudaGetDeviceCount", "error": None}
    rc, text, err = _python(["-m", "dptc.info"], env)
    assert rc == 0, f"{text}\n{err}"
    assert f"2.27.3 at {stubs['nccl']} ($DPTC_NCCL_LIBRARY)" in " ".join(text.split())
    assert "driver supports CUDA 12.9" in text


# ---------------------------------------------------------------------------------------------
# Several ranks

def _torchrun_info(nnodes, nproc_per_node, *args):
    outputs = run_torchrun_nodes(["-m", "dptc.info", *args], nnodes=nnodes,
                                 nproc_per_node=nproc_per_node, timeout=TORCHRUN_TIMEOUT_S,
                                 env={_cuda.NCCL_ENV: MISSING_NCCL,
                                      _cuda.CUDART_ENV: MISSING_CUDART})
    for node, (code, out, err) in enumerate(outputs):
        assert code == 0, f"node {node} exited {code}:\n{out}\n{err[-3000:]}"
    return outputs


def test_info_under_torchrun_gathers_every_rank():
    """2 ranks on one node: rank 0 prints one JSON report with both ranks' rows."""
    (_, out, _), = _torchrun_info(1, 2, "--json")
    report = json.loads(out[out.index("{"):])
    rows = report["torchrun"]["ranks"]
    host = socket.gethostname()[:64]
    assert [(r["rank"], r["node"], r["local_rank"], r["local_size"], r["host"]) for r in rows] \
        == [(0, 0, 0, 2, host), (1, 0, 1, 2, host)]
    assert len({r["pid"] for r in rows}) == 2
    assert (report["torchrun"]["world_size"], report["torchrun"]["nnodes"]) == (2, 1)


def test_info_under_torchrun_two_nodes_text():
    """Two torchrun nodes of one rank each: rank 0's table shows both, on nodes 0 and 1."""
    outputs = _torchrun_info(2, 1)
    text = outputs[0][1]
    assert "2 ranks on 2 node(s)" in text, text
    table = [line.split() for line in text.splitlines()
             if line.startswith("    ") and not line.startswith("     ")]
    assert table[0][:4] == ["rank", "host", "node", "local"], text
    assert [row[:1] + row[2:4] for row in table[1:]] == [["0", "0", "0/1"], ["1", "1", "0/1"]]
    assert outputs[1][1].strip() == "", "only rank 0 prints"
