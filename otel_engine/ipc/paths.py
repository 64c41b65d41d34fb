"""Where IPC endpoints live: a private 0700 directory per engine instance.

It also holds each child's faulthandler report (`fault-<process name>`, written by the
child, read by its parent when the child dies of a signal), and the port of the tensor-parallel
workers' torch.distributed store (`dist-store-port`, published by rank 0). Every TCP socket
the engine's processes listen on is on `LOOPBACK`."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

from otel_engine.timing import PUBLISH_POLL_S

# Every rank runs on this machine: torch.distributed's store and the collectives' sockets
# listen here, never on an address other machines can reach.
LOOPBACK = "127.0.0.1"


class IpcDir:
    """A fresh private directory for `ipc://` sockets and fault reports; removed by
    `cleanup()`."""

    def __init__(self, instance_id: str, path: str | None = None) -> None:
        self.path = path or tempfile.mkdtemp(prefix=f"otel-engine-{instance_id[:24]}-")
        self.owned = path is None

    def address(self, name: str) -> str:
        return f"ipc://{self.path}/{name}"

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def cleanup(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)


def listening_socket(host: str = LOOPBACK) -> socket.socket:
    """A TCP socket bound to a port the kernel picks on `host`, already listening: the port
    is this process's from the pick on, with no window for another process to take it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def loopback_env() -> dict[str, str]:
    """The variables that keep the collectives' own sockets (gloo's pairs, NCCL's bootstrap)
    on the loopback interface, where every rank is; an operator's own setting wins."""
    return {
        name: os.environ.get(name) or "lo" for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    }


def publish(path: str, value: str) -> None:
    """Write `value` to `path` at once for readers polling with `wait_for` (a reader never
    sees a partly written file)."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(value)
    os.replace(partial, path)


def wait_for(path: str, deadline: float) -> str:
    """The value `publish`ed at `path`, polled until `deadline` (time.monotonic())."""
    while True:
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing was published at {path} in time") from None
            time.sleep(PUBLISH_POLL_S)
