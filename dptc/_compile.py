"""dptc's wrappers under torch.compile.

[Note: torch.compile]
Dynamo traces what a compiled module runs: the forward hooks fully_shard registers, and, when
the wrapper itself is compiled (``torch.compile(DDP(model))``), the wrapper's forward.  dptc's
bookkeeping there is no tensor compute: it calls the C engine (each call a graph break), runs
collectives, and reads Python state that changes from step to step (each change a failed guard
and a recompilation).  So that code runs outside dynamo (``eager``): the graph breaks once where
it is called, and dynamo traces only the user's module, as torch's fully_shard does with its
hooks.  Outside a compilation the function is called directly: no import of torch._dynamo (1.5
s) in a process that never compiles, no cost per call.

fully_shard's forward hooks go further (``hook``): torch calls them, and where the module's own
call is compiled (``block.compile()`` before fully_shard, ``model.compile()`` or
``torch.compile(model)`` after it) dynamo skips nn.Module's ``_call_impl`` frame but meets every
frame the hook opens.  A hook wrapped by ``eager`` opens one of dptc's, which dynamo then
traces as a frame of its own: it breaks at once (an error under ``fullgraph=True``), and is
traced again for every new kind of call (dtype, shape, argument types: a RecompileError under
``torch._dynamo.config.error_on_recompile``).  torch's fully_shard hooks open a frame in
torch's own files, which dynamo skips, and run under ``torch._dynamo.disable``.  So do
``hook``'s: the hook is torch's lazy disable itself, whose frame lives in torch/_compile.py,
and no dptc frame stands in front of it.  It costs about 1 us a call more than ``eager``
(1.5 against 0.46 us here), and imports torch._dynamo at its first call, which fully_shard's
DTensors have imported by then anyway.  fully_shard's backward hooks (pre-backward, the
post-accumulate-grad hook of each parameter, the root's end-of-backward callback) are ``hook``s
too: a training step compiled whole (forward, loss and ``backward()`` in one compiled function)
runs backward with dynamo's frame callback set, so dynamo meets every frame autograd opens;
torch's fully_shard disables its backward hooks alike.  Those cost 1.4 us a parameter a step
over a plain closure (1.5 against 0.13 us).

DDP's forward also names itself torch's active DDP module while the wrapped module runs
(``active_ddp_module``), so that dynamo's DDPOptimizer splits a compiled forward at DDP's bucket
boundaries as it does for torch's DDP: each piece's backward then leaves its gradients before
the earlier pieces' backward runs, so buckets become ready during backward instead of all at
its end, and the compiled graphs, hence the numbers, are torch DDP's.
"""

import contextlib
import functools

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

__all__ = ["eager", "hook", "active_ddp_module"]


def eager(function):
    """``function`` run outside dynamo's tracing (see [Note: torch.compile])."""
    # torch's own lazy disable: dynamo skips its file, so tracing breaks the graph once at
    # this call, and it imports torch._dynamo only when first called.
    disabled = torch._disable_dynamo(function, recursive=True)

    @functools.wraps(function)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return function(*args, **kwargs)
    return call


def hook(function):
    """``function``, a hook torch calls, as a callable whose frames dynamo neither traces nor
    compiles, as torch's fully_shard wraps its hooks (see [Note: torch.compile])."""
    return torch._disable_dynamo(function, recursive=True)


@contextlib.contextmanager
def active_ddp_module(ddp):
    """Marks ``ddp`` as torch's active DDP module while its module runs (see [Note:
    torch.compile]); dynamo reads it through ``DistributedDataParallel._get_active_ddp_module``
    (only ``bucket_bytes_cap`` of it), as torch's own composable ``replicate`` sets it."""
    if ddp.bucket_bytes_cap < torch.distributed._DEFAULT_FIRST_BUCKET_BYTES:
        # DDPOptimizer refuses a bucket cap below its first bucket's (1 MiB), which fails
        # torch's own compiled DDP there; dptc's forward is then compiled whole instead.
        yield
        return
    previous = _TorchDDP._active_ddp_module
    _TorchDDP._active_ddp_module = ddp
    try:
        yield
    finally:
        _TorchDDP._active_ddp_module = previous
