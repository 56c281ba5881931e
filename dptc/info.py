"""``python -m dptc.info``: how dptc was built and what this run finds.

The first thing to run when something is off.  It prints dptc's version and C core, the
transports compiled in, torch's version and build, whether NCCL and the CUDA runtime were found
(which files, why those, their versions; or why not), the CUDA device count, the size of
/dev/shm and whether dptc needs it, and, under torchrun, the layout of the job: rank 0 prints
every rank's host, node and local rank, gathered through dptc's own collectives (so this also
checks that the ranks can talk).  ``--json`` prints the same as one JSON object.

    python -m dptc.info
    torchrun --nproc_per_node=2 -m dptc.info
"""

import argparse
import json
import os
import platform
import socket
import sys
import textwrap

import torch

import dptc
from dptc import _C, _cuda

__all__ = ["collect", "gather_layout", "format_text", "main"]

# Bytes of one rank's row in the layout all-gather (JSON, zero-padded).
ROW_BYTES = 512
HOST_CHARS = 64
LABEL_WIDTH = 14
TEXT_WIDTH = 100
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE")


def _nccl_transport():
    if "nccl" in _C.transports:
        return "built"
    if hasattr(_C, "load_cuda"):
        return "loader built, transport not yet"
    return "not built"


def _libraries():
    """Loads NCCL and the CUDA runtime (a failure is reported, not raised)."""
    try:
        return _cuda.load()
    except dptc.CudaLibraryError:
        return _cuda.libraries()


def _device_count(cudart):
    if cudart["state"] == "loaded":
        try:
            return {"count": _C.cuda_device_count(), "source": "cudaGetDeviceCount",
                    "error": None}
        except dptc.DistError as error:
            return {"count": 0, "source": "cudaGetDeviceCount", "error": str(error)}
    if torch.version.cuda:
        # NVML-based where torch can: no CUDA context is created.
        return {"count": torch.cuda.device_count(), "source": "torch.cuda.device_count",
                "error": None}
    return {"count": 0, "source": None, "error": "no CUDA runtime loaded"}


def _dev_shm():
    mode = os.environ.get("DPTC_SHM", "memfd")
    posix = mode == "posix"
    report = {"path": "/dev/shm", "needed": posix,
              "note": "DPTC_SHM=posix puts dptc's segments here" if posix else
                      "dptc's segments are memfd memory (DPTC_SHM=posix would put them here)"}
    if mode not in ("memfd", "posix"):
        report["note"] = (f"DPTC_SHM={mode!r} is neither memfd nor posix: dptc refuses to make "
                          f"a group; unset it, or set memfd or posix")
    try:
        stat = os.statvfs("/dev/shm")
    except OSError as error:
        report.update(size=None, free=None, error=str(error))
        return report
    report.update(size=stat.f_blocks * stat.f_frsize, free=stat.f_bavail * stat.f_frsize,
                  error=None)
    return report


def _under_torchrun():
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def collect():
    """This process's report, as a dict (no process group involved)."""
    found = _libraries()
    return {
        "dptc": {"version": dptc.__version__, "path": os.path.dirname(dptc.__file__),
                 "extension": _C.__file__},
        "transports": list(_C.transports),
        "nccl_transport": _nccl_transport(),
        "python": platform.python_version(),
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                  "cuda_build": torch.version.cuda is not None},
        "nccl": found["nccl"],
        "cudart": found["cudart"],
        "cuda_devices": _device_count(found["cudart"]),
        "dev_shm": _dev_shm(),
        "torchrun": None,
    }


def _row(report, group):
    return {
        "rank": dptc.get_rank(), "host": socket.gethostname()[:HOST_CHARS], "node": group.node,
        "local_rank": group.local_rank, "local_size": group.local_size, "pid": os.getpid(),
        "nccl": report["nccl"]["version_text"], "cuda_devices": report["cuda_devices"]["count"],
    }


def gather_layout(report):
    """Under torchrun: every rank's row (host, node, local rank, ...), gathered through dptc's
    all-gather on the world group; rank 0 gets the list, the others None."""
    group = dptc.init_process_group()
    try:
        data = json.dumps(_row(report, group)).encode()
        if len(data) > ROW_BYTES:
            raise ValueError(f"a layout row takes {len(data)} bytes, more than {ROW_BYTES}")
        mine = torch.zeros(ROW_BYTES, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = torch.empty(group.size * ROW_BYTES, dtype=torch.uint8)
        dptc.all_gather_into_tensor(every, mine)
        if group.rank != 0:
            return None
        rows = every.view(group.size, ROW_BYTES)
        return [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in rows]
    finally:
        dptc.destroy_process_group()


def _bytes_text(count):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _line(label, text):
    return textwrap.fill(text, TEXT_WIDTH, initial_indent=f"  {label:<{LABEL_WIDTH}}",
                         subsequent_indent=" " * (LABEL_WIDTH + 2), break_on_hyphens=False,
                         break_long_words=False)


def _library_text(info, driver=False):
    if info["state"] != "loaded":
        return f"not found ({info['source']}): {info['reason']}"
    text = f"{info['version_text']} at {info['path']} ({info['source']})"
    if driver:
        supported = info.get("driver_version_text")
        text += f"; driver supports CUDA {supported}" if supported else "; no driver"
    return text


def _layout_table(world):
    columns = ("rank", "host", "node", "local", "pid", "NCCL", "GPUs")
    rows = [(str(r["rank"]), r["host"], str(r["node"]), f"{r['local_rank']}/{r['local_size']}",
             str(r["pid"]), r["nccl"] or "-", str(r["cuda_devices"])) for r in world["ranks"]]
    widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in
              enumerate(columns)]
    lines = ["    " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["    " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
              for row in rows]
    return lines


def format_text(report):
    """The report as a few readable lines."""
    devices = report["cuda_devices"]
    device_text = str(devices["count"])
    if devices["error"]:
        device_text += f" ({devices['error']})"
    elif devices["source"]:
        device_text += f" ({devices['source']})"
    shm = report["dev_shm"]
    if shm["size"] is None:
        shm_text = f"unavailable ({shm['error']})"
    else:
        shm_text = f"{_bytes_text(shm['size'])}, {_bytes_text(shm['free'])} free"
    shm_text += f"; {'needed' if shm['needed'] else 'not needed'}: {shm['note']}"
    torch_info = report["torch"]
    build = f"CUDA {torch_info['cuda']} build" if torch_info["cuda_build"] else "CPU build"
    lines = [
        f"dptc {report['dptc']['version']} at {report['dptc']['path']}",
        _line("C core", f"{os.path.basename(report['dptc']['extension'])}; transports: "
                        f"{', '.join(report['transports'])}; NCCL: {report['nccl_transport']}"),
        _line("Python", report["python"]),
        _line("torch", f"{torch_info['version']} ({build})"),
        _line("NCCL", _library_text(report["nccl"])),
        _line("CUDA runtime", _library_text(report["cudart"], driver=True)),
    ]
    if "failed" in (report["nccl"]["state"], report["cudart"]["state"]):
        lines.append(_line("", f"to use CUDA tensors, install torch's CUDA build (its nvidia "
                               f"wheels bring both) or point ${_cuda.NCCL_ENV} and "
                               f"${_cuda.CUDART_ENV} at the files"))
    lines += [
        _line("CUDA devices", device_text),
        _line("/dev/shm", shm_text),
    ]
    world = report["torchrun"]
    if world is None:
        lines.append(_line("torchrun", "not under torchrun"))
    else:
        lines.append(_line("torchrun", f"{world['world_size']} ranks on {world['nnodes']} "
                                       f"node(s), master {world['master']}"))
        lines += _layout_table(world)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dptc.info", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = collect()
    if _under_torchrun():
        ranks = gather_layout(report)
        if ranks is None:
            return 0      # rank 0 reports for everyone
        report["torchrun"] = {
            "world_size": len(ranks), "nnodes": len({r["node"] for r in ranks}),
            "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            "ranks": ranks,
        }
    print(json.dumps(report, indent=2) if args.json else format_text(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
