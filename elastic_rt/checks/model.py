"""One health-check result type, its runner, and the one-line rendering of reasons and errors, for doctor and
/readyz alike."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Tuple, Union

from elastic_rt.errors import ElasticRTError

log = logging.getLogger(__name__)


class Status(str, Enum):
    """A check's verdict. Only FAIL fails an endpoint or a hard pre-flight check; WARN and SKIP pass."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """A check's verdict and why; `data` holds the measured values (doctor --json)."""

    status: Status
    detail: str
    name: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)
    elapsed_s: float | None = field(default=None, compare=False)  # how long the check ran, set by run_check()

    @classmethod
    def of(cls, ok: bool, detail: str, *, name: str = "") -> "CheckResult":
        """A pass/fail verdict (the endpoints' checks): OK or FAIL."""
        return cls(status=Status.OK if ok else Status.FAIL, detail=detail, name=name)

    @property
    def ok(self) -> bool:
        return self.status is not Status.FAIL

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL


Check = Callable[[], Union[CheckResult, Tuple[bool, str]]]


def one_line(text: object, limit: int | None = None) -> str:
    """Whitespace and newlines collapsed; cut to `limit` characters when one is given."""
    flat = " ".join(str(text).split())
    return flat if limit is None or len(flat) <= limit else flat[: limit - 3] + "..."


def describe_error(exc: BaseException) -> str:
    """Our errors say what to do already; anything else is named by its type."""
    return one_line(str(exc) if isinstance(exc, ElasticRTError) else f"{type(exc).__name__}: {exc}")


def run_check(
    name: str,
    check: Check,
    *,
    clock: Callable[[], float] = time.monotonic,
    limit: int | None = None,
    raised_prefix: str = "",
) -> CheckResult:
    """Run one check, timed, its detail on one line (cut to `limit`). A check may answer (ok, reason); one
    that raises becomes a failed result naming the error (`raised_prefix` first), never a traceback."""
    start = clock()
    try:
        answer = check()
    except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
        if not isinstance(exc, ElasticRTError):
            log.debug("check %s raised", name, exc_info=True)
        result = CheckResult(name=name, status=Status.FAIL, detail=raised_prefix + describe_error(exc))
    else:
        if isinstance(answer, CheckResult):
            result = dataclasses.replace(answer, name=answer.name or name)
        else:
            ok, reason = answer
            result = CheckResult.of(bool(ok), str(reason), name=name)
    return dataclasses.replace(result, detail=one_line(result.detail, limit), elapsed_s=clock() - start)
