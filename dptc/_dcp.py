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
dptc's alike, and whose other attributes are torch's class's (the module also calls
``FSDP.fsdp_modules``, ``FSDP.state_dict_type`` and ``FSDP.optim_state_dict``; those still
find torch's FSDP1 modules only, so a dptc FSDP1 model's own state dict comes in the
state_dict_type it is set to, FULL unless changed).  The module takes about 2 s to import, so
dptc does not import it: where it is already imported, the names are rebound at once, else a
finder on sys.meta_path rebinds them right after the module's first import and then leaves
sys.meta_path.
"""

import importlib.abc
import importlib.util
import sys

__all__ = ["recognise"]

_MODULE = "torch.distributed.checkpoint.state_dict"
_pending = {}  # name in that module -> dptc's class, for the finder


def recognise(cls, name):
    """Makes torch.distributed.checkpoint's state-dict helpers treat ``cls`` as the class they
    know as ``name`` ("DDP" or "FSDP")."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        _rebind(module, name, cls)
        return
    _pending[name] = cls
    if not any(isinstance(finder, _RebindAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RebindAfterImport())


class _EitherMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.classes)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, cls.classes)

    def __getattr__(cls, name):
        return getattr(cls.classes[0], name)


def _rebind(module, name, cls):
    current = getattr(module, name, None)
    if not isinstance(current, type):
        return  # another torch, without that name: nothing to extend
    if isinstance(current, _EitherMeta):
        if cls not in current.classes:
            current.classes += (cls,)
        return
    setattr(module, name, _EitherMeta(current.__name__, (), {
        "classes": (current, cls), "__module__": current.__module__,
        "__doc__": current.__doc__}))


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
            for attribute, cls in _pending.items():
                _rebind(module, attribute, cls)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec.loader.exec_module = exec_module
        return spec
