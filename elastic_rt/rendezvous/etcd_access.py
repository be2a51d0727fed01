"""What etcd's refusals of this client mean (TLS, authentication, permission), as one-line errors.

gRPC reports most refusals itself: a failed handshake, a wrong password, a missing permission.
Two it cannot tell from an outage, so they are checked with one TLS connection of our own,
made with the client's own files:
- the server rejects our client certificate after a TLS 1.3 handshake (etcd 3.4 and newer Go
  builds): the client has already finished its side of the handshake, the server's alert
  (bad_certificate) arrives as the first record, and gRPC reports only "Unwrap failed
  (TSI_DATA_CORRUPTED)". Over TLS 1.2 the alert ends the handshake and gRPC names it.
- a plaintext client meets a TLS-only etcd: etcd closes the connection ("Socket closed").
An etcd that is down, restarting or unreachable fails the check's connection too and stays
what it is: unavailable, retried.
"""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING

import grpc

from elastic_rt.errors import EtcdAccessError

if TYPE_CHECKING:
    from elastic_rt.rendezvous.etcd_client import EtcdConfig

# HTTP/2 client connection preface and an empty SETTINGS frame: an etcd that accepted the TLS session
# answers with its own SETTINGS frame; one that rejected our certificate answers with a TLS alert.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

# TLS alerts a server sends about the client's certificate (OpenSSL's reason names).
_CLIENT_CERT_ALERTS = ("ALERT_BAD_CERTIFICATE", "ALERT_CERTIFICATE_REQUIRED", "ALERT_CERTIFICATE_UNKNOWN",
                       "ALERT_UNKNOWN_CA", "ALERT_UNSUPPORTED_CERTIFICATE", "ALERT_CERTIFICATE_EXPIRED",
                       "ALERT_CERTIFICATE_REVOKED", "ALERT_ACCESS_DENIED")


def _client_cert_refused(label: str, config: "EtcdConfig") -> EtcdAccessError:
    if config.cert:
        why = (f"it rejected our client certificate cert={config.cert} (not signed by the CA etcd trusts "
               "in --trusted-ca-file, expired, or without the clientAuth usage)")
    else:
        why = "it requires a client certificate; give cert= and key= in --rdzv-conf"
    return EtcdAccessError(f"TLS handshake with etcd at {label} failed: {why}")


def access_error(label: str, config: "EtcdConfig", code, details: str) -> EtcdAccessError | None:
    """The error to raise at once when gRPC's report says etcd refused this client; None otherwise."""
    low = details.lower()
    if "handshake failed" in low:
        if "certificate_verify_failed" in low:
            why = (f"its certificate is not signed by ca_cert={config.ca_cert}" if config.ca_cert else
                   "its certificate is not trusted by the default roots; give ca_cert= in --rdzv-conf")
        elif "bad_certificate" in low or "certificate_required" in low:
            return _client_cert_refused(label, config)
        elif "wrong_version_number" in low or "packet_length_too_long" in low:
            why = "it does not speak TLS; use an http:// endpoint without ca_cert/cert/key"
        else:
            why = details.rsplit(": ", 2)[-2] if details.count(": ") >= 2 else details
        return EtcdAccessError(f"TLS handshake with etcd at {label} failed: {why}")
    if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in low:
        return EtcdAccessError(f"etcd at {label}: authentication failed for user {config.user!r} "
                               "(wrong user or password; see password_file= or ELASTIC_RT_ETCD_PASSWORD)")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        who = f"user {config.user!r}" if config.user else "this client (no user= given; is auth enabled?)"
        return EtcdAccessError(
            f"etcd at {label}: permission denied for {who}; its role needs readwrite on the run's "
            "prefix (etcdctl role grant-permission ROLE --prefix=true readwrite /elastic-rt/RUN_ID/)"
        )
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION) and "user name" in low:
        return EtcdAccessError(f"etcd at {label} requires authentication ({details}); "
                               "give user= and password_file= in --rdzv-conf")
    return None


def needs_tls_check(code, details: str, *, secure: bool) -> bool:
    """Whether gRPC's report may hide a TLS refusal (see the module's docstring) and is worth one check."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return False
    if secure:
        return "TSI_DATA_CORRUPTED" in details or "Unwrap failed" in details
    return "Socket closed" in details


def tls_context(config: "EtcdConfig", *, verify: bool) -> ssl.SSLContext:
    """A TLS client context with the client's files (verify=False: accept any server), ALPN h2."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if verify:
        if config.ca_cert:
            ctx.load_verify_locations(config.ca_cert)
        else:
            ctx.load_default_certs()
        if config.cert and config.key:
            ctx.load_cert_chain(config.cert, config.key)
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _is_alert(exc: ssl.SSLError) -> bool:
    return "ALERT" in str(exc.reason or "")


def check_tls(host: str, port: int, label: str, config: "EtcdConfig", timeout_s: float) -> EtcdAccessError | None:
    """One TLS connection to the endpoint, as gRPC makes it; the refusal it proves, or None.

    None whenever the connection itself fails (refused, reset, timed out: an outage) or the server
    accepts us (the gRPC failure was something else, transient).
    """
    secure = config.secure
    try:
        ctx = tls_context(config, verify=secure)
    except (OSError, ssl.SSLError):
        return None  # unreadable files are reported when the channel is made
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as tls:
                if not secure:  # a TLS server answered a TLS hello
                    return _speaks_tls(label)
                tls.sendall(_H2_PREFACE)
                tls.recv(9)
                return None
    except ssl.SSLCertVerificationError as exc:
        return access_error(label, config, None, f"handshake failed: CERTIFICATE_VERIFY_FAILED {exc}")
    except ssl.SSLError as exc:
        if not _is_alert(exc):
            return None  # not a TLS server (plaintext check), or a broken connection
        if not secure:
            return _speaks_tls(label)
        if any(name in str(exc.reason) for name in _CLIENT_CERT_ALERTS):
            return _client_cert_refused(label, config)
        return EtcdAccessError(f"TLS handshake with etcd at {label} failed: it sent the TLS alert {exc.reason}")
    except OSError:
        return None


def _speaks_tls(label: str) -> EtcdAccessError:
    return EtcdAccessError(
        f"etcd at {label} speaks TLS and this client does not: use https:// endpoints in --rdzv-endpoint "
        "with ca_cert= (and cert=, key= where etcd asks for client certificates) in --rdzv-conf"
    )
