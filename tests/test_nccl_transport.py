"""The NCCL transport (csrc/nccl.c) against a stand-in for NCCL and the CUDA runtime.

Layer: one process per test, world size 1, no GPU.  tests/c/fake_cuda.c plays both libraries:
device memory is host memory, a one-rank communicator copies input to output, and events
complete at once unless the test makes them hang.  The test drives the engine's Group with
transport "nccl" directly (CPU tensors stand in for device memory, an object with
`cuda_stream` for a torch.cuda.Stream) and reads through ctypes what the transport asked of the
libraries.  What needs a real GPU (kernels, several ranks, torch's CUDA streams) is
benchmarks/gpu_check.py's.
"""

import json
import os
import subprocess
import textwrap

import pytest

from tests._cc import c_compiler
from tests._launch import REPO_ROOT, run_python

TIMEOUT_S = 90
FAKE_SOURCE = REPO_ROOT / "tests" / "c" / "fake_cuda.c"

PRELUDE = """
    import ctypes, json, os, time, torch
    from dptc import _C, _cuda
    from dptc._dtypes import OP_ALL_REDUCE, OP_ALL_GATHER, OP_BROADCAST, OP_REDUCE_SCATTER
    from dptc._dtypes import OP_BARRIER, dtype_code
    fake = ctypes.CDLL(os.environ["DPTC_NCCL_LIBRARY"])
    fake.fake_recorded_stream.restype = ctypes.c_void_p
    fake.fake_waited_stream.restype = ctypes.c_void_p
    _cuda.load()

    class Stream:                      # what torch.cuda.Stream offers dptc
        def __init__(self, handle):
            self.cuda_stream = handle

    def group(timeout=5.0, streams=2):
        return _C.Group(0, 1, 0, 1, 0, 1, "", False, 1, timeout, streams, [0],
                        nccl_id=_C.nccl_unique_id(), device=0)

    def world_of_one():                # this process as torchrun's rank 0 of 1
        from tests._launch import free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))

    def watchers():                    # dptc's threads still running
        import threading
        return [t.name for t in threading.enumerate() if t.name.startswith("dptc-")]

    def error(call):
        try:
            call()
        except Exception as caught:
            return [type(caught).__name__, str(caught)]
        return None
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    compiler = c_compiler("build tests/c/fake_cuda.c")
    library = tmp_path_factory.mktemp("fake-cuda") / "libfakecuda.so"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library),
                           str(FAKE_SOURCE)], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return str(library)


def _run(fake, code):
    """Runs PRELUDE and `code` in a process of its own (forked from the test zygote, which has
    loaded no CUDA library); returns the JSON object the code printed last."""
    rc, out, err = run_python(["-c", textwrap.dedent(PRELUDE) + textwrap.dedent(code)],
                              env={"DPTC_NCCL_LIBRARY": fake, "DPTC_CUDART_LIBRARY": fake},
                              timeout=TIMEOUT_S)
    assert rc == 0, f"child failed ({rc}):\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def test_collectives_issue_in_order_after_the_callers_stream(fake):
    """Every collective of a one-rank communicator moves its bytes; each is ordered after the
    issuer's stream (an event recorded there, waited on by the engine stream's CUDA stream);
    wait_stream makes the caller's stream wait without blocking the host; and closing the
    group destroys the communicator (not abort)."""
    result = _run(fake, """
        g = group()
        f32 = dtype_code(torch.float32)
        caller = Stream(4321)
        x = torch.arange(6.0)
        out = torch.zeros(6)
        w = g.submit(OP_ALL_REDUCE, f32, 0, x, out, 6, 0, 0, caller)
        # One of the collective's events went on the issuer's stream (the others on the
        # engine stream's: the order check's and the completion's).
        recorded_on = [fake.fake_recorded_stream(k) for k in range(3)]
        waits_after_issue = fake.fake_stream_waits()
        w.wait_stream(caller)
        waits_after_wait_stream = fake.fake_stream_waits()
        w.synchronize()
        pieces = torch.arange(5.0)            # two outputs: 2 and 3 elements per rank
        first, second = torch.zeros(2), torch.zeros(3)
        g.submit(OP_ALL_GATHER, f32, 0, pieces, [first, second], 5, 0, 1, caller).synchronize()
        gathered = torch.zeros(4)
        g.submit(OP_ALL_GATHER, f32, 0, torch.ones(4), gathered, 4, 0, 0, None).synchronize()
        cast = torch.zeros(3, dtype=torch.int64)
        g.submit(OP_REDUCE_SCATTER, dtype_code(torch.int64), 0, torch.arange(3), cast, 3, 0, 1,
                 None).synchronize()
        b = torch.full((3,), 7, dtype=torch.bfloat16)
        g.submit(OP_BROADCAST, dtype_code(torch.bfloat16), 0, b, b, 3, 0, 0, None).synchronize()
        g.submit(OP_BARRIER, f32, 0, None, None, 0, 0, 0, None).synchronize()
        share = error(lambda: g.share(64))
        g.close()
        print(json.dumps({
            "out": out.tolist(), "recorded_on": recorded_on,
            "waits_after_issue": waits_after_issue,
            "waits_after_wait_stream": waits_after_wait_stream,
            "first": first.tolist(), "second": second.tolist(), "gathered": gathered.tolist(),
            "cast": cast.tolist(), "b": b.float().tolist(),
            "inits": fake.fake_inits(), "destroys": fake.fake_destroys(),
            "aborts": fake.fake_aborts(), "transports": list(_C.transports),
            "share": share,
        }))
    """)
    assert result["out"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert 4321 in result["recorded_on"]
    assert result["waits_after_issue"] == 1          # the engine's stream waits on the caller's
    # wait_stream adds one wait, unless the (fake) device had finished already.
    assert result["waits_after_wait_stream"] in (1, 2)
    assert result["first"] == [0.0, 1.0] and result["second"] == [2.0, 3.0, 4.0]
    assert result["gathered"] == [1.0] * 4
    assert result["cast"] == [0, 1, 2]
    assert result["b"] == [7.0] * 3
    assert (result["inits"], result["destroys"], result["aborts"]) == (1, 1, 0)
    assert "nccl" in result["transports"]
    assert result["share"] is not None and result["share"][0] == "TypeError"


def test_stuck_collective_times_out_and_aborts(fake):
    """A collective whose completion never comes: wait_stream still returns at once (the host
    does not wait), the progress thread fails it at its deadline (DistTimeoutError after the
    group's 1 s timeout, not a hang), the communicator is aborted, and later collectives
    raise the same failure at once."""
    result = _run(fake, """
        g = group(timeout=1.0)
        f32 = dtype_code(torch.float32)
        x = torch.ones(4)
        fake.fake_set_hang(1)
        started = time.monotonic()
        w = g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, None)
        w.wait_stream(None)
        wait_stream_s = time.monotonic() - started
        failure = error(lambda: w.synchronize())
        waited_s = time.monotonic() - started
        fake.fake_set_hang(0)
        later = error(lambda: g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, None).synchronize())
        aborts = fake.fake_aborts()
        g.close()
        print(json.dumps({"wait_stream_s": wait_stream_s, "failure": failure,
                          "waited_s": waited_s, "later": later, "aborts": aborts,
                          "destroys": fake.fake_destroys()}))
    """)
    assert result["wait_stream_s"] < 0.8, result     # blocking would take the 1 s timeout
    assert result["failure"][0] == "DistTimeoutError", result
    assert "did not complete by its deadline" in result["failure"][1], result
    assert 0.9 <= result["waited_s"] < 3.0, result
    assert result["later"][0] == "DistTimeoutError", result
    assert result["aborts"] == 1 and result["destroys"] == 0, result


def test_asynchronous_nccl_error_raises(fake):
    """NCCL reporting an asynchronous error (ncclRemoteError) while a collective is pending
    fails it well before its deadline, naming the error, and aborts the communicator."""
    result = _run(fake, """
        g = group(timeout=30.0)
        x = torch.ones(4)
        fake.fake_set_hang(1)
        w = g.submit(OP_ALL_REDUCE, dtype_code(torch.float32), 0, x, x, 4, 0, 0, None)
        started = time.monotonic()
        fake.fake_set_async_error(6)
        failure = error(lambda: w.synchronize())
        print(json.dumps({"failure": failure, "waited_s": time.monotonic() - started,
                          "aborts": fake.fake_aborts()}))
    """)
    assert result["failure"][0] == "DistError", result
    assert "asynchronous error" in result["failure"][1], result
    assert "remote process exited" in result["failure"][1], result
    assert result["waited_s"] < 5.0 and result["aborts"] == 1, result


def test_waits_and_dropped_works_do_not_block_the_host(fake):
    """While the device has not finished a collective: Work.wait() and a blocking run() only
    make the stream wait (they return at once); dropping the Work does not wait either, yet its
    tensor stays alive until the device is done, and the next collective then releases it."""
    result = _run(fake, """
        import weakref
        g = group()
        f32 = dtype_code(torch.float32)
        x = torch.ones(4)
        alive = weakref.ref(x)
        fake.fake_set_hang(1)
        started = time.monotonic()
        w = g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, Stream(7))
        w.wait()
        g.run(OP_ALL_REDUCE, f32, 0, torch.ones(2), torch.ones(2), 2, 0, 1)
        del w, x
        host_s = time.monotonic() - started
        alive_while_running = alive() is not None
        fake.fake_set_hang(0)
        time.sleep(0.2)                       # the progress threads see the events complete
        g.submit(OP_BARRIER, f32, 0, None, None, 0, 0, 0, None).synchronize()
        print(json.dumps({"host_s": host_s, "alive_while_running": alive_while_running,
                          "alive_after": alive() is not None}))
    """)
    assert result["host_s"] < 2.0, result      # blocking would take the 5 s timeout
    assert result["alive_while_running"], result
    assert not result["alive_after"], result


def test_fully_shard_units_run_on_the_nccl_engine(fake):
    """fully_shard's units take the NCCL engine for CUDA parameters (ProcessGroup
    .device_engine); here, at world size 1, CPU parameters are routed to it as if they were on
    device 0, so the gathers and reduce-scatters go through the transport and the fake.  Two
    steps of AdamW train a float64 GPT exactly as single-process training does, every unit's
    collective was ordered after the current (fake) stream, and the root's next forward waited
    on the set_post_optim_event event."""
    result = _run(fake, """
        import copy
        from tests._compare import max_rel
        world_of_one()
        import dptc
        from dptc.fsdp import _unit
        from examples.gpt import GPT, build_gpt
        dptc.init_process_group()
        _unit.Unit.engine = lambda self, group: group.device_engine(torch.device("cuda", 0))
        _unit.Unit.current_stream = lambda self: (lambda: Stream(77))
        # As on a CUDA device: the CPU-only paths over a shard group of one, which move nothing
        # through any transport, stay off.
        _unit.Unit._aliases = lambda self, bucket, p: False
        _unit.Unit._reduces_in_place = lambda self, bucket, grads, after: False
        torch.manual_seed(0)
        model = build_gpt(vocab=64, d_model=32, n_layer=2, n_head=4, ctx=16).double()
        ref = copy.deepcopy(model)
        for block in model.blocks:
            dptc.fully_shard(block)
        dptc.fully_shard(model)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]

        class Event:                   # a torch.cuda.Event recorded after the optimizer step
            device = torch.device("cuda", 0)
            waits = 0
            def record(self, stream=None):
                pass
            def wait(self, stream=None):
                Event.waits += 1

        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            idx = torch.randint(0, 64, (4, 17), generator=generator)
            for m, opt in zip((model, ref), opts):
                GPT.loss(m(idx[:, :-1]), idx[:, 1:]).backward()
                opt.step()
                opt.zero_grad()
            model.set_post_optim_event(Event())
        rel = max_rel([p.full_tensor() for p in model.parameters()],
                      [p.detach() for p in ref.parameters()])
        dptc.destroy_process_group()
        print(json.dumps({"rel": rel, "inits": fake.fake_inits(), "watchers": watchers(),
                          "post_optim_waits": Event.waits,
                          "stream_waits": fake.fake_stream_waits(),
                          "recorded_on": [fake.fake_recorded_stream(k) for k in range(3)]}))
    """)
    assert result["rel"] <= 1e-12, result
    assert result["inits"] == 1, result
    # The group's abort watcher is joined by destroy_process_group: a watcher still inside a
    # store call when torch tears the store down at exit aborts the process.
    assert result["watchers"] == [], result
    assert 77 in result["recorded_on"], result     # the units' collectives follow it
    # Every gather and reduce-scatter waits on its issuer's stream (3 units, 2 steps).
    assert result["stream_waits"] >= 2 * 3 * 2, result
    # The second forward's current stream waited on the event the first step left.
    assert result["post_optim_waits"] == 1, result


@pytest.mark.parametrize("as_view", [False, True])
def test_ddp_buckets_on_the_nccl_engine(fake, as_view):
    """DistributedDataParallel of a CUDA module keeps its buckets on the device and reduces
    them through the group's NCCL engine ([Note: buckets on a device] in csrc/reducer.c).  Here,
    at world size 1, a CPU module is taken for one on device 0 (its buckets stay CPU tensors,
    the stream is the fake's), so the reducer's device path runs against the fake: gradients
    copied in and out with torch, every bucket's all-reduce ordered after the current stream,
    the end of backward making that stream wait.  Two steps (the first with a no_sync
    micro-batch, then bucket rebuild) train a float64 GPT exactly as single-process training
    does, with and without gradient_as_bucket_view; so does a model with unused parameters
    under find_unused_parameters=True, its used map all-reduced on the device."""
    result = _run(fake, f"""
        import copy
        from tests._compare import max_rel
        world_of_one()
        import dptc
        from dptc import ddp
        from examples.gpt import GPT, build_gpt
        dptc.init_process_group()
        ddp._check_devices = lambda params, ids, out: torch.device("cuda", 0)
        ddp.DistributedDataParallel._bucket_tensor = lambda self, n, d: torch.zeros(n, dtype=d)
        torch.cuda.current_stream = lambda device=None: Stream(99)
        torch.manual_seed(0)
        model = build_gpt(vocab=64, d_model=32, n_layer=2, n_head=4, ctx=16).double()
        ref = copy.deepcopy(model)
        wrapped = ddp.DistributedDataParallel(model, bucket_cap_mb=0.01,
                                              gradient_as_bucket_view={as_view})
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (wrapped, ref)]
        generator = torch.Generator().manual_seed(1)
        for _ in range(2):
            for micro in range(2):
                idx = torch.randint(0, 64, (4, 17), generator=generator)
                for m in (wrapped, ref):
                    loss = GPT.loss(m(idx[:, :-1]), idx[:, 1:]) / 2
                    if m is wrapped and micro == 0:
                        with wrapped.no_sync():
                            loss = GPT.loss(m(idx[:, :-1]), idx[:, 1:]) / 2
                            loss.backward()
                    else:
                        loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        rel = max_rel([p.detach() for p in model.parameters()],
                      [p.detach() for p in ref.parameters()])
        buckets = len(wrapped._buckets)

        # find_unused_parameters, five steps: a is always used, b on steps 1, 3 and 4, c and d
        # on step 4 only; from step 2 on, the fake's "peer" uses d (its uint8 MAX all-reduces
        # take the maximum with fake_set_peer_max's bytes, here d.weight and d.bias, slots 6
        # and 7).  Step 4 uses everything, so the host does not wait for the map there.
        class Branchy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                for name in "abcd":
                    setattr(self, name, torch.nn.Linear(8, 8).double())
            def forward(self, x, names):
                x = torch.tanh(self.a(x))
                for name in names:
                    x = getattr(self, name)(x)
                return x.pow(2).sum()
        plan = ["", "b", "", "b", "bcd"]
        torch.manual_seed(2)
        branchy = Branchy()
        plain = copy.deepcopy(branchy)
        unused_ddp = ddp.DistributedDataParallel(branchy, find_unused_parameters=True,
                                                 bucket_cap_mb=0.001,
                                                 gradient_as_bucket_view={as_view})
        sgds = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (unused_ddp, plain)]
        seen = []
        for step, names in enumerate(plan):
            if step == 2:
                peer = (ctypes.c_ubyte * 8)(0, 0, 0, 0, 0, 0, 1, 1)
                fake.fake_set_peer_max(peer, ctypes.c_size_t(8))
            x = torch.randn(4, 8, dtype=torch.float64, generator=generator)
            for m in (unused_ddp, plain):
                m(x, names).backward()
            seen.append({{name: None if p.grad is None else max_rel([p.grad], [q.grad])
                                if q.grad is not None else float(p.grad.abs().sum())
                         for (name, p), q in zip(branchy.named_parameters(),
                                                 plain.parameters())}})
            for opt in sgds:
                opt.step()
                opt.zero_grad()
        unused_rel = max_rel([p.detach() for p in branchy.parameters()],
                             [p.detach() for p in plain.parameters()])
        dptc.destroy_process_group()
        print(json.dumps({{"rel": rel, "buckets": buckets, "seen": seen,
                          "unused_rel": unused_rel,
                          "watchers": watchers(),
                          "inits": fake.fake_inits(),
                          "stream_waits": fake.fake_stream_waits(),
                          "recorded_on": [fake.fake_recorded_stream(k) for k in range(3)]}}))
    """)
    assert result["rel"] <= 1e-12, result
    assert result["buckets"] > 2, result
    assert result["inits"] == 1, result
    assert result["watchers"] == [], result
    # Each bucket's all-reduce waits on the current stream at launch (the end-of-backward wait
    # adds one for each bucket the fake has not yet seen complete).
    assert result["stream_waits"] >= 2 * result["buckets"], result
    assert 99 in result["recorded_on"], result
    # find_unused_parameters on device buckets ([Note: unused parameters on a device]):
    # trained as single-process training, b's gradient on the steps that use it too.
    # seen[step][name]: None for no .grad; the relative difference from the reference's .grad;
    # or, where the reference has none, the sum of |.grad|.
    assert result["unused_rel"] <= 1e-12, result
    plan = ["", "b", "", "b", "bcd"]
    for step, (names, seen) in enumerate(zip(plan, result["seen"])):
        for layer in "abcd":
            for name in (f"{layer}.weight", f"{layer}.bias"):
                if layer == "a" or layer in names:
                    assert seen[name] is not None and seen[name] <= 1e-12, (step, name, result)
                elif layer == "d" and step >= 2:
                    # Used by the peer only: .grad appears, the average of this rank's zeros.
                    assert seen[name] == 0.0, (step, name, result)
                else:
                    assert seen[name] is None, (step, name, result)   # unused everywhere


def test_communicator_setup_has_a_deadline(fake):
    """A member that never reaches its first CUDA collective leaves ncclCommInitRank waiting
    for ever: making the group fails with DistTimeoutError at the group's timeout (1 s) instead
    of hanging, and the communicator NCCL makes once the member comes is destroyed."""
    result = _run(fake, """
        fake.fake_set_init_blocks(1)
        started = time.monotonic()
        failure = error(lambda: group(timeout=1.0))
        elapsed = time.monotonic() - started
        fake.fake_set_init_blocks(0)
        time.sleep(0.2)                 # the abandoned setup finishes and cleans up
        print(json.dumps({"failure": failure, "elapsed": elapsed,
                          "destroys": fake.fake_destroys()}))
    """)
    assert result["failure"][0] == "DistTimeoutError", result
    assert "was not set up within 1.0 s" in result["failure"][1], result
    assert 0.9 <= result["elapsed"] < 3.0, result
    assert result["destroys"] == 1, result


def test_collective_order_is_checked_on_the_device(fake):
    """Each collective is preceded by an all-gather of what every rank issued; when the
    gathered records disagree (here the fake changes a byte of one) the collective fails with
    CollectiveMismatchError naming both sides, and the group with it (the check runs on the
    progress thread)."""
    result = _run(fake, """
        g = group(timeout=5.0)
        x = torch.ones(4)
        f32 = dtype_code(torch.float32)
        g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, None).synchronize()
        fake.fake_set_corrupt_gather(1)
        w = g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, None)
        failure = error(lambda: w.synchronize())
        later = error(lambda: g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, None).synchronize())
        print(json.dumps({"failure": failure, "later": later}))
    """)
    assert result["failure"][0] == "CollectiveMismatchError", result
    message = result["failure"][1]
    assert "rank 0 issued all_reduce float32 SUM of 4 elements" in message, message
    assert "(collective #1 of the stream)" in message, message
    assert result["later"][0] == "CollectiveMismatchError", result


def test_gather_pieces_are_in_the_device_order_check(fake):
    """A several-output all-gather's record carries the digest of its pieces ([Note: collective
    order on the device] in csrc/nccl.c): where the gathered one differs (here the fake changes
    its first byte), the collective fails with CollectiveMismatchError naming the digests, while
    the same gather with the records intact completes.  An all-gather's record names no reduce
    op (it named SUM, which it does not do).

    Old behaviour: the record held the total count only, so ranks that split the same count
    into other pieces passed the check and issued NCCL all-gathers of different counts (a hang,
    or elements gathered into the wrong outputs)."""
    result = _run(fake, """
        g = group(timeout=5.0)
        f32 = dtype_code(torch.float32)
        x = torch.arange(6.0)
        outputs = [torch.zeros(2), torch.zeros(4)]
        g.submit(OP_ALL_GATHER, f32, 0, x, outputs, 6, 0, 0, None).synchronize()
        gathered = [o.tolist() for o in outputs]
        fake.fake_set_corrupt_gather_at(32)      # the pieces digest of rank 0's record
        w = g.submit(OP_ALL_GATHER, f32, 0, x, outputs, 6, 0, 0, None)
        failure = error(lambda: w.synchronize())
        print(json.dumps({"gathered": gathered, "failure": failure}))
    """)
    assert result["gathered"] == [[0.0, 1.0], [2.0, 3.0, 4.0, 5.0]], result
    assert result["failure"][0] == "CollectiveMismatchError", result
    message = result["failure"][1]
    assert "rank 0 issued all_gather_into_tensor float32 of 6 elements" in message, message
    assert message.count("pieces digest 0x") == 2, message
    assert "(collective #1 of the stream)" in message, message


def test_a_peers_failure_ends_a_stuck_wait(fake):
    """Two ranks, each NCCL engine against the fake.  Rank 1 waits on a collective its device
    never finishes, with a 30 s timeout; rank 0 aborts the group after 0.5 s.  Rank 0's failure
    reaches rank 1 through the store (NCCL itself need not notice a peer that stopped), which
    aborts its communicator: rank 1 raises within a few seconds naming rank 0's reason, not at
    its deadline."""
    from tests._launch import run_ranks
    _, r1 = run_ranks("tests.workers_nccl:peer_abort", 2, args={"delay_s": 0.5},
                      env={"DPTC_NCCL_LIBRARY": fake, "DPTC_CUDART_LIBRARY": fake,
                           "DPTC_TIMEOUT": 30}, timeout=90)
    assert r1["error"] is not None, r1
    assert "rank 0 gave up on purpose" in r1["error"]["message"], r1
    assert r1["waited_s"] < 5.0, r1          # its deadline is 30 s away


def test_cuda_work_result_is_nccls(fake):
    """CudaWork.result() gives torch's NCCL Work.result() lists: [tensor] for all_reduce and
    broadcast, [output] for the all-gather (whole, where gloo's are per-rank pieces) and the
    reduce-scatter, [] for barrier; the engine's handle of a NCCL collective refuses
    get_future() and names CudaWork (its get_future() needs torch's CUDA streams: GPU only)."""
    result = _run(fake, """
        from dptc.collectives import CudaWork
        g = group()
        f32 = dtype_code(torch.float32)
        x, out = torch.arange(4.0), torch.zeros(4)
        gathered, scattered = torch.zeros(4), torch.zeros(4)
        works = {
            "all_reduce": (g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, None), x),
            "broadcast": (g.submit(OP_BROADCAST, f32, 0, out, out, 4, 0, 0, None), out),
            "all_gather": (g.submit(OP_ALL_GATHER, f32, 0, torch.ones(4), gathered, 4, 0, 0,
                                    None), gathered),
            "reduce_scatter": (g.submit(OP_REDUCE_SCATTER, f32, 0, torch.ones(4), scattered,
                                        4, 0, 0, None), scattered),
            "barrier": (g.submit(OP_BARRIER, f32, 0, None, None, 0, 0, 0, None), None),
        }
        found = {}
        for name, (w, tensor) in works.items():
            w.synchronize()
            listed = CudaWork(w, "cuda:0").result()
            found[name] = [len(listed), all(t is tensor for t in listed)]
        found["engine_get_future"] = error(works["all_reduce"][0].get_future)
        g.close()
        print(json.dumps(found))
    """)
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        assert result[name] == [1, True], (name, result)
    assert result["barrier"] == [0, True], result
    assert result["engine_get_future"][0] == "TypeError", result
    assert "CudaWork" in result["engine_get_future"][1], result


def test_every_thread_sets_its_device_before_using_the_runtime(fake):
    """The CUDA runtime makes device 0's context current for a thread that calls it without
    setting a device (hundreds of MiB on GPU 0 for every rank of a node): the progress threads
    that poll the completions, and every other thread dptc calls the runtime from, set the
    group's device first.  The fake counts runtime calls on threads that never set one."""
    result = _run(fake, """
        g = group(streams=2)
        f32 = dtype_code(torch.float32)
        x = torch.ones(64)
        for stream in (0, 1):
            for _ in range(3):
                g.submit(OP_ALL_REDUCE, f32, 0, x, x, 64, 0, stream, None).synchronize()
        fake.fake_set_hang(1)
        w = g.submit(OP_ALL_GATHER, f32, 0, x, torch.zeros(64), 64, 0, 1, None)
        time.sleep(0.1)                         # the progress thread polls a while
        fake.fake_set_hang(0)
        w.synchronize()
        g.close()
        # A group aborted from one fresh thread (a watcher) and closed from another.
        import threading
        def fresh_thread(call):
            thread = threading.Thread(target=call)
            thread.start()
            thread.join(30)
        other = group()
        other.submit(OP_ALL_REDUCE, f32, 0, x, x, 64, 0, 0, None).synchronize()
        fresh_thread(lambda: other.abort("the test gave up on purpose"))
        fresh_thread(other.close)
        print(json.dumps({"without_device": fake.fake_calls_without_device(),
                          "aborts": fake.fake_aborts()}))
    """)
    assert result["without_device"] == 0, result
    assert result["aborts"] == 1, result


def test_an_abort_fails_the_collectives_queued_behind(fake):
    """NCCL's abort ends the communicator's kernels early, so the events behind them complete:
    the collectives still queued when the group is aborted (on both streams) fail with the
    abort's reason, none of them reporting success with the outputs half written."""
    result = _run(fake, """
        g = group(timeout=30.0, streams=2)
        f32 = dtype_code(torch.float32)
        fake.fake_set_hang(1)
        works = [g.submit(OP_ALL_REDUCE, f32, 0, torch.ones(8), torch.ones(8), 8, 0, k % 2, None)
                 for k in range(5)]
        time.sleep(0.1)
        started = time.monotonic()
        g.abort("the test gave up on purpose")
        outcomes = [error(w.synchronize) for w in works]
        waited_s = time.monotonic() - started
        g.close()
        print(json.dumps({"outcomes": outcomes, "waited_s": waited_s}))
    """)
    for outcome in result["outcomes"]:
        assert outcome is not None, result           # None: reported as completed
        assert "the test gave up on purpose" in outcome[1], result
    assert result["waited_s"] < 5.0, result


def test_an_abort_ends_a_call_waiting_inside_nccl(fake):
    """A collective's NCCL call can wait inside NCCL for peers that never come to connect,
    holding the transport's lock (the communicator is blocking).  An abort from another thread
    (a peer's failure, a deadline) does not wait for it: within about a second it aborts the
    communicator under the call, which then fails, instead of both threads hanging; other
    Python threads run meanwhile."""
    result = _run(fake, """
        import threading
        g = group(timeout=30.0)
        f32 = dtype_code(torch.float32)
        x = torch.ones(8)
        outcome = {}
        def issue():
            outcome["error"] = error(lambda: g.submit(OP_ALL_REDUCE, f32, 0, x, x, 8, 0, 0,
                                                      None).synchronize())
        fake.fake_set_calls_block(1)
        issuer = threading.Thread(target=issue)
        issuer.start()
        time.sleep(0.3)                          # the issuer now waits inside the fake NCCL
        ticks, aborting = [0], [True]
        def tick():                              # another Python thread, during the abort
            while aborting[0]:
                time.sleep(0.01)
                ticks[0] += 1
        ticker = threading.Thread(target=tick)
        ticker.start()
        started = time.monotonic()
        g.abort("the test gave up on purpose")
        abort_s = time.monotonic() - started
        ticks_during_abort, aborting[0] = ticks[0], False
        ticker.join(10)
        issuer.join(10)
        fake.fake_set_calls_block(0)
        print(json.dumps({"abort_s": abort_s, "issuer_done": not issuer.is_alive(),
                          "error": outcome.get("error"), "aborts": fake.fake_aborts(),
                          "ticks_during_abort": ticks_during_abort}))
        if not issuer.is_alive():
            g.close()
    """)
    assert result["issuer_done"], result
    assert result["abort_s"] < 3.0, result
    # The abort lets go of the GIL while it waits (it froze every other thread for 1 s).
    assert result["ticks_during_abort"] >= 10, result
    assert result["aborts"] == 1, result
    assert result["error"] is not None, result
    assert "the test gave up on purpose" in result["error"][1], result


def test_completion_events_wait_for_their_slot_without_the_order_check(fake):
    """Each stream keeps 64 completion events in a ring.  With the order check left out
    (DPTC_NCCL_CHECK_ORDER=0) a 65th collective behind 64 unfinished ones still waits for its
    slot (here until the group's 1.5 s deadline, then DistTimeoutError) instead of being
    issued at once onto the first one's event, which it re-recorded: the first collective
    then waited for the 65th."""
    result = _run(fake, """
        os.environ["DPTC_NCCL_CHECK_ORDER"] = "0"
        g = group(timeout=1.5)
        f32 = dtype_code(torch.float32)
        x = torch.ones(4)
        fake.fake_set_hang(1)
        works = [g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, None) for _ in range(64)]
        started = time.monotonic()
        late = g.submit(OP_ALL_REDUCE, f32, 0, x, x, 4, 0, 0, None)
        issue_s = time.monotonic() - started
        failure = error(late.synchronize)
        fake.fake_set_hang(0)
        g.close()
        print(json.dumps({"issue_s": issue_s, "failure": failure}))
    """)
    assert result["issue_s"] >= 1.0, result       # issued at once onto a slot in use
    assert result["failure"][0] == "DistTimeoutError", result


def test_a_device_unit_waits_on_the_current_stream_and_lets_go_of_its_buffers(fake):
    """fully_shard's unit waits for a gather with two streams: the one it was issued after
    (where its buffers were allocated) and the one current when it waits (a backward run
    under a side stream issues on autograd's streams and finishes on the side stream, which
    then reads the results).  Then it lets go of the gather's tensors at once, with the
    device still running (the issuing stream has waited, so torch's allocator hands the
    memory to later work only), instead of holding them until the host sees completion."""
    result = _run(fake, """
        import weakref
        g = group(streams=2)
        current = {"stream": 77}
        unit = _C.Unit(g, 1, gather_stream=0, reduce_stream=1,
                       current_stream=lambda: Stream(current["stream"]))
        source, out = torch.arange(8.0), torch.zeros(8)
        source_alive = weakref.ref(source)
        fake.fake_set_hang(1)
        unit.unshard(dtype_code(torch.float32), source, [out], 8)
        current["stream"] = 88                    # the side stream the script made current
        unit.wait_unshard()
        del source
        waited = [fake.fake_waited_stream(k) for k in range(4)]
        alive = source_alive() is not None
        fake.fake_set_hang(0)
        g.close()
        print(json.dumps({"waited": waited, "alive": alive}))
    """)
    assert 77 in result["waited"] and 88 in result["waited"], result
    assert not result["alive"], result       # kept until the host saw the gather complete


def test_result_of_a_staged_cuda_collective_writes_back_after_it():
    """A collective on a non-contiguous CUDA tensor runs on a contiguous copy that result()
    writes back into the caller's tensor.  A CUDA work's result() does not wait, so result()
    first makes the current stream wait for the collective (Work.wait()), then copies; it
    copied the staged values before the collective had written them, and never again."""
    from types import SimpleNamespace

    from dptc.collectives import _WrittenBack
    calls = []
    staged = object()
    work = SimpleNamespace(wait=lambda: calls.append("wait"), result=lambda: [staged])
    target = SimpleNamespace(is_cuda=True, copy_=lambda source: calls.append("copy"))
    values = _WrittenBack(work, target, staged).result()
    assert calls == ["wait", "copy"], calls
    assert values == [target], values
