"""Run a function right after a named module is imported (a post-import hook).

A meta-path finder that, for the watched names only, lets the normal finders find the module and
wraps its loader so our function runs once the module's code has executed. Modules never imported
cost nothing; a module already imported when the hook is registered is patched at once.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable

Hook = Callable[[object], None]
_hooks: dict[str, list[Hook]] = {}
_lock = threading.RLock()


def _run(name: str, module) -> None:
    for fn in _hooks.pop(name, []):
        try:
            fn(module)
        except Exception as e:  # a failed patch must not break the user's import
            sys.stderr.write(f"tokenpulse: could not instrument {name} ({type(e).__name__}: {e})\n")


class _Loader(importlib.abc.Loader):
    def __init__(self, name: str, loader):
        self.name, self.loader = name, loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        # The module keeps its real loader (tracebacks, importlib.resources and pickling use it).
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        with _lock:
            _run(self.name, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(name, spec.loader)
        return spec


_finder = _Finder()


def when_imported(name: str, fn: Hook) -> None:
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        module = sys.modules.get(name)
        if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
            try:
                fn(module)
            except Exception as e:
                sys.stderr.write(f"tokenpulse: could not instrument {name} ({type(e).__name__}: {e})\n")
            return
        _hooks.setdefault(name, []).append(fn)
