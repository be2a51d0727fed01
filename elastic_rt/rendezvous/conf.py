"""The `--rdzv-conf` flag: its syntax (key=value pairs, read the same way by `launch`, `doctor`, `status` and `gc`)
and the etcd backends' keys: which exist, for which backend, what each means; unknown keys refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from elastic_rt.errors import ConfigError

ETCD_V3 = "etcd-v3"
ETCD_V3_TORCH = "etcd-v3-torch"
BOTH = (ETCD_V3, ETCD_V3_TORCH)


@dataclass(frozen=True, kw_only=True)
class ConfKey:
    """One `--rdzv-conf` key: its spellings, the backends that read it, the setting it fills (None: none
    with a default to show) and what it means (README's table is generated from these)."""

    key: str
    meaning: str
    aliases: tuple[str, ...] = ()
    backends: tuple[str, ...] = BOTH
    field: str | None = None


KEYS: tuple[ConfKey, ...] = (
    ConfKey(key="lease_ttl", backends=(ETCD_V3,), field="lease_ttl_s",
            meaning="seconds a node's etcd lease lives without a keep-alive: a dead node is evicted after it"),
    ConfKey(key="join_timeout", field="join_timeout_s",
            meaning="seconds to wait for a round to complete, retrying an unreachable etcd, before giving up"),
    ConfKey(key="last_call_timeout", field="last_call_timeout_s",
            meaning="seconds a round waits for more nodes once MIN joined (a re-forming round closes once every "
                    "live node joined)"),
    ConfKey(key="store_timeout", backends=(ETCD_V3,), field="store_timeout_s",
            meaning="timeout of each operation on the round's c10d store over etcd (the workers' bootstrap)"),
    ConfKey(key="read_timeout", field="request_timeout_s", meaning="deadline of each etcd request"),
    ConfKey(key="closed_ttl", backends=(ETCD_V3,), field="closed_ttl_s",
            meaning="seconds the `closed` marker of a finished run stays after its last agent removed the run's "
                    "other keys (a node joining meanwhile is told the run is over)"),
    ConfKey(key="node_id", field="node_id", meaning="this node's name in the rendezvous (also `--node-id`)"),
    ConfKey(key="launch_id", backends=(ETCD_V3,),
            meaning="what makes this launch distinct (a Job's uid, `$SLURM_JOB_ID`): part of the job fingerprint, so "
                    "that a second launch of the same command under a live run id is refused, and a node of this "
                    "launch that finds the run finished (a restarted pod) exits 0, not 5"),
    ConfKey(key="accept_closed", backends=(ETCD_V3,),
            meaning="`1`: a node that finds its run already finished exits 0 instead of 5, whatever launched it"),
    ConfKey(key="ca_cert", aliases=("cacert",), field="ca_cert", meaning="TLS: CA bundle to verify etcd's certificate"),
    ConfKey(key="cert", aliases=("ssl_cert",), field="cert", meaning="TLS: client certificate"),
    ConfKey(key="key", aliases=("ssl_cert_key",), field="key", meaning="TLS: client key"),
    ConfKey(key="user", aliases=("username",), field="user",
            meaning="etcd user (TLS endpoints only, unless `allow_plaintext_auth=1`)"),
    ConfKey(key="password", field="password",
            meaning="etcd password (shows in `ps`: prefer `password_file` or $ELASTIC_RT_ETCD_PASSWORD, which the "
                    "agent removes from its environment: workers never see it)"),
    ConfKey(key="password_file", meaning="file holding the etcd password"),
    ConfKey(key="allow_plaintext_auth",
            meaning="`1`: send `user` and password over a plaintext (http) etcd connection; refused otherwise"),
    ConfKey(key="endpoint_order",
            meaning="`spread` (default): each agent talks first to the member of `--rdzv-endpoint` its node id picks "
                    "(a stable hash), so that a job's connections, watches and keep-alives spread over etcd's "
                    "members; `listed`: every agent talks to the first one first. Failover goes on to the next "
                    "endpoints in the list either way"),
    ConfKey(key="keepalive_to", backends=(ETCD_V3,),
            meaning="`leader` (default): once in a round, an agent sends its lease keep-alives straight to the "
                    "member of `--rdzv-endpoint` that leads (found by its Status, followed after an election), not "
                    "through a member that forwards each one (less CPU for etcd: docs/scale.md); `member`: to the "
                    "member the agent talks to"),
    ConfKey(key="secret_file",
            meaning="the job secret: `etcd-v3` signs each round's membership and `closed` with it, `etcd-v3-torch` "
                    "its pickled state (docs/rendezvous.md)"),
    ConfKey(key="insecure_state", backends=(ETCD_V3_TORCH,),
            meaning="`1`: run `etcd-v3-torch` without `secret_file` (whoever writes its etcd key runs code in the "
                    "agents); refused otherwise"),
    ConfKey(key="close_timeout", field="close_timeout_s",
            meaning="seconds a node whose job ended tries to mark the run closed (`etcd-v3`: retried while etcd does "
                    "not answer; then one warning line, the job's exit code unchanged); torch's handler: seconds to "
                    "close the rendezvous"),
    ConfKey(key="heartbeat_timeout", backends=(ETCD_V3_TORCH,),
            meaning="torch's handler: seconds a keep-alive heartbeat may take"),
    ConfKey(key="keep_alive_interval", backends=(ETCD_V3_TORCH,),
            meaning="torch's handler: seconds between heartbeats (default 5)"),
    ConfKey(key="keep_alive_max_attempt", backends=(ETCD_V3_TORCH,),
            meaning="torch's handler: heartbeats missed before a node is dead (default 3)"),
    ConfKey(key="timeout", meaning="set by torchrun (`--rdzv-timeout`); not used by the etcd backends"),
)

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


_INTERNAL = frozenset({"fingerprint", "metrics_host", "metrics_port"})  # set by `elastic-rt launch` itself


def canonical(conf: Mapping[str, object]) -> dict[str, object]:
    """Aliases replaced by their key (`cacert` -> `ca_cert`); a key given twice under two spellings is refused."""
    names = {alias: k.key for k in KEYS for alias in k.aliases}
    out: dict[str, object] = {}
    for name, value in conf.items():
        key = names.get(name, name)
        if key in out:  # two spellings of one key (a dict holds each spelling once)
            raise ConfigError(f"--rdzv-conf gives {key} twice (as {key}= and as an alias); give it once")
        out[key] = value
    return out


def valid_keys(backend: str) -> list[str]:
    return sorted(k.key for k in KEYS if backend in k.backends)


def check_keys(backend: str, conf: Mapping[str, object]) -> None:
    """Refuse, in one line listing the valid keys, a key the backend does not read (a typo such as
    `cacert_file=` would otherwise fall back to plaintext). Other backends (torch's) are not checked."""
    if backend not in BOTH:
        return
    known = {name for k in KEYS if backend in k.backends for name in (k.key, *k.aliases)} | _INTERNAL
    unknown = sorted(name for name in conf if name not in known)
    if unknown:
        other = [name for name in unknown if any(name in (k.key, *k.aliases) for k in KEYS)]
        where = f" (read by {'etcd-v3-torch' if backend == ETCD_V3 else 'etcd-v3'} only)" if other == unknown else ""
        raise ConfigError(f"--rdzv-conf: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for "
                          f"--rdzv-backend {backend}{where}; valid keys: {', '.join(valid_keys(backend))}")


def flag(conf: Mapping[str, object], key: str) -> bool:
    """A yes/no key: 1, true, yes, on (or 0, false, no, off, empty); anything else is refused."""
    text = str(conf.get(key, "") or "").strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"--rdzv-conf {key}={conf.get(key)!r}: expected 1 or 0")
