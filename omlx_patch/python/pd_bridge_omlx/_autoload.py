"""Imported at interpreter start by ``pd_bridge_omlx_autoload.pth`` only when ``PD_BRIDGE_OMLX`` is set.

Installs the hooks (``hooks.py``) right after oMLX imports the modules it changes, so it is in place before
oMLX builds its cache index or starts serving. Costs nothing in processes that never import
oMLX.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

from . import enabled
from .versions import SUPPORTED

# The modules each supported oMLX's hook points live in (versions.py), without detecting which
# oMLX is installed here: that waits until one of them is imported.
_HOOKS = {}
for _v in SUPPORTED:
    _HOOKS.setdefault(_v.block_reader[0], "install_cache_guard")
    _HOOKS.setdefault(_v.request_entry[0], "install_bridge")
    _HOOKS.setdefault(_v.server, "install_routes")

logger = logging.getLogger("pd_bridge_omlx")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the hook once the named module has executed."""

    def find_spec(self, name, path=None, target=None):
        hook = _HOOKS.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            from . import hooks

            getattr(hooks, hook)()

        loader.exec_module = exec_module
        return spec


if enabled() and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
