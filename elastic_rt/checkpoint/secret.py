"""The job secret: one reader for every `secret_file` (checkpoint manifests, rendezvous state, replicas)."""

from __future__ import annotations

from elastic_rt.errors import ConfigError


def read_secret_file(path: str, *, setting: str = "checkpoint secret_file",
                     hint: str = "the same file as the rendezvous' secret_file is fine") -> bytes:
    """A job secret: the file's bytes, surrounding whitespace removed; ConfigError with one line naming
    `setting` (the checkpoint's and the rendezvous' secret_file both read it here)."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"{setting}={path}: cannot read it ({exc.strerror or exc})") from exc
    if not secret:
        raise ConfigError(f"{setting}={path}: the file is empty; put the job's secret in it ({hint})")
    return secret
