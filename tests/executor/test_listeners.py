"""What a tensor-parallel server listens on: the HTTP port where the operator put it, every
other socket (the rendezvous store, gloo's pairs) on the loopback address only."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import psutil
import pytest

from otel_engine.ipc.paths import loopback_env
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts a server and its worker processes


def listeners(server: ServerProcess) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of the server's process tree."""
    found = []
    for proc in [psutil.Process(server.pid), *server.descendants()]:
        try:
            sockets = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        found += [
            (proc.pid, s.laddr.ip, s.laddr.port) for s in sockets if s.status == psutil.CONN_LISTEN
        ]
    return sorted(found)


@pytest.fixture
def tp2_server(tiny_model_dir: str) -> Iterator[ServerProcess]:
    """A TP=2 server whose HTTP port is bound to every interface (`--host 0.0.0.0`)."""
    args = ["--model", tiny_model_dir, "--num-kv-blocks", "64", "--tensor-parallel-size", "2"]
    server = ServerProcess([*args, "--host", "0.0.0.0"]).start()
    try:
        server.wait_healthy(timeout=180)
        yield server
    finally:
        server.cleanup()


def test_only_the_http_port_listens_beyond_loopback_at_tp2(tp2_server: ServerProcess) -> None:
    """Everything but the HTTP port listens on 127.0.0.1: nobody on the network can reach
    the torch.distributed store or the collectives' sockets."""
    found = listeners(tp2_server)
    exposed = [entry for entry in found if not ipaddress.ip_address(entry[1]).is_loopback]
    assert [(tp2_server.pid, "0.0.0.0", tp2_server.port)] == exposed, found
    assert len(found) > 1, found  # the store and gloo's sockets are there, on loopback


def test_an_operators_socket_interface_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GLOO_SOCKET_IFNAME the operator set is kept; the unset NCCL one defaults to `lo`."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "lo"} == loopback_env()
