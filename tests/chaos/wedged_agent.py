"""Test-only: `elastic-rt launch` whose monitor loop stops while the file $ELASTIC_RT_TEST_WEDGE_FILE exists
(the HTTP thread keeps serving), with the liveness floor lowered to $ELASTIC_RT_TEST_LIVENESS_MIN_S so a test
sees /livez fail in seconds. The hook lives here, outside the package.

    python tests/chaos/wedged_agent.py [launch options] SCRIPT [ARGS...]
"""

from __future__ import annotations

import os
import sys
import time

from elastic_rt import cli
from elastic_rt.agent.agent import ElasticRTAgent
from elastic_rt.metrics import health_endpoints as health

WEDGE_FILE = os.environ["ELASTIC_RT_TEST_WEDGE_FILE"]
health.LIVENESS_MIN_S = float(os.environ.get("ELASTIC_RT_TEST_LIVENESS_MIN_S", health.LIVENESS_MIN_S))
_monitor_workers = ElasticRTAgent._monitor_workers


def _wedgeable_monitor_workers(self, worker_group):
    if os.path.exists(WEDGE_FILE):
        print(f"wedged_agent: monitor loop stopped while {WEDGE_FILE} exists", flush=True)
        while os.path.exists(WEDGE_FILE):
            time.sleep(0.05)
        print("wedged_agent: monitor loop resumed", flush=True)
    return _monitor_workers(self, worker_group)


ElasticRTAgent._monitor_workers = _wedgeable_monitor_workers

if __name__ == "__main__":
    sys.exit(cli.main(["launch", *sys.argv[1:]]))
