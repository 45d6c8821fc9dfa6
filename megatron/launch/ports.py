"""master_port for a launch that names none: a free one on this machine, where no other program is handed it.

A busy-port check alone cannot keep apart two runs started seconds apart on one default port: the second passes
it while the first has not bound its store yet. So a launch from this machine that sets no master_port gets a
random free port below the kernel's range for outgoing connections (so no connection's local end takes it
meanwhile); a run that still meets another on its port is stopped by the launch identity every rank checks
(megatron/runtime/rendezvous.py).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from megatron.config.schema import GPT_NEOX_PORT

LOWEST = 20000


def master_port(cfg) -> int:
    """The config's master_port, or GPT-NeoX's where nothing chose one (a config not resolved by deepy.py)."""
    return cfg.master_port if cfg.master_port is not None else GPT_NEOX_PORT


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def is_free(port: int) -> bool:
    """Whether rank 0's store could bind `port` on this machine now (TIME_WAIT connections do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def free_port(rng: random.Random | None = None) -> int:
    """A random free port in [20000, the kernel's ephemeral range)."""
    rng = rng or random.SystemRandom()
    top = max(_ephemeral_start(), LOWEST + 1000)
    for _ in range(200):
        port = rng.randrange(LOWEST, top)
        if is_free(port):
            return port
    raise OSError(f"no free port found between {LOWEST} and {top}; set master_port= to one")
