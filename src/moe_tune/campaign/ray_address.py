"""Whether the Ray cluster at `--ray ADDRESS` can be reached, found out within a bounded time before Ray is
asked to connect: `ray.init` retries an unreachable address for minutes, and its log names the address Ray
rewrote (a loopback address becomes the node's own), not the one the user gave.

Imports no Ray: a wrong address fails without paying for Ray's import.
"""

from __future__ import annotations

import socket
import time

from moe_tune.core import settings
from moe_tune.core.errors import MoeTuneError

RETRY_S = 0.5  # between connection attempts


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `HOST:PORT` or `ray://HOST:PORT` (IPv6 in brackets); None for an address without a
    port that Ray resolves itself (`auto`, a cluster found through `RAY_ADDRESS`)."""
    text = address.removeprefix("ray://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def wait_reachable(address: str, timeout_s: float | None = None) -> None:
    """Return once a TCP connection to `address` succeeds; MoeTuneError naming `address` (as given) when none
    does within `timeout_s` (default `$MOE_TUNE_RAY_CONNECT_TIMEOUT`, `settings.ray_connect_timeout`)."""
    target = host_port(address)
    if target is None:
        return
    timeout_s = settings.ray_connect_timeout() if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection(target, timeout=max(min(left, 5.0), 0.1)):
                return
        except OSError as e:
            why = e.strerror or type(e).__name__
        if time.monotonic() + RETRY_S >= deadline:
            raise MoeTuneError(f"cannot reach the Ray cluster at {address} within {timeout_s:g} s ({why}): is "
                               f"`ray start --head` running there? (${settings.RAY_CONNECT_TIMEOUT} sets the wait)")
        time.sleep(RETRY_S)
