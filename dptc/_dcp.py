"""dptc's wrappers as torch.distributed.checkpoint's state-dict helpers see them.

[Note: wrappers in torch.distributed.checkpoint]
torch.distributed.checkpoint.state_dict (get_state_dict, get_model_state_dict, set_state_dict,
...) names a wrapped model's parameters by their names in the unwrapped model, for the model's
state and for the optimizer's: its _get_fqns steps over DDP's "module." and FSDP1's
"_fsdp_wrapped_module." wherever ``isinstance(obj, DDP)`` or ``isinstance(obj, FSDP)``, DDP and
FSDP being torch's classes, bound to those names at the top of the module.  dptc's wrappers
are not torch's classes, so there the prefixes would stay: a checkpoint saved under one
wrapper would not load under the other, nor into the unwrapped model.

So dptc binds each name to a stand-in class for which isinstance holds for torch's class and
dptc's alike, and whose other attributes are torch's class's, except the methods dptc's class
names.  Those the module calls with a model first (``FSDP.fsdp_modules``,
``FSDP.state_dict_type``, ``FSDP.optim_state_dict``, ``FSDP.optim_state_dict_to_load``), and
for a model that holds dptc's instances the stand-in runs dptc's own.  So for a dptc FSDP1
model the helpers do what they do for torch's: they find its instances, switch them to
SHARDED_STATE_DICT (or FULL_STATE_DICT with ``full_state_dict=True``) around the model's
state_dict() and load_state_dict(), and let the wrapper key the optimizer's state.  The module
also checks every instance it found with its own function
``_get_module_fsdp_state_if_fully_sharded_module``, which dptc rebinds too.  dptc's own
optimizer state-dict methods call the helpers in turn; inside them (``torch_methods()``) the
stand-in's methods are torch's, which find no instance, so the helpers take the plain path and
do not call back.

The module takes about 2 s to import, so dptc does not import it: where it is already
imported, the names are rebound at once, else a finder on sys.meta_path rebinds them right
after the module's first import and then leaves sys.meta_path.
"""

import contextlib
import contextvars
import functools
import importlib.abc
import importlib.util
import sys

from torch import nn

__all__ = ["recognise", "torch_methods"]

_MODULE = "torch.distributed.checkpoint.state_dict"
# For the finder: name in that module -> (dptc's class, its methods); function name -> makes
# the replacement from the original.
_pending = {}
_pending_functions = {}
_torch_methods = contextvars.ContextVar("dptc_dcp_torch_methods", default=False)


def recognise(cls, name, methods=(), functions=None):
    """Makes torch.distributed.checkpoint's state-dict helpers treat ``cls`` as the class they
    know as ``name`` ("DDP" or "FSDP").  methods: names of static methods the helpers call on
    that class with a model (or module=) first, which run cls's own for a model holding
    instances of cls.  functions: {name of a function in that module: a function taking the
    original and returning its replacement}."""
    functions = functions or {}
    module = sys.modules.get(_MODULE)
    if module is not None:
        _rebind(module, name, cls, methods)
        for function, replace in functions.items():
            _replace(module, function, replace)
        return
    _pending[name] = (cls, tuple(methods))
    _pending_functions.update(functions)
    if not any(isinstance(finder, _RebindAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RebindAfterImport())


@contextlib.contextmanager
def torch_methods():
    """Within the context the stand-ins' methods are torch's class's, for every model: dptc's
    own methods call the helpers, which must not call them back."""
    token = _torch_methods.set(True)
    try:
        yield
    finally:
        _torch_methods.reset(token)


class _EitherMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.classes)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, cls.classes)

    def __getattr__(cls, name):
        owner = cls.methods.get(name)
        if owner is None:
            return getattr(cls.classes[0], name)
        return functools.partial(_dispatch, cls.classes[0], owner, name)


def _dispatch(theirs, ours, name, *args, **kwargs):
    model = args[0] if args else kwargs.get("module", kwargs.get("model"))
    holds = (not _torch_methods.get() and isinstance(model, nn.Module)
             and any(isinstance(m, ours) for m in model.modules()))
    return getattr(ours if holds else theirs, name)(*args, **kwargs)


def _rebind(module, name, cls, methods):
    current = getattr(module, name, None)
    if not isinstance(current, type):
        return  # another torch, without that name: nothing to extend
    if isinstance(current, _EitherMeta):
        if cls not in current.classes:
            current.classes += (cls,)
            current.methods.update(dict.fromkeys(methods, cls))
        return
    setattr(module, name, _EitherMeta(current.__name__, (), {
        "classes": (current, cls), "methods": dict.fromkeys(methods, cls),
        "__module__": current.__module__, "__doc__": current.__doc__}))


def _replace(module, name, replace):
    original = getattr(module, name, None)
    if callable(original) and not getattr(original, "_dptc_replacement", False):
        replacement = replace(original)
        replacement._dptc_replacement = True
        setattr(module, name, replacement)


class _RebindAfterImport(importlib.abc.MetaPathFinder):
    """Finds the module as the finders after it would, and rebinds the names once it ran.  A
    find without an import (importlib.util.find_spec probing) leaves it in place."""

    def __init__(self):
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for attribute, (cls, methods) in _pending.items():
                _rebind(module, attribute, cls, methods)
            for function, replace in _pending_functions.items():
                _replace(module, function, replace)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec.loader.exec_module = exec_module
        return spec
