"""One typed error hierarchy; third-party errors are translated into these at the boundary."""

from __future__ import annotations


class ElasticRTError(Exception):
    """Base class: an error elastic-rt reports to the user as one clear line."""

    exit_code: int = 1


class ConfigError(ElasticRTError):
    """A flag, environment variable or configuration value is invalid."""

    exit_code = 2


class EtcdUnavailableError(ElasticRTError):
    """No etcd endpoint answered."""


class LeaseGoneError(EtcdUnavailableError):
    """etcd answered: the lease a key was to be attached to does not exist any more (it expired or was revoked)."""


class EtcdAccessError(ElasticRTError):
    """etcd answered but refused this client (TLS, authentication, permission): retrying cannot help."""

    exit_code = 2


class RendezvousDataError(ElasticRTError):
    """Data found under the rendezvous prefix is not what elastic-rt wrote."""


class RunNotFoundError(ElasticRTError):
    """No key of the run exists under /elastic-rt/<run_id>/ (`elastic-rt status`: a wrong --rdzv-id)."""

    exit_code = 3


class CheckpointError(ElasticRTError):
    """A checkpoint could not be written, found or verified."""


class HealthCheckError(ElasticRTError):
    """A pre-flight or health check failed."""


class RunInUseError(ConfigError):
    """The run id is in use by live agents of another job (another fingerprint: rendezvous/claim.py)."""


class DuplicateNodeError(ConfigError):
    """Another live agent of the run registered this node id (`held`: its alive/ key as read)."""

    def __init__(self, message: str, held: object = None) -> None:
        super().__init__(message)
        self.held = held


class RunClosedError(ElasticRTError):
    """This node came to a run that had already finished, and did not train (`--rdzv-conf accept_closed=1`
    makes that exit 0)."""

    exit_code = 5


class NodeExcludedError(HealthCheckError):
    """The pre-flight test found this node slower than the job (--preflight exclude): it leaves before
    training; a scheduler should run it elsewhere, not restart it here."""

    exit_code = 4


class RoundOverError(ElasticRTError):
    """A round listener used its round's store after the round ended (the agent met again, or left)."""


class RoundRejectedError(ElasticRTError):
    """A round must form again without nodes the pre-flight test excluded (handled by the agent)."""

    def __init__(self, message: str, nodes: tuple[str, ...]) -> None:
        super().__init__(message)
        self.nodes = nodes
