"""Build rendezvous handlers from torch's RendezvousParameters and register them with torch.

`etcd-v3` is elastic-rt's lease-based handler; `etcd-v3-torch` is torch's own
DynamicRendezvousHandler over the etcd v3 backend and store (for comparison and
for users who want torch's exact protocol).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import TYPE_CHECKING, Mapping

from elastic_rt.checkpoint import secret as job_secret
from elastic_rt.errors import ConfigError
from elastic_rt.rendezvous import conf as rdzv_conf
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig, spread_first
from elastic_rt.rendezvous.keys import RunKeys

if TYPE_CHECKING:  # torch is imported where a handler is built: the etcd options below serve commands without it
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_rt.rendezvous.handler import EtcdRendezvousHandler, RendezvousSettings

DEFAULT_PORT = 2379
log = logging.getLogger(__name__)


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """'h1:2379,h2,[::1]:2380' -> ((h1, 2379), (h2, 2379), (::1, 2380)). Schemes http:// are accepted."""
    out = []
    for raw in (text or "").split(","):
        item = raw.strip()
        item = re.sub(r"^[a-z]+://", "", item).rstrip("/")
        if not item:
            continue
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", item)
        if not m:
            raise ConfigError(f"invalid etcd endpoint {raw.strip()!r} in --rdzv-endpoint; expected host:port")
        host = m.group(1) or m.group(3)
        port_text = m.group(2) or m.group(4)
        port = int(port_text) if port_text else DEFAULT_PORT
        if not 0 < port < 65536:
            raise ConfigError(f"invalid port {port} in --rdzv-endpoint {raw.strip()!r}")
        out.append((host, port))
    if not out:
        raise ConfigError("--rdzv-endpoint is empty; give host:port[,host:port...] of etcd")
    return tuple(out)


def _float(params: RendezvousParameters, key: str, default: float) -> float:
    value = params.get(key, default)
    try:
        result = float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--rdzv-conf {key}={value!r} is not a number of seconds") from exc
    if result <= 0:
        raise ConfigError(f"--rdzv-conf {key}={value!r} must be > 0")
    return result


ENV_ETCD_PASSWORD = "ELASTIC_RT_ETCD_PASSWORD"


def endpoint_scheme(text: str) -> str | None:
    """'https', 'http' or None (no scheme) for --rdzv-endpoint; every endpoint must agree."""
    schemes = {m.group(1) for raw in (text or "").split(",") if (m := re.match(r"\s*([a-z]+)://", raw))}
    plain = any(raw.strip() and "://" not in raw for raw in (text or "").split(","))
    if len(schemes) > 1 or (schemes and plain):
        raise ConfigError(f"--rdzv-endpoint {text!r}: mix of schemes; use https:// (TLS) or http:// for all")
    scheme = schemes.pop() if schemes else None
    if scheme not in (None, "http", "https"):
        raise ConfigError(f"--rdzv-endpoint {text!r}: unknown scheme {scheme}://; use http:// or https://")
    return scheme


def _password(conf: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """password_file=PATH, else password= (visible in `ps`), else $ELASTIC_RT_ETCD_PASSWORD. The variable is
    removed from this process's environment (os.environ) once read: the workers never inherit it."""
    from_env = env.pop(ENV_ETCD_PASSWORD, None) if env is os.environ else env.get(ENV_ETCD_PASSWORD)
    path = conf.get("password_file")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"--rdzv-conf password_file={path}: cannot read it ({exc.strerror})") from exc
    if conf.get("password"):
        log.warning("--rdzv-conf password= shows in `ps`; prefer password_file=PATH or $%s", ENV_ETCD_PASSWORD)
        return conf["password"]
    return from_env or None


def etcd_config_from_conf(endpoint: str, conf: Mapping[str, str], *, timeout_s: float,
                          env: Mapping[str, str] | None = None, spread_key: str | None = None) -> EtcdConfig:
    """EtcdConfig from --rdzv-endpoint and --rdzv-conf keys (TLS files, user, password sources, endpoint_order,
    keepalive_to). A user over a plaintext connection is refused unless allow_plaintext_auth=1: the password would
    cross the network in clear. `spread_key`: the agent's node id, which picks the endpoint it talks to first unless
    endpoint_order=listed (None: a one-off command, which talks to the first listed)."""
    scheme = endpoint_scheme(endpoint)
    conf = rdzv_conf.canonical(conf)
    endpoints = parse_endpoints(endpoint)
    order = str(conf.get("endpoint_order") or "spread").strip().lower()
    if order not in ("spread", "listed"):
        raise ConfigError(f"--rdzv-conf endpoint_order={conf.get('endpoint_order')!r}: expected spread or listed")
    keepalive_to = str(conf.get("keepalive_to") or "leader").strip().lower()
    if keepalive_to not in ("leader", "member"):
        raise ConfigError(f"--rdzv-conf keepalive_to={conf.get('keepalive_to')!r}: expected leader or member")
    ca_cert, cert, key = conf.get("ca_cert"), conf.get("cert"), conf.get("key")
    if scheme == "http" and (ca_cert or cert or key):
        raise ConfigError("--rdzv-endpoint uses http:// but --rdzv-conf gives ca_cert/cert/key: "
                          "use https:// endpoints for TLS, or drop the TLS files")
    config = EtcdConfig(
        endpoints=endpoints,
        first=spread_first(spread_key, len(endpoints)) if order == "spread" and spread_key else 0,
        request_timeout_s=timeout_s,
        tls=scheme == "https",
        ca_cert=ca_cert,
        cert=cert,
        key=key,
        user=conf.get("user"),
        password=_password(conf, os.environ if env is None else env),
        keepalive_to_leader=keepalive_to == "leader",
    )
    if config.user and not config.secure and not rdzv_conf.flag(conf, "allow_plaintext_auth"):
        raise ConfigError(f"--rdzv-conf user={config.user} over plaintext etcd ({config.describe()}): the password "
                          "would cross the network in clear; use https:// endpoints with ca_cert= (docs/etcd-security.md), "
                          "or say allow_plaintext_auth=1")
    return config


def conf_from_params(params: RendezvousParameters) -> dict[str, str]:
    """The --rdzv-conf keys given (aliases as their key); ConfigError for a key the backend does not read."""
    conf = rdzv_conf.canonical({k: str(v) for k, v in params.config.items() if v is not None})
    rdzv_conf.check_keys(params.backend, conf)
    return conf


def etcd_config_from_params(params: RendezvousParameters, node_id: str) -> EtcdConfig:
    """The agent's EtcdConfig; `node_id` picks the endpoint it talks to first (endpoint_order)."""
    return etcd_config_from_conf(params.endpoint, conf_from_params(params),
                                 timeout_s=_float(params, "read_timeout", 5.0), spread_key=node_id)


def default_node_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "node"
    return f"{host}-{os.getpid()}"


# RendezvousParameters.config keys the launcher sets (not --rdzv-conf): where the agent serves /metrics.
METRICS_HOST_KEY = "metrics_host"
METRICS_PORT_KEY = "metrics_port"
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def advertised_metrics_addr(local_addr: str, host: str | None, port: object) -> str | None:
    """host:port at which the other nodes and `elastic-rt status` reach this agent's /metrics: the bind
    address, or this node's address when the server binds every interface; None when it is off (port 0)."""
    try:
        number = int(port)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None
    if not 0 < number < 65536:
        return None
    target = local_addr if (host or "") in _WILDCARD_HOSTS else str(host)
    return f"[{target}]:{number}" if ":" in target else f"{target}:{number}"


def node_id_from_params(params: RendezvousParameters) -> str:
    """`--node-id` (`node_id=`), else hostname-pid; ConfigError for a name the rendezvous keys cannot hold."""
    node_id = str(params.get("node_id") or default_node_id())
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", node_id):
        raise ConfigError(f"invalid node id {node_id!r}: use letters, digits, '.', '_' or '-'")
    return node_id


def settings_from_params(params: RendezvousParameters) -> RendezvousSettings:
    from elastic_rt.rendezvous.handler import RendezvousSettings

    conf = conf_from_params(params)
    node_id = node_id_from_params(params)
    local_addr = params.local_addr or socket.getfqdn()
    return RendezvousSettings(
        run_id=params.run_id,
        node_id=node_id,
        local_addr=local_addr,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        lease_ttl_s=_float(params, "lease_ttl", 3.0),
        join_timeout_s=_float(params, "join_timeout", 600.0),
        last_call_timeout_s=_float(params, "last_call_timeout", 10.0),
        store_timeout_s=_float(params, "store_timeout", 300.0),
        closed_ttl_s=_float(params, "closed_ttl", 3600.0),
        close_timeout_s=_float(params, "close_timeout", 30.0),
        fingerprint=str(params.get("fingerprint") or ""),
        accept_closed=rdzv_conf.flag(conf, "accept_closed"),
        metrics_addr=advertised_metrics_addr(local_addr, params.get(METRICS_HOST_KEY), params.get(METRICS_PORT_KEY)),
    )


def read_secret_file(path: str) -> bytes:
    """The job secret that signs etcd-v3's finals and `closed`, and etcd-v3-torch's state: the file's bytes,
    surrounding whitespace removed."""
    return job_secret.read_secret_file(path, setting="--rdzv-conf secret_file", hint="e.g. openssl rand -hex 32")


def create_etcd_v3_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """elastic-rt's handler; with `--rdzv-conf secret_file=PATH` each round's final, `closed` and rank 0's store
    address are signed with the job's secret and a value it does not sign is refused (docs/rendezvous.md); the
    same secret authenticates the memory tier's replica channel (docs/checkpoint.md)."""
    from elastic_rt.rendezvous.handler import EtcdRendezvousHandler

    settings = settings_from_params(params)  # validates the keys, timeouts and the node id first
    path = params.get("secret_file")
    secret = read_secret_file(path) if path else None
    return EtcdRendezvousHandler(EtcdClient(etcd_config_from_params(params, settings.node_id)), settings,
                                 secret=secret)


def create_etcd_v3_torch_handler(params: RendezvousParameters):
    """torch's DynamicRendezvousHandler on the etcd v3 backend (its heartbeat and last-call timing).

    With `--rdzv-conf secret_file=PATH` the state torch pickles is signed (HMAC-SHA256) and
    unsigned or wrongly signed state is refused before torch unpickles it (docs/rendezvous.md). Without it
    whoever can write the state's etcd key runs code in every agent: refused unless insecure_state=1.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from elastic_rt.rendezvous.backend import EtcdV3RendezvousBackend
    from elastic_rt.rendezvous.store import EtcdStore

    keys = RunKeys(params.run_id)
    conf = conf_from_params(params)
    path = conf.get("secret_file")
    if not path and not rdzv_conf.flag(conf, "insecure_state"):
        raise ConfigError(
            f"--rdzv-backend etcd-v3-torch keeps torch's pickled state in etcd: whoever can write "
            f"{keys.state} runs code in every agent; give --rdzv-conf secret_file=PATH (openssl rand -hex 32 > "
            "job.secret; the same file on every node), or say insecure_state=1")
    secret = read_secret_file(path) if path else None
    client = EtcdClient(etcd_config_from_params(params, str(params.get("node_id") or default_node_id())))
    backend = EtcdV3RendezvousBackend(client, params.run_id, name=params.backend, secret=secret)
    return create_handler(EtcdStore(client, keys.store), backend, params)


def register() -> None:
    """Make `--rdzv-backend etcd-v3` (and etcd-v3-torch) known to torch in this process."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    for name, creator in (("etcd-v3", create_etcd_v3_handler), ("etcd-v3-torch", create_etcd_v3_torch_handler)):
        try:
            rendezvous_handler_registry.register(name, creator)
        except ValueError:
            pass  # already registered (e.g. by the torchrun.handlers entry point)

