"""dptc's DDP as torch.distributed.checkpoint's state-dict helpers see it.

[Note: DDP in torch.distributed.checkpoint]
torch.distributed.checkpoint.state_dict (get_state_dict, get_model_state_dict, set_state_dict,
...) names the parameters of a DDP model without DDP's "module." prefix, for the model and for
the optimizer alike: its _get_fqns steps over that prefix wherever ``isinstance(obj, DDP)``, DDP
being torch's DistributedDataParallel, bound to that name at the top of the module.  dptc's
wrapper is not torch's class, so there the prefix would stay: a checkpoint saved under one
wrapper would not load under the other, nor into the unwrapped model.  So dptc binds that name
to the pair (torch's class, dptc's class); nothing else in the module uses it.  The module
takes about 2 s to import, so dptc does not import it: where it is already imported, the name
is rebound at once, else a finder on sys.meta_path rebinds it right after the module's first
import and then leaves sys.meta_path.
"""

import importlib.abc
import importlib.util
import sys

_MODULE = "torch.distributed.checkpoint.state_dict"


def recognise_ddp(cls):
    """Makes torch.distributed.checkpoint's state-dict helpers treat ``cls`` as DDP."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        _rebind(module, cls)
    elif not any(isinstance(finder, _RebindAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RebindAfterImport(cls))


def _rebind(module, cls):
    current = getattr(module, "DDP", None)
    if current is None:
        return  # another torch, without that name: nothing to extend
    classes = current if isinstance(current, tuple) else (current,)
    if cls not in classes:
        module.DDP = classes + (cls,)


class _RebindAfterImport(importlib.abc.MetaPathFinder):
    """Finds the module as the finders after it would, and rebinds the name once it ran.  A
    find without an import (importlib.util.find_spec probing) leaves it in place."""

    def __init__(self, cls):
        self.cls = cls
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
            _rebind(module, self.cls)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        spec.loader.exec_module = exec_module
        return spec
