"""What a rank's process takes from the host, read from the kernel's counters (``sl.measure.HostPeak``,
``FileReads``): checked against buffers and files of known size, made here."""

from pathlib import Path

import numpy as np
import pytest

from shardlab.measure import FileReads, HostPeak

MiB = 2**20
pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the counters are Linux's")


def test_the_peak_is_a_buffer_made_and_freed_inside_not_what_was_held_before():
    before = np.ones(48 * MiB // 8)  # resident on entry: not the block's
    with HostPeak() as peak:
        inside = np.ones(16 * MiB // 8)
        del inside
    assert peak.measured and 15 * MiB <= peak.peak <= 20 * MiB, peak.peak  # pages the process gives back meanwhile
    del before


def test_a_block_that_allocates_nothing_peaks_near_zero():
    with HostPeak() as peak:
        sum(range(1000))
    assert peak.peak < 2 * MiB, peak.peak


def test_file_reads_count_the_bytes_of_a_file_read_inside(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"\0" * (3 * MiB + 17))
    with FileReads() as reads:
        path.read_bytes()
    assert 3 * MiB + 17 <= reads.bytes <= 3 * MiB + 64 * 1024, reads.bytes  # the counter's own read beside it
    with FileReads() as nothing:
        pass
    assert nothing.bytes < 4096
