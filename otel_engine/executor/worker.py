"""A tensor-parallel worker process: its model shard and a busy loop over ZMQ.

Every rank receives the same `ModelInput`, runs its shard (collectives over
torch.distributed, whose store rank 0 serves on the loopback address), and rank 0 returns the
sampled tokens. An exception in the loop is reported as `WorkerFailure` before the process
exits, so the engine core fails fast instead of waiting on a collective that will never
complete.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq
from opentelemetry.trace import Status, StatusCode

from otel_engine.config import Device, EngineConfig
from otel_engine.executor.model_runner import ModelRunner
from otel_engine.executor.responder import Responder
from otel_engine.ipc.codec import Codec, error_info
from otel_engine.ipc.messages import (
    ModelInput,
    WorkerFailure,
    WorkerRequest,
    WorkerResponse,
)
from otel_engine.ipc.paths import LOOPBACK, listening_socket, publish, wait_for
from otel_engine.ipc.process import ReadyChannel, process_title
from otel_engine.ipc.roles import ProcessRole
from otel_engine.memory import freeze_startup_objects
from otel_engine.model.limits import EngineLimits
from otel_engine.observability.faults import FaultPhase, maybe_inject
from otel_engine.observability.tracing import (
    extract_context,
    get_tracer,
    is_tracing,
    shutdown_telemetry,
)
from otel_engine.timing import LAST_FRAME_LINGER_S, TELEMETRY_FLUSH_S, WORKER_EXIT_LINGER_S

logger = logging.getLogger(__name__)


def run_worker(
    channel: ReadyChannel,
    config_bytes: bytes,
    model_dir: str,
    limits_bytes: bytes,
    rank: int,
    store_path: str,
    input_address: str,
    output_address: str,
    probe_address: str,
) -> None:
    """Process target of `otel-worker-{rank}`."""
    config = EngineConfig.decode(config_bytes)
    tp_size = config.parallel.tensor_parallel_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    backend = "nccl" if config.model.device == Device.CUDA else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = timedelta(seconds=config.timeouts.engine_ready_timeout)
    store = _rendezvous_store(rank, tp_size, store_path, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=tp_size, timeout=timeout)
    maybe_inject(ProcessRole.WORKER, phase=FaultPhase.LOAD, rank=rank)
    runner = ModelRunner(config, model_dir, EngineLimits.decode(limits_bytes), rank=rank)
    freeze_startup_objects()
    context = zmq.Context(io_threads=1)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    responder = Responder(rank, probe_address)
    channel.ready(
        fast_paths=runner.model.fast_paths.summary(), memory_bandwidth=runner.memory_bandwidth
    )
    logger.info("worker.ready", extra={"rank": rank})
    busy_loop(runner, rank, inputs, outputs, responder)
    responder.stop()
    inputs.close(linger=0)
    outputs.close(linger=int(1000 * WORKER_EXIT_LINGER_S))
    context.term()
    dist.destroy_process_group()
    shutdown_telemetry(timeout_s=TELEMETRY_FLUSH_S)


def _rendezvous_store(
    rank: int, tp_size: int, store_path: str, timeout: timedelta
) -> dist.TCPStore:
    """torch.distributed's store, on `LOOPBACK` only. Rank 0 serves it on a socket it bound
    and listens on before anyone learns the port (torch's own server would listen on every
    interface), then publishes the port at `store_path` for the other ranks."""
    if rank == 0:
        listener = listening_socket(LOOPBACK)
        port = int(listener.getsockname()[1])
        store = dist.TCPStore(
            LOOPBACK,
            port,
            tp_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store's server owns the socket now
        )
        publish(store_path, str(port))
        return store
    port = int(wait_for(store_path, time.monotonic() + timeout.total_seconds()))
    return dist.TCPStore(LOOPBACK, port, tp_size, is_master=False, timeout=timeout)


def busy_loop(
    runner: ModelRunner, rank: int, inputs: zmq.Socket, outputs: zmq.Socket, responder: Responder
) -> None:
    requests: Codec[WorkerRequest] = Codec(WorkerRequest)
    responses: Codec[WorkerResponse] = Codec(WorkerResponse)
    tracer = get_tracer()
    tracing = is_tracing()
    while True:
        message = requests.decode(inputs.recv(copy=False).buffer)
        if not isinstance(message, ModelInput):
            return
        span = None
        if tracing and message.trace_context:
            span = tracer.start_span(
                "worker.execute",
                context=extract_context(message.trace_context),
                attributes={
                    "otel_engine.step.id": message.step_id,
                    "otel_engine.worker.rank": rank,
                },
            )
        responder.step_id = message.step_id
        try:
            maybe_inject(
                ProcessRole.WORKER,
                phase=FaultPhase.RUN,
                rank=rank,
                step=message.step_id,
                num_requests=len(message.query_lens),
                num_tokens=len(message.input_ids),
                prompt_len=message.max_prompt_len,
            )
            sampled = runner.execute(message)
        except Exception as exc:
            logger.exception("worker.step_failed", extra={"rank": rank, "step": message.step_id})
            if span is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.end()
            info = error_info(exc, process_title(ProcessRole.WORKER, rank), rank=rank)
            outputs.send(responses.encode(WorkerFailure(rank, info, time.time())))
            # close() alone does not flush: terminating the context waits for delivery.
            inputs.close(linger=0)
            outputs.close(linger=int(1000 * LAST_FRAME_LINGER_S))
            outputs.context.term()
            shutdown_telemetry(timeout_s=TELEMETRY_FLUSH_S)
            os._exit(1)
        responder.step_id = None
        if span is not None:
            span.end()
        if rank == 0:
            outputs.send(responses.encode(sampled))
