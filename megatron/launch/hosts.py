"""Whether a host name means this machine, which decides if reaching it needs ssh."""

from __future__ import annotations

import socket

_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def is_local_host(host: str) -> bool:
    if host in _LOCAL_NAMES or host == socket.gethostname():
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False
