"""End to end: the `shoal` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def test_bench_allreduce_prints_shoal_beside_gloo() -> None:
    out = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "allreduce", "--world-sizes", "2",
                          "--sizes", "4KiB", "256KiB", "--repeats", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["4KiB", "256KiB"], out
    for row in rows:
        shoal_bw, gloo_bw, ratio = (cell.strip() for cell in row.split("|")[5:8])
        assert shoal_bw.endswith("GB/s") and gloo_bw.endswith("GB/s") and ratio.endswith("x"), row


def test_unknown_benchmark_is_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "nope"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "invalid choice" in result.stderr
