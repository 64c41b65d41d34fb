"""A tensor-parallel rank as a Ray actor (`--distributed-executor-backend ray`).

The actor is the rank: the same model shard, the same busy loop over ZMQ and the same
failure report as a local worker process (`executor/worker.py`), with TCP in place of the
local IPC sockets, since the engine core may be on another node. `RayExecutor` creates one per
placement-group bundle and calls, in order: `open_store` (rank 0: torch.distributed's store
on its node's address), `start` (join the process group, load the shard, connect to the core)
and `run` (the busy loop, on the actor's main thread, until `StopWorker`). The pending `run`
call is the rank's death sentinel: it fails when the actor's process or its node dies.

Its environment comes from the serve side (the actor's `runtime_env`): the observability
settings and `OTEL_*` variables of the engine, so its spans join the same traces and its
logs go where the engine's go, and `OTEL_ENGINE_FAULT` for the fault drills.
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray
import zmq

from otel_engine.config import Device, EngineConfig
from otel_engine.executor.responder import Responder
from otel_engine.ipc.paths import listening_socket
from otel_engine.ipc.roles import ProcessRole
from otel_engine.model.limits import EngineLimits
from otel_engine.observability.faults import FaultPhase, maybe_inject
from otel_engine.observability.setup import setup_process
from otel_engine.observability.tracing import shutdown_telemetry
from otel_engine.timing import TELEMETRY_FLUSH_S, WORKER_EXIT_LINGER_S

if TYPE_CHECKING:  # torch only where a rank runs: the engine core imports this module too
    import torch.distributed as dist

    from otel_engine.executor.model_runner import ModelRunner

NODE_ID_CHARS = 12  # enough of a Ray node id to find it in `ray status` / `ray list nodes`


def node_ip() -> str:
    """This node's address in the Ray cluster."""
    return str(ray.util.get_node_ip_address())


def describe_node(node: dict[str, Any]) -> str:
    """`127.0.0.1 (node 3f2a9c1d4e5b)`: the address and the start of the Ray node id."""
    return f"{node.get('node_ip', '?')} (node {str(node.get('node_id', '?'))[:NODE_ID_CHARS]})"


class RayWorker:
    """One rank (wrapped by `ray.remote` in `RayExecutor`, which sets its resources)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        setup_process(role=ProcessRole.WORKER, rank=rank)  # logging, exporters, fault injector
        self._store: dist.TCPStore | None = None
        self._runner: ModelRunner | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]] | None = None
        self._responder: Responder | None = None

    def node(self) -> dict[str, Any]:
        """Where this rank runs: the Ray node's id and address, its host name and pid."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": node_ip(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    def open_store(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0: serve torch.distributed's store on this node's address (a socket bound
        and listening before its port is handed out); return where the others find it."""
        import torch.distributed as dist

        host = node_ip()
        listener = listening_socket(host)
        port = int(listener.getsockname()[1])
        self._store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        return host, port

    def start(
        self,
        config_bytes: bytes,
        model_dir: str,
        limits_bytes: bytes,
        store_host: str,
        store_port: int,
        input_address: str,
        output_address: str,
    ) -> dict[str, Any]:
        """Join the process group, load this rank's shard, connect to the engine core and
        open the probe socket; return what the core needs (fast paths, probe address, node)."""
        import torch
        import torch.distributed as dist

        from otel_engine.executor.model_runner import ModelRunner

        config = EngineConfig.decode(config_bytes)
        tp_size = config.parallel.tensor_parallel_size
        torch.set_num_threads(max(1, int(config.parallel.ray_cpus_per_rank)))
        backend = "nccl" if config.model.device == Device.CUDA else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray makes the bundle's GPU the only one visible
        timeout = timedelta(seconds=config.timeouts.engine_ready_timeout)
        store = self._store or dist.TCPStore(
            store_host, store_port, tp_size, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=tp_size, timeout=timeout
        )
        maybe_inject(ProcessRole.WORKER, phase=FaultPhase.LOAD, rank=self.rank)
        limits = EngineLimits.decode(limits_bytes)
        self._runner = ModelRunner(config, model_dir, limits, rank=self.rank)
        self._context = zmq.Context(io_threads=1)
        inputs = self._context.socket(zmq.PULL)
        inputs.connect(input_address)
        outputs = self._context.socket(zmq.PUSH)
        outputs.connect(output_address)
        self._sockets = (inputs, outputs)
        self._responder = Responder(self.rank, f"tcp://{node_ip()}:*", describe_node(self.node()))
        return {
            "fast_paths": self._runner.model.fast_paths.summary(),
            "memory_bandwidth": self._runner.memory_bandwidth,
            "probe_address": self._responder.address,
            **self.node(),
        }

    def run(self) -> None:
        """The busy loop until `StopWorker`; a failed step reports and exits the actor's
        process (as a local worker does), which fails this call for the core."""
        import torch.distributed as dist

        from otel_engine.executor.worker import busy_loop

        if self._runner is None or self._sockets is None or self._responder is None:
            raise RuntimeError("RayWorker.run before start")
        assert self._context is not None
        inputs, outputs = self._sockets
        self._responder.watch(threading.get_ident())
        busy_loop(self._runner, self.rank, inputs, outputs, self._responder)
        self._responder.stop()
        inputs.close(linger=0)
        outputs.close(linger=int(1000 * WORKER_EXIT_LINGER_S))
        self._context.term()
        dist.destroy_process_group()
        shutdown_telemetry(timeout_s=TELEMETRY_FLUSH_S)
