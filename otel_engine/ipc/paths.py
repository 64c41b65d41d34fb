"""Where IPC endpoints live: a private 0700 directory per engine instance."""

from __future__ import annotations

import shutil
import socket
import tempfile


class IpcDir:
    """A fresh private directory for `ipc://` sockets; removed by `cleanup()`."""

    def __init__(self, instance_id: str, path: str | None = None) -> None:
        self.path = path or tempfile.mkdtemp(prefix=f"otel-engine-{instance_id[:24]}-")
        self.owned = path is None

    def address(self, name: str) -> str:
        return f"ipc://{self.path}/{name}"

    def cleanup(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)


def free_tcp_port() -> int:
    """A port on 127.0.0.1 that is free right now (for torch.distributed's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
