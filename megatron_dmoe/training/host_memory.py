"""The memory a CPU run's processes can still take on this machine: what the kernel calls available
(free memory and caches it can drop), capped by the memory limit of the cgroup the process runs in
(a container's, a SLURM job's), whichever is smaller."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

_CGROUP = Path("/sys/fs/cgroup")


def _cgroup_room() -> Optional[int]:
    """The cgroup's limit less its usage (cgroup v2, or v1's memory controller); None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (_CGROUP / limit_file).read_text().strip()
            usage = int((_CGROUP / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 2**60:  # v1 writes a huge number for none
            return None
        return max(int(limit) - usage, 0)
    return None


def available_host_bytes() -> int:
    import psutil

    available = psutil.virtual_memory().available
    room = _cgroup_room()
    return available if room is None else min(available, room)
