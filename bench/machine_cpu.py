"""Where a benchmark phase's CPU went on this machine: all cores, and the processes that take part.

A benchmark on a small machine shares its cores between the load generator, the broker, the stand-in
engine and the system under test, so a throughput figure alone cannot say whether a path is slow or the
machine is full. A :class:`CpuMeter` snapshot before and after a phase gives the machine's busy CPU
(``/proc/stat``: every process, the kernel's network work included) and, by name, that of chosen process
trees (``/proc/PID/stat``, children included), so a phase reads as "N µs of machine CPU per unit of work,
of which the broker took M". Linux only; elsewhere every figure is 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def machine_busy_s() -> float:
    """CPU seconds all cores have spent busy since boot (everything but idle and iowait)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    # guest time is already counted in user; steal is time this machine did not get, not busy.
    busy = sum(fields[:8]) - idle - (fields[7] if len(fields) > 7 else 0)
    return busy * _TICK_S


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) * _TICK_S if fields else 0.0


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and of all its descendants: the live ones, and those that ended and were
    waited for (the kernel adds those to their parent's ``cutime``/``cstime``). Without the latter, a
    child that ended between two samples took its CPU out of the tree (seen: a tree's 0.6 s child read as
    0.02 s when it ended just before the second sample)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    own = sum(int(fields[i]) for i in (11, 12, 13, 14)) * _TICK_S
    return own + sum(tree_cpu_s(child) for child in children(pid))


def find_pids(match: Callable[[str], bool]) -> list[int]:
    """Processes whose command line (arguments joined by spaces) satisfies ``match``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline and match(cmdline):
            found.append(int(entry.name))
    return found


def kafka_broker_pids() -> list[int]:
    """The Kafka brokers running here (the project's, or any other JVM running kafka.Kafka)."""
    return find_pids(lambda cmd: cmd.startswith(("java", "/")) and "java" in cmd.split(" ", 1)[0]
                     and "kafka" in cmd.lower())


@dataclass(frozen=True)
class CpuSample:
    wall_s: float
    machine_s: float
    named_s: dict[str, float]


@dataclass(frozen=True)
class CpuUse:
    """CPU spent between two samples: the machine's, and that of each named process tree."""

    wall_s: float
    machine_s: float
    named_s: dict[str, float]
    cores: int

    @property
    def busy(self) -> float:
        """The share of all cores that was busy (1.0: the machine was full)."""
        return self.machine_s / (self.wall_s * self.cores) if self.wall_s > 0 else 0.0

    def per_unit_us(self, units: int) -> dict[str, float]:
        """Microseconds of CPU per unit of work: ``machine``, each named tree, and ``other`` (the rest)."""
        if units <= 0:
            return {}
        out = {"machine": self.machine_s / units * 1e6}
        out.update({name: seconds / units * 1e6 for name, seconds in self.named_s.items()})
        out["other"] = max(0.0, self.machine_s - sum(self.named_s.values())) / units * 1e6
        return out


class CpuMeter:
    """Snapshots of the machine's CPU and of named process trees, given by their root pids
    (``self`` is this process)."""

    def __init__(self, named: Mapping[str, Callable[[], list[int]]]) -> None:
        self.named = dict(named)
        self.cores = os.cpu_count() or 1

    def sample(self) -> CpuSample:
        named = {}
        for name, pids in self.named.items():
            named[name] = sum(time.process_time() if pid == os.getpid() else tree_cpu_s(pid) for pid in pids())
        return CpuSample(time.monotonic(), machine_busy_s(), named)

    def since(self, before: CpuSample) -> CpuUse:
        after = self.sample()
        return CpuUse(after.wall_s - before.wall_s, after.machine_s - before.machine_s,
                      {name: after.named_s[name] - before.named_s.get(name, 0.0) for name in after.named_s},
                      self.cores)


def format_use(prefix: str, use: CpuUse, units: int, unit: str) -> list[str]:
    """``name=value`` lines: the machine's busy share and the CPU per ``unit`` of each part."""
    lines = [f"{prefix}machine_busy={use.busy:.2f}"]
    for name, value in use.per_unit_us(units).items():
        lines.append(f"{prefix}{name}_cpu_us_per_{unit}={value:.0f}")
    return lines
