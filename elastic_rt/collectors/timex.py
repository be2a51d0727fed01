"""The kernel's NTP discipline state via adjtimex(2) (read-only), and its collector."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from elastic_rt.errors import HealthCheckError
from elastic_rt.metric_spec import Kind, MetricSpec

log = logging.getLogger(__name__)

TIME_ERROR = 5  # adjtimex return value: clock not synchronized
STA_UNSYNC = 0x0040
STA_NANO = 0x2000
_PPM16 = 1_000_000.0 * 65536.0  # freq is in ppm with a 16-bit fraction


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class _Timex(ctypes.Structure):
    """struct timex from <sys/timex.h> (Linux, glibc/musl; natural alignment)."""

    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", _Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_reserved", ctypes.c_int * 11),
    ]


@dataclass(frozen=True, kw_only=True)
class TimexStatus:
    """adjtimex values in base units, converted the way node_exporter's timex collector does."""

    synchronized: bool  # return value != TIME_ERROR (STA_UNSYNC or STA_CLOCKERR set)
    unsync_flag: bool  # STA_UNSYNC bit of status
    offset_s: float  # ns if STA_NANO else us
    estimated_error_s: float  # always us
    max_error_s: float  # always us
    frequency_adjustment_ratio: float  # 1 + freq / 2^16 ppm
    tick_s: float
    status: int
    state: int  # the raw return value (TIME_OK=0 ... TIME_ERROR=5)


_adjtimex = None


def _libc_adjtimex():
    """libc's adjtimex, looked up once (find_library runs ldconfig: milliseconds)."""
    global _adjtimex
    if _adjtimex is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.adjtimex
        except (OSError, AttributeError) as exc:
            raise HealthCheckError(f"adjtimex is not available on this system ({exc})") from exc
        fn.argtypes = [ctypes.POINTER(_Timex)]
        fn.restype = ctypes.c_int
        _adjtimex = fn
    return _adjtimex


def read_timex() -> TimexStatus:
    """Call adjtimex with modes=0 (reads only; needs no privilege)."""
    fn = _libc_adjtimex()
    tx = _Timex()
    tx.modes = 0
    rc = fn(ctypes.byref(tx))
    if rc < 0:
        errno = ctypes.get_errno()
        raise HealthCheckError(f"adjtimex failed: errno {errno} ({_strerror(errno)})")
    divisor = 1e9 if tx.status & STA_NANO else 1e6
    return TimexStatus(
        synchronized=rc != TIME_ERROR,
        unsync_flag=bool(tx.status & STA_UNSYNC),
        offset_s=tx.offset / divisor,
        estimated_error_s=tx.esterror / 1e6,
        max_error_s=tx.maxerror / 1e6,
        frequency_adjustment_ratio=1.0 + tx.freq / _PPM16,
        tick_s=tx.tick / 1e6,
        status=tx.status,
        state=rc,
    )


def _strerror(errno: int) -> str:
    return os.strerror(errno) if errno else "unknown"


TIMEX = {  # the TimexStatus field each one shows -> its metric
    "sync": MetricSpec(name="elastic_rt_clock_timex_sync_status", kind=Kind.GAUGE,
                       help="1 if the kernel clock is synchronized (adjtimex != TIME_ERROR).",
                       doc="1 if the kernel says the clock is synchronized (`adjtimex` does not return "
                           "`TIME_ERROR`), else 0."),
    "offset": MetricSpec(name="elastic_rt_clock_timex_offset_seconds", kind=Kind.GAUGE,
                         help="Kernel PLL offset between system and reference clock.",
                         doc="Kernel PLL offset to the reference clock (ns when `STA_NANO` is set, else µs, "
                             "converted)."),
    "esterror": MetricSpec(name="elastic_rt_clock_timex_estimated_error_seconds", kind=Kind.GAUGE,
                           help="Kernel estimated clock error.", doc="Kernel estimated error."),
    "maxerror": MetricSpec(name="elastic_rt_clock_timex_maxerror_seconds", kind=Kind.GAUGE,
                           help="Kernel maximum clock error.",
                           doc="Kernel maximum error; grows by 500 ppm while no NTP daemon updates it."),
    "freq": MetricSpec(name="elastic_rt_clock_timex_frequency_adjustment_ratio", kind=Kind.GAUGE,
                       help="Local clock frequency adjustment.",
                       doc="Local clock frequency adjustment (1 + freq / 2^16 ppm)."),
}


class TimexCollector(Collector):
    """elastic_rt_clock_timex_* gauges (TIMEX), read at scrape time (one system call)."""

    def __init__(
        self,
        *,
        reader: Callable[[], TimexStatus] = read_timex,
        const_labels: Mapping[str, str] | None = None,
    ) -> None:
        self._reader = reader
        self._const = dict(const_labels or {})  # e.g. run_id, node
        self._warned = False

    def _families(self) -> dict[str, GaugeMetricFamily]:
        return {key: spec.family(labels=list(self._const)) for key, spec in TIMEX.items()}

    def collect(self) -> Iterator:
        try:
            st = self._reader()
        except HealthCheckError as exc:
            if not self._warned:
                self._warned = True
                log.info("clock: %s; no timex metrics", exc)
            return
        fams = self._families()
        lv = list(self._const.values())
        fams["sync"].add_metric(lv, 1.0 if st.synchronized else 0.0)
        fams["offset"].add_metric(lv, st.offset_s)
        fams["esterror"].add_metric(lv, st.estimated_error_s)
        fams["maxerror"].add_metric(lv, st.max_error_s)
        fams["freq"].add_metric(lv, st.frequency_adjustment_ratio)
        yield from fams.values()

    def describe(self) -> Iterator:
        yield from self._families().values()
