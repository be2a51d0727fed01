"""The --rdzv-conf flag's syntax (key=value pairs), read the same way by `launch`, `doctor` and `status`."""

from __future__ import annotations

from elastic_rt.errors import ConfigError


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """'k1=v1,k2=v2' -> {'k1': 'v1', 'k2': 'v2'}."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--rdzv-conf item {item!r}: expected key=value")
        out[key.strip()] = value.strip()
    return out
