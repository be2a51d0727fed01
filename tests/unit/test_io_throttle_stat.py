"""elastic_rt.chaos.io_throttle.writes_in: the writes a cgroup's io statistics count for one disk (v1 and v2
formats, as the kernel writes them)."""

from __future__ import annotations

from elastic_rt.chaos.io_throttle import writes_in

V1 = """254:0 Read 12
254:0 Write 6623
254:0 Sync 6000
254:0 Async 635
254:0 Discard 0
254:0 Total 6635
253:0 Write 9
Total 6644
"""

V2 = """253:0 rbytes=0 wbytes=4096 rios=0 wios=1 dbytes=0 dios=0
254:0 rbytes=8192 wbytes=27127808 rios=2 wios=1326 dbytes=0 dios=0
"""


def test_v1_counts_the_disks_write_line_only():
    assert writes_in(V1, "254:0", 1) == 6623
    assert writes_in(V1, "253:0", 1) == 9


def test_v2_reads_wios_of_the_disks_line():
    assert writes_in(V2, "254:0", 2) == 1326
    assert writes_in(V2, "253:0", 2) == 1


def test_a_disk_with_no_line_yet_made_no_write_and_a_line_without_the_count_says_nothing():
    assert writes_in(V1, "8:0", 1) == 0 and writes_in(V2, "8:0", 2) == 0 and writes_in("", "254:0", 2) == 0
    assert writes_in("254:0 rbytes=1 wbytes=2\n", "254:0", 2) is None
