"""Let PyPI's CUDA-linked torchvision import beside the CPU build of torch (CPU-test glue).

SGLang and transformers import torchvision unconditionally. The only torchvision release that
pairs with SGLang 0.5.23 on PyPI is built against CUDA torch, so its compiled ops (``_C.so``)
cannot load beside ``torch==2.13.0+cpu``; torchvision then dies registering fake kernels for
ops that were never defined (``operator torchvision::nms does not exist``).

This file sits only on the engine's ``PYTHONPATH`` (never in site-packages) and swaps the one
failing submodule, ``torchvision._meta_registrations``, for an empty module. Everything else in
torchvision (transforms, models, io in Python) imports as usual; the compiled ops (nms,
roi_align, ...) stay unavailable, as torchvision itself reports via
``torchvision.extension._has_ops() == False``. Nothing is imported here eagerly: the finder
only acts when that submodule is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_SKIPPED = "torchvision._meta_registrations"


class _SkipTorchvisionMetaRegistrations(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _SKIPPED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__doc__ = "Skipped by Tollgate's CPU shim: torchvision's C ops are not loaded."
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _SkipTorchvisionMetaRegistrations())
