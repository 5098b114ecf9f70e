"""A server's emulated compute on a shared CPU machine: a CPU-time quota (cgroup v1 `cpu` controller) and a
core set (affinity), so servers stop contending for the same cores and a "compute-dense" prefill server can be
given more compute than a local one, the way an H200 prefill node has more than an H20.

    share = CpuShare(cores=1.5, cpus=(0, 1))     # 1.5 cores of CPU time per second, on cores 0 and 1
    group = CpuGroup("prefill-30000", share)       # /sys/fs/cgroup/cpu/prfaas/prefill-30000
    group.create()                                 # CpuShareError naming what is missing (root, controller, cores)
    cmd = group.wrap(cmd)                          # sh joins the group, taskset pins, then exec: same pid
    ...
    group.remove()                                 # after the server's processes are gone

The wrapper joins before the command starts, so every process the server forks later (SGLang's scheduler and
detokenizer) is in the group and on the cores too. It goes outside `ip netns exec`, which mounts a sysfs of
its own where this cgroup tree is not visible.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000  # the quota's accounting period: 100 ms, the kernel's default


class CpuShareError(RuntimeError):
    """The share cannot be applied here; the message says what to change."""


@dataclass(frozen=True)
class CpuShare:
    """`cores`: CPU time per wall-clock second, in cores (None: no cap); `cpus`: the cores the server may run
    on (empty: any)."""

    cores: float | None = None
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.cores is not None and not self.cores > 0:
            raise ValueError(f"cpu cores={self.cores}: give a CPU-time share > 0 (e.g. 0.5 = half a core)")
        if any(not isinstance(c, int) or c < 0 for c in self.cpus) or len(set(self.cpus)) != len(self.cpus):
            raise ValueError(f"cpus={self.cpus}: give distinct core numbers >= 0")

    @property
    def quota_us(self) -> int:
        return -1 if self.cores is None else max(1000, round(self.cores * PERIOD_US))


def problem(share: CpuShare, root: Path = CGROUP_CPU) -> str | None:
    """Why `share` cannot be applied on this machine, or None."""
    if share.cores is not None:
        if not (root / "cpu.cfs_quota_us").exists():
            return (f"a CPU quota needs the cgroup v1 cpu controller at {root} (cpu.cfs_quota_us missing); "
                    f"drop the quota or run where it is mounted")
        if not os.access(root, os.W_OK):
            return f"a CPU quota needs write access to {root}: run as root, or drop the quota"
    if share.cpus:
        have = os.cpu_count() or 1
        missing = [c for c in share.cpus if c >= have]
        if missing:
            return f"cores {missing} do not exist here: this machine has {have} (0..{have - 1})"
        if shutil.which("taskset") is None:
            return "a core set needs taskset (util-linux); install it or drop cpus"
    return None


class CpuGroup:
    """One server's cgroup under `root`/prfaas/ and the command prefix that puts the server in it.

    `cap_when_healthy`: the group starts uncapped and `cap()` applies the quota once the server serves. The
    share emulates serving hardware; loading torch and the model is not what it models, and under a 0.12-core
    quota a CPU SGLang server's ~60 s start-up would take ~8 minutes. The core set, unlike the quota, applies
    from the start: torch sizes its OpenMP pool from the cores it may run on, and a 2-thread pool pinned to one
    core afterwards prefilled at ~125 tokens/s against ~3,600 (its threads spin in barriers waiting for each
    other)."""

    def __init__(self, name: str, share: CpuShare, root: Path = CGROUP_CPU, cap_when_healthy: bool = False) -> None:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"cgroup name {name!r}: one path component")
        self.share, self.path = share, root / "prfaas" / name
        self._root, self.cap_when_healthy = root, cap_when_healthy

    def create(self) -> None:
        why = problem(self.share, self._root)
        if why:
            raise CpuShareError(why)
        if self.share.cores is None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self.set_cores(None if self.cap_when_healthy else self.share.cores)

    def cap(self) -> None:
        """Apply the share's quota (a group created with `cap_when_healthy` runs uncapped until then)."""
        if self.share.cores is not None and self.path.exists():
            self.set_cores(self.share.cores)

    def set_cores(self, cores: float | None) -> None:
        """Change the running group's quota (None: uncapped); the profiling step measures one server under
        several shares this way."""
        quota = -1 if cores is None else CpuShare(cores).quota_us
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def cores(self) -> float | None:
        """The quota in force, in cores (None: uncapped)."""
        q = int((self.path / "cpu.cfs_quota_us").read_text())
        return None if q < 0 else q / PERIOD_US

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` started inside the group and on the cores; `exec` keeps the pid (and its death signal)."""
        if self.share.cpus:
            cmd = ["taskset", "-c", ",".join(map(str, self.share.cpus)), *cmd]
        if self.share.cores is None:
            return cmd
        join = f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"'
        return ["sh", "-c", join, "sh", *cmd]

    def pids(self) -> list[int]:
        procs = self.path / "cgroup.procs"
        return [int(p) for p in procs.read_text().split()] if procs.exists() else []

    def remove(self) -> bool:
        """Remove the group once its processes are gone; False (and the group kept) while some still run."""
        if not self.path.exists():
            return True
        if self.pids():
            return False
        self.path.rmdir()
        return True
