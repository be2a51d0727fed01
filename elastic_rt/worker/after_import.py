"""Run an action on a module once it has finished importing (or at once, if it already has).

The worker entry point uses this to patch or hook torch lazily: nothing of torch is
imported before the user's script imports it, and nothing costs anything until then.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable

Action = Callable[[Any], None]

_actions: dict[str, list[Action]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wrap the loader of a watched module so that its actions run right after it executes."""

    def find_spec(self, fullname, path, target=None):
        actions = _actions.get(fullname)
        if not actions:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_act(module):
            exec_module(module)
            for action in list(_actions.get(fullname, ())):
                action(module)

        loader.exec_module = exec_and_act
        return spec


def when_imported(name: str, action: Action) -> None:
    """Call action(module) when `name` has been imported: now if it already is, else right after
    its import. An action registered twice for the same module runs once."""
    registered = _actions.setdefault(name, [])
    if action in registered:
        return
    registered.append(action)
    loaded = sys.modules.get(name)
    if loaded is not None:
        action(loaded)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
