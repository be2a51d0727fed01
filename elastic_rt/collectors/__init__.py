"""Node health collectors: RDMA ports (sysfs), clocks (SNTP, adjtimex, skew against rank 0), the collective probe."""
