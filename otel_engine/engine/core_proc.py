"""The engine core process (`otel-engine-core`): the step loop behind two ZMQ sockets.

Inputs (AddRequest, AbortRequests, Shutdown) arrive on a PULL socket; each step's
`StepOutputs` leave on a PUSH socket. Any exception in the loop, including a worker's
failure surfaced by the executor, becomes one `EngineDead` frame to the front end before the
process shuts its workers down and exits 1.
"""

from __future__ import annotations

import logging
import os

import zmq

from otel_engine.config import EngineConfig
from otel_engine.engine.core import EngineCore
from otel_engine.ipc.codec import Codec, error_info
from otel_engine.ipc.messages import (
    AbortRequests,
    AddRequest,
    CoreOutput,
    CoreRequest,
    EngineDead,
    StepOutputs,
)
from otel_engine.ipc.paths import IpcDir
from otel_engine.ipc.process import ReadyChannel

logger = logging.getLogger(__name__)

PROCESS_NAME = "engine_core"
_IDLE_POLL_MS = 200


def run_engine_core(
    channel: ReadyChannel,
    config_bytes: bytes,
    model_dir: str,
    ipc_path: str,
    input_address: str,
    output_address: str,
) -> None:
    """Process target of `otel-engine-core`."""
    config = EngineConfig.decode(config_bytes)
    ipc_dir = IpcDir(config.instance_id, path=ipc_path)
    core = EngineCore(config, model_dir, ipc_dir)
    context = zmq.Context(io_threads=1)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    channel.ready(
        max_model_len=core.limits.max_model_len,
        num_kv_blocks=core.limits.num_kv_blocks,
    )
    logger.info("engine.ready", extra={"role": "engine_core"})
    exit_code = 0
    encoder: Codec[CoreOutput] = Codec(CoreOutput)
    try:
        _busy_loop(core, inputs, outputs, encoder)
    except Exception as exc:
        exit_code = 1
        logger.exception("engine.failed")
        info = error_info(exc, getattr(getattr(exc, "info", None), "process", "") or PROCESS_NAME)
        outputs.send(encoder.encode(EngineDead(error=info)))
    finally:
        core.shutdown()
        inputs.close(linger=0)
        outputs.close(linger=2000)
        context.term()
    logger.info("engine.stopped", extra={"exit_code": exit_code})
    if exit_code:
        os._exit(exit_code)


def _busy_loop(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, encoder: Codec[CoreOutput]) -> None:
    decoder: Codec[CoreRequest] = Codec(CoreRequest)
    executor = core.executor
    while True:
        if not core.has_work:
            while not inputs.poll(_IDLE_POLL_MS):
                executor.check_health()
        while inputs.poll(0):
            message = decoder.decode(inputs.recv(copy=False).buffer)
            if isinstance(message, AddRequest):
                rejected = core.add_request(message)
                if rejected is not None:
                    outputs.send(encoder.encode(StepOutputs(step_id=0, updates=[rejected])))
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
            else:
                return
        if core.has_work:
            step_outputs = core.step()
            if step_outputs.updates:
                outputs.send(encoder.encode(step_outputs))
