"""A port for a server that a test starts later (a torchrun agent, SLURM's daemons).

Binding port 0 and closing it again hands out a port from the kernel's ephemeral range, where any
outgoing connection on the machine (another test run's gloo pairs) may take it before the server
listens (EADDRINUSE). Ports below that range are only ever taken by an explicit bind, but one
can still be taken between this check and the server's own bind (by another test run's server):
a caller that cannot hand its server a bound socket starts it again on fresh ports when it reports
the port taken (the SLURM cluster of tests/launch/conftest.py). Where a server can meet its clients
on a store the test holds, no port is picked at all (tests/parallel/process_group.py,
tests/data/test_multinode_cache.py)."""
import random
import socket
from pathlib import Path

LOWEST = 20000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def unclaimed_ports(count: int) -> list:
    """`count` different free ports below the ephemeral range (below 21000 at least, where the
    range starts that low)."""
    high = max(_ephemeral_start(), LOWEST + 1000)
    ports = []
    for port in random.sample(range(LOWEST, high), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"fewer than {count} free ports among 200 tried in [{LOWEST}, {high})")
