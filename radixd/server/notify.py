"""systemd's notify protocol over ``$NOTIFY_SOCKET`` (READY, STOPPING, WATCHDOG, STATUS),
written directly: one datagram per message, no dependency."""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``) to systemd; False if not run under it."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(addr)
            sock.sendall(message.encode())
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of systemd's ``WatchdogSec`` (seconds) if the watchdog is on for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
