"""bench.machine_cpu: the machine's busy CPU and named process trees, as the benchmarks read them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.machine_cpu import CpuMeter, CpuUse, format_use, tree_cpu_s

SPIN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_busy_process_and_its_children_are_counted_and_the_machine_holds_them() -> None:
    # A parent that waits for a child that spins: the tree's CPU is the child's, not the parent's.
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys\n"
                               f"subprocess.run([sys.executable, '-c', {SPIN.format(seconds=0.6)!r}])\n"
                               "import time; time.sleep(2)\n"])
    try:
        meter = CpuMeter({"self": lambda: [os.getpid()], "tree": lambda: [parent.pid]})
        before = meter.sample()
        _spin(0.3)
        deadline = time.monotonic() + 10
        while tree_cpu_s(parent.pid) < 0.55 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Long enough for the child to have ended and been waited for: its CPU still counts in the tree
        # (through its parent's), as it did not when it ended just before the sample.
        time.sleep(0.3)
        use = meter.since(before)
    finally:
        parent.wait(10)
    assert 0.28 <= use.named_s["self"] <= 0.6
    assert 0.5 <= use.named_s["tree"] <= 1.0, use
    # Everything the two did ran on this machine's cores within the window.
    assert use.machine_s >= 0.9 * (use.named_s["self"] + use.named_s["tree"])
    assert 0.0 < use.busy <= 1.05


def test_figures_per_unit_split_the_machine_into_its_named_parts_and_the_rest() -> None:
    use = CpuUse(wall_s=2.0, machine_s=3.0, named_s={"worker": 1.5, "broker": 0.5}, cores=2)
    assert use.busy == 0.75
    per = use.per_unit_us(1000)
    assert per == {"machine": 3000.0, "worker": 1500.0, "broker": 500.0, "other": 1000.0}
    assert format_use("flood_", use, 1000, "completion") == [
        "flood_machine_busy=0.75", "flood_machine_cpu_us_per_completion=3000",
        "flood_worker_cpu_us_per_completion=1500", "flood_broker_cpu_us_per_completion=500",
        "flood_other_cpu_us_per_completion=1000"]
    assert use.per_unit_us(0) == {}
