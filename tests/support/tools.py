"""External tools the deployment tests need: skipped where missing, a failure under CI=true.

.ci/run installs promtool, shellcheck, pdsh and kubectl 1.20 and sets CI=true; a test that
needs one of them must then fail when it is missing (a broken install), not skip. Outside CI
the skip stays, with the reason saying how to install the tool.
"""

from __future__ import annotations

import os

import pytest

MARKER = "needs_tool"


def in_ci(env: dict[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get("CI", "")
    return value.strip().lower() in ("1", "true", "yes")


def require_tool(name: str, available: bool, how: str) -> None:
    """Return when the tool is there; else skip (outside CI) or fail (CI=true)."""
    if available:
        return
    if in_ci():
        pytest.fail(f"{name} is missing under CI=true ({how}); .ci/run installs it: did its install fail?",
                    pytrace=False)
    pytest.skip(f"{name} not installed ({how})")


def needs_tool(name: str, available: bool, how: str) -> pytest.MarkDecorator:
    """Mark a test or module: tests/conftest.py calls require_tool() before it runs."""
    return getattr(pytest.mark, MARKER)(name=name, available=available, how=how)
