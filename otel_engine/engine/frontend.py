"""What `LLM` and `AsyncLLM` share: model files, tokenizer, input and output processing."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from otel_engine.config import EngineConfig, EngineFailureMode
from otel_engine.engine import generation_defaults
from otel_engine.engine.core_client import CoreClient, InprocClient, MPClient, spare_core
from otel_engine.engine.input import InputProcessor
from otel_engine.engine.output import OutputProcessor
from otel_engine.engine.validation import describe_context
from otel_engine.errors import EngineDeadError
from otel_engine.ipc.messages import AddRequest, EngineDead
from otel_engine.ipc.process import Standby
from otel_engine.model.arch import load_model_arch
from otel_engine.model.default_model import DEFAULT_MODEL
from otel_engine.model.gguf import ROUNDED_KEY
from otel_engine.model.limits import LimitedBy, choose_dtype
from otel_engine.model.loader import is_gguf, load_tokenizer, prepare_model_dir
from otel_engine.model.tokenizer import TokenizerLike
from otel_engine.observability import faults
from otel_engine.observability.tracing import inject_context
from otel_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def dead_error(dead: EngineDead) -> EngineDeadError:
    """The client-facing error for a fatal engine failure (no traceback in the message)."""
    info = dead.error
    where = f" in {info.process}" if info.process else ""
    return EngineDeadError(
        f"the engine failed{where}: {info.type}: {info.message}",
        cause_type=info.type,
        failed_process=info.process,
        traceback=info.traceback,
        crash_context=dict(dead.trace_context),
        location=info.location,
    )


def _gguf_rounded(model_dir: str) -> int:
    """How many tensors a GGUF file's conversion rounded to bfloat16 (config.json says)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f).get(ROUNDED_KEY, 0))


class Frontend:
    """Model files, tokenizer and the engine client, set up once per engine instance."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        faults.configure()
        self.model_dir = prepare_model_dir(config.model.model)
        self.model_name = config.model.served_model_name or _default_name(
            config.model.model, self.model_dir
        )
        self.tokenizer: TokenizerLike = load_tokenizer(self.model_dir)
        self.generation_defaults = generation_defaults.for_config(config, self.model_dir)
        logger.info("model.generation_defaults", extra=self.generation_defaults.as_dict())
        arch = load_model_arch(self.model_dir)
        rounded = _gguf_rounded(self.model_dir) if is_gguf(config.model.model) else 0
        if rounded and choose_dtype(config, arch).name == "float32":
            logger.warning(
                "model.gguf_rounded",
                extra={
                    "dtype": "float32",
                    "tensors": rounded,
                    "reason": "tensors of formats the engine does not read in blocks are "
                    "converted to bfloat16 once: float32 computes on those rounded values",
                },
            )
        self.client: CoreClient = (
            MPClient(config, self.model_dir)
            if config.parallel.multiprocess
            else InprocClient(config, self.model_dir)
        )
        self.max_model_len: int = self.client.max_model_len
        self.context_limited_by = self.client.limits.limited_by
        self.num_kv_blocks: int = self.client.limits.num_kv_blocks
        if self.context_limited_by == LimitedBy.KV_CACHE:
            logger.warning(
                "model.context_capped",
                extra={
                    "max_model_len": self.max_model_len,
                    "model_max_len": config.model.max_model_len or arch.max_position_embeddings,
                    "reason": describe_context(self.max_model_len, LimitedBy.KV_CACHE),
                },
            )
        self.fast_paths: dict[str, Any] | None = self.client.fast_paths
        self.memory_bandwidth = self.client.memory_bandwidth  # rank 0's measured peak
        self.inputs = InputProcessor(
            self.tokenizer, self.max_model_len, arch.vocab_size, self.context_limited_by
        )
        self.outputs = OutputProcessor(self.tokenizer)
        # A server that restarts its engine keeps the next engine core's process ready.
        self._spare_lock = threading.Lock()
        self._is_shut_down = False
        self._spare: Standby | None = None
        if self._keeps_spare():
            self._spare = spare_core(config)

    def _keeps_spare(self) -> bool:
        recovery = self.config.recovery
        return self.config.parallel.multiprocess and (
            recovery.on_engine_failure == EngineFailureMode.RESTART
        )

    def next_client(self, restarts: int) -> MPClient:
        """A new engine (a restart; `restarts` engines were started before it) in the spare
        engine core process, and the next spare started."""
        with self._spare_lock:
            standby = self._spare
            self._spare = None if self._is_shut_down else spare_core(self.config)
        if standby is not None and not standby.is_ready():  # still importing, or killed
            logger.warning(
                "engine.spare_not_ready",
                extra={"exitcode": standby.popen.poll(), "restart": restarts},
            )
            standby.close()
            standby = None
        return MPClient(self.config, self.model_dir, restarts=restarts, standby=standby)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        token_ids: list[int] | None = None,
    ) -> None:
        """Validate (unless `token_ids` were already validated), register with the output
        processor, send to the engine core. Nothing stays registered if sending fails."""
        if request_id in self.outputs.states:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if token_ids is None:
            token_ids = self.inputs.process(prompt, params)
        arrival = time.time()
        self.outputs.add(
            request_id, token_ids, params, prompt if isinstance(prompt, str) else None, arrival
        )
        try:
            self.client.add_request(
                AddRequest(request_id, token_ids, params, arrival, inject_context())
            )
        except BaseException:
            self.outputs.remove(request_id)
            raise

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.outputs.remove(request_id)
        self.client.abort_requests(request_ids)

    def shutdown(self) -> None:
        self.client.shutdown()
        with self._spare_lock:
            self._is_shut_down = True
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()


def _default_name(model: str | None, model_dir: str) -> str:
    if model is None:
        return DEFAULT_MODEL.served_name
    base = os.path.basename(os.path.normpath(model))
    return base.removesuffix(".gguf") or os.path.basename(model_dir)
