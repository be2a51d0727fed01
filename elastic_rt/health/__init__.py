"""Node and worker health: heartbeats, hang detection, RDMA, clocks, and the metrics exporter.

Kept import-light: a training script imports elastic_rt.health.heartbeat for
report_step() without pulling in prometheus_client or psutil.
"""
