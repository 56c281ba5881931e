"""The hooks of a fully_shard module and the root's per-iteration bookkeeping.

Each fully_shard module has one State.  Its hooks are thin: they call the unit's transitions
(dptc/fsdp/_unit.py over csrc/unit.c) in the order below.

[Note: one training step]
- Root pre-forward (first forward only): the root is the first fully_shard module whose forward
  runs; it adopts parameters replaced since fully_shard (``to_empty``) and learns its subtree.
- Pre-forward: unshard this unit (waiting for a prefetch if one was started), then start
  gathering the next unit in forward order (or the explicit forward-prefetch list), so the
  gather overlaps this unit's compute.  Inputs are cast to ``param_dtype``.
- Post-forward: reshard unless ``reshard_after_forward`` is False (the root's default; an int
  reshards to a smaller group, see [Note: resharding to a smaller group] in _unit.py), and hook
  the outputs so the first gradient reaching them runs pre-backward.
- Pre-backward: unshard this unit again and prefetch the unit that ran forward before it (or
  the explicit backward-prefetch list; FSDP1's BACKWARD_POST moves this prefetch to
  post-backward); the first one also queues the root's end-of-backward callback on the
  autograd engine.
- Post-backward: each unsharded parameter's post-accumulate-grad hook marks its gradient
  complete; the unit's last one reshards it and starts the reduce-scatter on the reduce
  stream, which runs while autograd computes earlier units.  At most two reductions are in
  flight: starting a third finishes the oldest (accumulates it into the sharded gradients and
  frees its input), so a backward holds two units' reduce inputs, not the whole model's.
- End of backward (root callback): reduce any unit whose hooks did not all fire (unused
  parameters), wait for every reduction, accumulate the results into the sharded ``.grad``
  DTensors, reshard what is still unsharded.
"""

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import _global_backward_hooks
from torch.utils._pytree import tree_flatten, tree_map

from .._compile import hook
from .._ranges import Range
from ..group import _env_flag
from ._unit import ReduceRing

__all__ = []


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


class State:
    def __init__(self, modules, unit, mp_policy, reshard_after_forward):
        self.modules = modules                 # fully_shard([a, b]) makes one unit of several
        self.module = modules[0]
        # Of self.modules, those whose forward has not run yet in this forward of the group:
        # see [Note: a unit of several modules].
        self.modules_to_run = set()
        self.unit = unit                       # None when the module manages no parameters
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward   # None: decided at lazy init
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        # set_reduce_scatter_unused_params: see [Note: unused parameters in a unit].
        self.reduce_scatter_unused_params = False
        self.requires_all_reduce = True
        self.unshard_in_backward = True
        self.forward_prefetch = None           # explicit lists of States, or None
        self.backward_prefetch = None
        self.prefetch_after_backward = False   # FSDP1's BackwardPrefetch.BACKWARD_POST
        self.backward_started = False          # this iteration's pre-backward has run
        # See [Note: frozen parameters in backward].
        self.inputs_pending = 0                # forward inputs whose gradients are to come
        self.reshard_deferred = False          # post-backward left the reshard to them
        # See [Note: module backward hooks].
        self.owned = None                      # modules of this unit, not of an inner one
        self.hooks_in_backward = False         # some had backward hooks at this forward
        self.post_backward_deferred = False    # post-backward waits for the inputs
        self.root = None                       # the root State, once lazily initialised
        # Root only: the States of its subtree and this iteration's bookkeeping.
        self.states = []
        self.forward_order = []                # States by first pre-forward
        self.post_forward_order = []           # this iteration's post-forwards
        self.reducing = []                     # States whose reductions are in flight
        self.rings = {}                        # (group id, dtype) -> ReduceRing
        self.rings_stale = False               # a unit changed dtype: remake them
        self.post_optim_event = None           # set_post_optim_event's, until the next forward
        self.callback_queued = False
        self.in_backward = False               # a forward now is a recomputation
        self.is_last_backward = True
        # FullyShardedDataParallel's checks before a root forward (see _fsdp1.py), or None.
        self.root_forward_check = None
        self.handles = []
        if unit is not None:
            unit.grad_hooks(self._post_backward)
            unit.set_label(",".join(type(m).__name__ for m in modules))  # until lazy_init
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(
                self._pre_forward, prepend=True, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_forward))
        if unit is not None:
            holders = {id(m): m for p in unit.params for m, _ in p.locations}
            for holder in holders.values():
                self.handles.append(holder.register_state_dict_pre_hook(self._to_sharded))
                self.handles.append(holder.register_load_state_dict_pre_hook(self._to_sharded))

    # [Note: state dicts of an unsharded unit]
    # A unit stays unsharded after forward where it does not reshard (the root by default,
    # so after every evaluation forward under no_grad, which has no backward to reshard it),
    # and its modules then hold the plain unsharded parameters.  state_dict() would return
    # those instead of the DTensor shards (get_model_state_dict and dcp.save too), and
    # load_state_dict() would write into storage the next gather overwrites.  So, as torch's
    # fully_shard does, saving or loading the state of a module that holds a unit's
    # parameters reshards the unit first; its next forward or backward gathers again.

    def _to_sharded(self, *_hook_args):
        if self.unit.state != "sharded":
            self.unit.reshard()

    # -- lazy initialisation ------------------------------------------------------------------

    def lazy_init(self):
        if self.root is not None:
            return
        self.root = self
        names = _range_names(self.modules)
        self._check_materialized(names)
        for module in names:
            state = module.__dict__.get("_dptc_fsdp_state")
            if state is None or state.root is not None and state is not self:
                continue
            if state in self.states:
                continue
            state.root = self
            self.states.append(state)
            if state.reshard_after_forward is None:
                state.reshard_after_forward = state is not self
            if state.unit is not None:
                state.unit.reset_sharded()
                state.unit.set_label(",".join(names.get(m, type(m).__name__)
                                              for m in state.modules))
        self._make_rings()

    def _check_materialized(self, names):
        """Raises, as torch's fully_shard does, when parameters made on the meta device are
        still there at the first forward."""
        left = []
        for module in names:
            state = module.__dict__.get("_dptc_fsdp_state")
            if state is not None and state.unit is not None and state.module is module:
                left += state.unit.meta_params(names)
        if left:
            self.root = None
            raise RuntimeError(
                f"fully_shard's parameters must be materialized from the meta device before "
                f"training, but these are still there: {left}; call model.to_empty("
                f"device='cpu') (or the CUDA device) after fully_shard, then initialize the "
                f"values (e.g. reset_parameters() on each module) under torch.no_grad()")

    # -- forward ------------------------------------------------------------------------------

    @hook  # see [Note: torch.compile] in dptc/_compile.py
    def _pre_forward(self, module, args, kwargs):
        if self.root_forward_check is not None and self.root in (None, self):
            self.root_forward_check()
        self.lazy_init()
        root = self.root
        starts_pass = not self.modules_to_run
        if starts_pass:
            self.modules_to_run.update(self.modules)
        if root is self:
            root.post_forward_order = []
            if root.rings_stale:
                root.rings_stale = False
                root._make_rings()
            event, root.post_optim_event = root.post_optim_event, None
            if event is not None and _on_cuda(event):
                event.wait()                   # see FSDPModule.set_post_optim_event
        if self not in root.forward_order:
            root.forward_order.append(self)
        if self.unit is not None:
            self.unit.unshard(root.in_backward)
            self.unit.wait_unshard()
            if not root.in_backward:
                self.unit.reset_ready()
        for state in self._next_in_forward():
            if state.unit is not None:
                state.unit.unshard(root.in_backward)
        policy = self.mp_policy
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            args, kwargs = tree_map(lambda v: _cast(v, policy.param_dtype), (args, kwargs))
        if self.unit is not None and not root.in_backward and torch.is_grad_enabled():
            self.hooks_in_backward = self._has_backward_hooks()
            if self.hooks_in_backward or self.unit.has_frozen_params():
                self._hook_inputs(args, kwargs)
            if starts_pass and len(self.modules) > 1:
                self._hook_pass_inputs(args, kwargs)
        return args, kwargs

    # [Note: module backward hooks]
    # torch's fully_shard reduces and reshards a unit once the gradients of its forward
    # inputs are computed, so a full backward hook on one of the unit's modules
    # (register_full_backward_hook; it runs as the gradients reach that module's inputs)
    # sees the unsharded parameters and this rank's unreduced gradients in their .grad.
    # dptc's post-backward runs earlier, when the unit's last gradient is accumulated, and
    # the hook would see the DTensor shards and no gradient.  So while a module of the unit
    # has backward hooks, forward hooks the unit's inputs as for frozen parameters, and
    # post-backward (reduction and reshard) waits until their gradients are complete: the
    # module hooks have run by then, as under torch.  Without such hooks the reduction
    # starts as soon as the gradients are complete, overlapping more of backward.

    def _has_backward_hooks(self):
        if _global_backward_hooks:
            return True
        if self.owned is None:
            owned, pending = [], list(self.modules)
            while pending:
                module = pending.pop()
                owned.append(module)
                pending.extend(child for child in module.children()
                               if child.__dict__.get("_dptc_fsdp_state") is None)
            self.owned = owned
        return any(module._backward_hooks for module in self.owned)

    # [Note: frozen parameters in backward]
    # A unit's post-backward runs when the last of its parameters' gradients is complete,
    # and reshards it.  A frozen parameter has no gradient to wait for, yet backward may
    # still need its value after the others' are complete: a frozen LayerNorm ahead of a
    # trainable Linear computes its input's gradient from its weight once the Linear's
    # gradients are done.  So while a unit has frozen parameters, forward hooks its
    # inputs that require grad (after the param_dtype cast), and post-backward reshards
    # only once their gradients are complete too, that is once backward is done with the
    # unit; the reduction still starts at post-backward.  Inputs that do not require grad
    # need nothing of the unit beyond its own parameters' gradients; a backward that never
    # reaches the inputs leaves the reshard to the end of backward.

    def _hook_inputs(self, args, kwargs):
        tensors = [t for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            self.inputs_pending += 1
            register_multi_grad_hook(tensors, self._inputs_done, mode="all")

    @hook
    def _inputs_done(self, _grads):
        self.inputs_pending = max(0, self.inputs_pending - 1)
        if self.inputs_pending == 0 and self.post_backward_deferred:
            self.post_backward_deferred = False
            self._post_backward(self.unit)
        elif self.inputs_pending == 0 and self.reshard_deferred:
            self.reshard_deferred = False
            self.unit.reshard()

    def _hook_pass_inputs(self, args, kwargs):
        """A unit of several modules: its post-backward also runs once the gradients of the
        inputs of the pass's first module are complete, as torch's fully_shard runs it (see
        [Note: a unit of several modules])."""
        tensors = [t for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, self._pass_done, mode="all")

    @hook
    def _pass_done(self, _grads):
        if self.unit.has_unsharded_grads():
            self._post_backward(self.unit, reshard=False)

    def _next_in_forward(self):
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order = self.root.forward_order
        index = order.index(self)
        return order[index + 1:index + 2] if index + 1 < len(order) else []

    # [Note: a unit of several modules]
    # fully_shard([a, b]) makes one unit of several modules, and a forward need not run all of
    # them: torchtitan's chunked loss runs the model up to its final norm (the unit
    # [norm, lm_head]), then calls lm_head on each chunk of the detached hidden states, each
    # with a backward of its own, then backpropagates through the norm.  As torch's
    # fully_shard does, the group's post-forward (reshard, and the hook that makes the first
    # gradient run pre-backward) runs once every module of the group has run forward; a
    # module's forward on its own (a chunk through lm_head) only casts its output.  A group
    # whose forward did not complete by the end of the root's forward is completed there,
    # and its pre-backward hook is put on the root's output: the backward through the
    # model's forward gathers the unit again before autograd reads the parameters the norm
    # saved, whatever the loss did to the unit meanwhile (an explicit reshard() frees their
    # storage: see [Note: freed unsharded storage] in _unit.py).  The end of backward starts
    # every group afresh.
    #
    # A chunk's backward completes only some of the unit's gradients (the head's, not the
    # norm's), so the unit's last gradient never marks it complete there.  As under torch's
    # fully_shard, whose post-backward follows the inputs of a forward pass, the first module
    # of each pass of such a unit hooks its inputs, and once their gradients are complete the
    # unit's post-backward runs on the gradients it has: without gradient sync it moves them
    # into their reduce-dtype accumulators (a bf16 head's chunks then add up in fp32, as
    # torch's do), with it it reduces them.  It leaves the reshard to the unit's last
    # gradient or the end of backward: another pass of the unit in the same graph (the model's
    # norm, below a head called on its output) may still read the parameters.  A unit reduced
    # twice in one backward (the head's gradients by the last chunk, the norm's later)
    # finishes the first reduction before starting the second.

    @hook
    def _post_forward(self, module, args, output):
        if module not in self.modules_to_run:
            return self._cast_output(output)        # a module of the group on its own again
        self.modules_to_run.discard(module)
        if self.modules_to_run:
            return self._cast_output(output)        # the rest of the group is still to run
        output = self._finish_forward(output)
        root = self.root
        if root is self:
            # See [Note: a unit of several modules]; innermost first, as torch casts them.
            for state in reversed(root.states):
                if state is not self and state.modules_to_run:
                    state.modules_to_run.clear()
                    output = state._finish_forward(output)
        return output

    def _finish_forward(self, output):
        """The group's post-forward: reshard (as reshard_after_forward says), cast the output
        and hook it so that the first gradient reaching it runs pre-backward."""
        root = self.root
        root.post_forward_order.append(self)
        if self.unit is not None and self.reshard_after_forward and not root.in_backward:
            if self.unit.post_forward_group is not None:
                self.unit.reshard_to_smaller_group()
            else:
                self.unit.reshard()
        output = self._cast_output(output)
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        return output

    def _cast_output(self, output):
        if self.mp_policy.output_dtype is not None:
            output = tree_map(lambda v: _cast(v, self.mp_policy.output_dtype), output)
        return output

    def _shared_input(self, dtype):
        ring = self.root.rings.get((id(self.unit.group), dtype))
        return None if ring is None else ring.take(self, self.root._finish)

    def _finish(self, state):
        """Root: waits for `state`'s reductions and accumulates them into its gradients."""
        if state in self.reducing:
            self.reducing.remove(state)
        state.unit.finish_reduce(state.requires_all_reduce)

    def _make_rings(self):
        """Root, at lazy init: the rings of [Note: reduce inputs in shared memory], for the
        shard groups on one node.  Every rank makes them in the same order (a collective)."""
        sizes = {}
        # Both read on every rank and every root, whatever the groups: a mistyped value is an
        # error even where it would change nothing.
        release = _env_flag("DPTC_FSDP_RELEASE_REDUCE_BUFFERS", False)
        if not _env_flag("DPTC_FSDP_SHARED_REDUCE", True):  # staged, for comparison
            self.rings = {}
            return
        for state in self.states:
            unit = state.unit
            if unit is None or not unit.on_one_cpu_node:
                continue
            for dtype, nbytes in unit.reduce_input_bytes().items():
                key = (id(unit.group), dtype)
                sizes[key] = (unit.group, max(sizes.get(key, (None, 0))[1], nbytes))
        # In the order the units come in the module tree, the same on every rank.
        self.rings = {key: ReduceRing(group, nbytes, release)
                      for key, (group, nbytes) in sizes.items()}

    # -- backward -----------------------------------------------------------------------------

    @hook
    def _pre_backward(self, _grad):
        root = self.root
        if not root.callback_queued:
            root.callback_queued = True
            root.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(root._end_of_backward)
        self.backward_started = True
        if self.unit is not None:
            self.unit.reclaim_unsynced()   # see [Note: FSDP1's gradients without sync]
            if self.unit.state == "sharded" and not self.unshard_in_backward:
                return
            self.unit.unshard(in_backward=True)
            self.unit.wait_unshard()
        if not self.prefetch_after_backward:
            self._prefetch_backward()

    def _prefetch_backward(self):
        for state in self._next_in_backward():
            if state.unit is not None and state.unshard_in_backward and \
                    not state.backward_started:
                state.unit.unshard(in_backward=True)
    def _next_in_backward(self):
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.root.post_forward_order
        if self not in order:
            return []
        index = order.index(self)
        return order[index - 1:index] if index > 0 else []

    # [Note: memory at the reduction]
    # A unit's post-backward is where its backward's memory peaks: its gradients are complete
    # and the reduce-scatter's input (the gradients laid out by rank, in the reduce dtype) and
    # output (this rank's piece) are made.  As torch's fully_shard does, the unit reshards
    # first, so its unsharded parameters are freed before the input is laid out, and the
    # gradients are dropped once laid out, before the output is allocated; FSDP1's
    # BACKWARD_POST prefetch gathers the next unit after the reshard too.  Held together
    # instead, they added the unit's unsharded parameters and its gradients to the peak: in
    # benchmarks/fsdp_step.py a block's 3 MiB of parameters at each block's reduction, the
    # step's peak (43.0 MiB of live tensors, the shared reduce ring counted; 42.2 now); in
    # test_fsdp.py's test_memory_at_the_reduction 3.0 unsharded sizes of rise with the input
    # staged, 1.5 now.

    def _post_backward(self, unit, reshard=True):
        if self.hooks_in_backward and self.inputs_pending:
            self.post_backward_deferred = True  # see [Note: module backward hooks]
            return
        if self.reduce_scatter_unused_params:
            if self.prefetch_after_backward:
                self._prefetch_backward()
            return   # reduced at the end of backward, with the others' order
        # Resharded before the prefetch and the reduction, as torch's fully_shard and FSDP1
        # do: see [Note: memory at the reduction].
        if self.reshard_after_backward and reshard:
            if self.inputs_pending:
                self.reshard_deferred = True   # see [Note: frozen parameters in backward]
            else:
                unit.reshard()
        if self.prefetch_after_backward and reshard:
            self._prefetch_backward()
        if self.requires_gradient_sync:
            # One reduction in flight besides this one: the older one's input (a unit's
            # gradients) is released now, not at the end of backward.
            root = self.root
            if self in root.reducing:   # reduced before in this backward: a unit of several
                root._finish(self)      # modules, see [Note: a unit of several modules]
            while len(root.reducing) > 1:
                root._finish(root.reducing[0])
            unit.reduce(self.requires_all_reduce, self._shared_input)
            root.reducing.append(self)
        if not self.requires_gradient_sync:
            unit.accumulate_unsynced()

    @hook
    def _end_of_backward(self):
        """The root's callback, after autograd's last node (see [Note: one training step])."""
        with Range("dptc::fsdp finalize"):
            self._finish_backward()

    def _finish_backward(self):
        self.callback_queued = False
        in_flight, self.reducing = self.reducing, []
        try:
            # In the order the reductions started, as torch runs set_all_reduce_hook's hooks.
            for state in in_flight:
                state.unit.finish_reduce(state.requires_all_reduce)
            for state in self.states:
                state.backward_started = False
                state.modules_to_run.clear()      # see [Note: a unit of several modules]
                state.inputs_pending, state.reshard_deferred = 0, False
                state.post_backward_deferred = False
                unit = state.unit
                if unit is None:
                    continue
                unused = state.reduce_scatter_unused_params
                unit.reclaim_unsynced()    # see [Note: FSDP1's gradients without sync]
                if state.reshard_after_backward:   # first, see [Note: memory at the reduction]
                    unit.reshard()
                if state.requires_gradient_sync and (unused or unit.has_unsharded_grads()):
                    unit.reduce(state.requires_all_reduce, unused=unused)
                elif not state.requires_gradient_sync:
                    unit.accumulate_unsynced()
                unit.finish_reduce(state.requires_all_reduce)
        finally:
            self.in_backward = False
            for ring in self.rings.values():
                ring.end_backward()

    def reset_iter_state(self):
        self.callback_queued = False
        self.reducing = []
        for ring in self.rings.values():
            ring.owners = [None, None]
        self.in_backward = False
        self.post_forward_order = []
        for state in self.states:
            state.backward_started = False
            state.modules_to_run.clear()
            state.inputs_pending, state.reshard_deferred = 0, False
            state.post_backward_deferred = False
            if state.unit is not None:
                for bucket in state.unit.buckets:
                    try:
                        bucket.c.wait_reduce()
                    except Exception:  # the failed iteration's gradients are discarded
                        pass
                    bucket.reduce_output = bucket.reduce_had_grad = None
                    bucket.reduce_offsets = None
                    bucket.partial = bucket.partial_had = None
                state.unit.reshard()
                state.unit.reset_ready()


# Wrappers whose attribute names appear in qualified names but not in the user's model.
_WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _range_names(tops):
    """{module: its name in profiler ranges} over the root's subtree, in module order: the
    qualified name from the root without FSDP1's and activation checkpointing's wrapper
    attributes (``blocks.2``), and ``root`` for the root itself (see [Note: profiler ranges] in
    dptc/_ranges.py)."""
    names = {}
    for top in tops:
        for name, module in top.named_modules():
            if module not in names:
                parts = [part for part in name.split(".") if part and part not in _WRAPPER_NAMES]
                names[module] = ".".join(parts) or "root"
    return names


def _on_cuda(event):
    """Whether a set_post_optim_event event is a CUDA one (its wait() orders the current
    stream after it); a CPU event orders nothing."""
    if isinstance(event, torch.cuda.Event):
        return True
    device = getattr(event, "device", None)
    return getattr(device, "type", None) == "cuda"
