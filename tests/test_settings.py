"""dptc's DPTC_* environment settings (README.md and notes/API.md name them): a value a setting
does not take is a ValueError naming the variable, the value and what it takes, never the
default in silence nor an error from deep inside torch or the C core.

Layer: one process, one rank (tests._launch.run_python), each bad value in its own process, at
the call that first reads the setting: group creation for the engine's settings, fully_shard
and its first forward for the FSDP switches.  What each good value does is tested where the
setting matters (test_small_shm.py, test_staging.py, test_fsdp.py, test_group.py)."""

import datetime

import pytest

from tests._launch import run_python

TIMEOUT_S = 60

GROUP = "import torch, dptc\ndptc.all_reduce(torch.ones(2))\n"
FSDP = ("import torch, dptc\n"
        "m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))\n"
        "dptc.fully_shard(m[0])\n"
        "dptc.fully_shard(m)\n"
        "m(torch.ones(2, 3)).sum().backward()\n")


def _last_error(code, env):
    rc, out, err = run_python(["-c", code], env=env, timeout=TIMEOUT_S)
    assert rc != 0, (out, err)
    # torch prefixes a rank's uncaught exception once torch.distributed is initialised.
    return err.strip().splitlines()[-1].removeprefix("[rank0]: ")


@pytest.mark.parametrize("name, value, takes", [
    ("DPTC_SHM", "POSIX", "one of memfd, posix"),
    ("DPTC_SHM", "1", "one of memfd, posix"),
    ("DPTC_NCCL_CHECK_ORDER", "no", "one of 0, 1"),
    ("DPTC_SLOT_BYTES", "4096", "an integer in [65536, 1099511627776]"),
    ("DPTC_STREAMS", "8", "an integer in [1, 4]"),
    ("DPTC_SHM_STAGING", "fast", "one of auto, cached, streamed"),
])
def test_engine_settings_are_checked(name, value, takes):
    """DPTC_SHM and DPTC_NCCL_CHECK_ORDER are read by the C core, which took any value but
    posix for memfd and any but 0 for on; DPTC_SLOT_BYTES below 64 KiB was raised to it."""
    assert _last_error(GROUP, {name: value}) == \
        f"ValueError: {name} must be {takes}, got {value!r}"


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf", "1e30", "1e10"])
def test_bad_timeout_names_the_variable(value):
    """0 and negatives were refused as "timeout must be ..." without naming DPTC_TIMEOUT;
    inf and 1e30 raised OverflowError from datetime, and 1e10 (past gloo's nanosecond
    deadlines) made the store time out at once."""
    assert _last_error(GROUP, {"DPTC_TIMEOUT": value}) == (
        f"ValueError: DPTC_TIMEOUT must be a number of seconds greater than 0 and at most "
        f"1e+09 (about 31 years), got {value!r}")


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), 1e30, True, "30",
                                   datetime.timedelta(0), datetime.timedelta(days=1e5)])
def test_bad_timeout_argument(value):
    """Layer: a pure function (dptc.group._timeout_seconds), no process group."""
    from dptc import group
    with pytest.raises(ValueError) as error:
        group._timeout_seconds(value)
    assert str(error.value) == (
        f"timeout must be a number of seconds or a timedelta greater than 0 and at most "
        f"1e+09 (about 31 years), got {value!r}")


def test_good_timeouts(monkeypatch):
    from dptc import group
    monkeypatch.delenv("DPTC_TIMEOUT", raising=False)
    assert group._timeout_seconds(None) == 300.0
    assert group._timeout_seconds(datetime.timedelta(minutes=2)) == 120.0
    assert group._timeout_seconds(1e9) == 1e9
    monkeypatch.setenv("DPTC_TIMEOUT", "2.5")
    assert group._timeout_seconds(None) == 2.5
    assert group._timeout_seconds(7) == 7.0          # the argument wins


@pytest.mark.parametrize("name, value", [
    ("DPTC_FSDP_SHARED_GATHER", "off"),
    ("DPTC_FSDP_SHARED_REDUCE", "false"),
    ("DPTC_FSDP_RELEASE_REDUCE_BUFFERS", "yes"),
])
def test_fsdp_switches_are_checked(name, value):
    """Each took its default for any value but its one other (0 or 1), so
    DPTC_FSDP_SHARED_REDUCE=false left the shared ring on; at one rank none of them applies,
    and a bad value is refused all the same."""
    assert _last_error(FSDP, {name: value}) == \
        f"ValueError: {name} must be one of 0, 1, got {value!r}"


def test_good_switches_train():
    """The other value of every switch, at one rank: the gradients are the unsharded
    module's, and the process exits cleanly."""
    code = ("import copy, torch, dptc\n"
            "torch.manual_seed(0)\n"
            "m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))\n"
            "ref = copy.deepcopy(m)\n"
            "dptc.fully_shard(m[0])\n"
            "dptc.fully_shard(m)\n"
            "x = torch.randn(2, 3)\n"
            "m(x).square().sum().backward()\n"
            "ref(x).square().sum().backward()\n"
            "print(max((p.grad.full_tensor() - q.grad).abs().max().item()\n"
            "          for p, q in zip(m.parameters(), ref.parameters())))\n"
            "dptc.destroy_process_group()\n")
    rc, out, err = run_python(["-c", code], timeout=TIMEOUT_S, env={
        "DPTC_FSDP_SHARED_GATHER": "0", "DPTC_FSDP_SHARED_REDUCE": "0",
        "DPTC_FSDP_RELEASE_REDUCE_BUFFERS": "1", "DPTC_SHM": "memfd",
        "DPTC_NCCL_CHECK_ORDER": "0"})
    assert rc == 0, err
    assert float(out.split()[-1]) == 0.0
