"""`otel-engine serve | generate`: the command line (also `python -m otel_engine.cli`).

`build_parser()` is the single definition of the flags; the docs are generated from it.
Engine flags map one to one onto `EngineConfig.from_kwargs` fields.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from otel_engine.config import DEVICES, DTYPES, EngineConfig
from otel_engine.observability.setup import setup_process

logger = logging.getLogger("otel_engine.api_server")

ENGINE_FLAGS = (
    "model",
    "served_model_name",
    "dtype",
    "device",
    "max_model_len",
    "seed",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory_gib",
    "max_num_seqs",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "engine_ready_timeout",
    "step_timeout",
    "shutdown_timeout",
    "otlp_endpoint",
    "otlp_protocol",
    "log_format",
    "log_level",
)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `generate`; None means the `EngineConfig` default."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    model.add_argument(
        "--served-model-name", help="model name in the API (default: the model directory's name)"
    )
    model.add_argument("--dtype", choices=DTYPES, help="weight and activation dtype")
    model.add_argument("--device", choices=DEVICES, help="cpu or cuda")
    model.add_argument(
        "--max-model-len", type=int, metavar="N", help="context length (default: the model's)"
    )
    model.add_argument("--seed", type=int, help="engine seed for requests without one")
    model.add_argument(
        "--tensor-parallel-size", type=int, metavar="N", help="number of worker ranks"
    )
    cache = parser.add_argument_group("KV cache and batching")
    cache.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block")
    cache.add_argument(
        "--num-kv-blocks", type=int, metavar="N", help="KV blocks (wins over --kv-cache-memory-gib)"
    )
    cache.add_argument(
        "--kv-cache-memory-gib", type=float, metavar="GIB", help="memory budget for the KV cache"
    )
    cache.add_argument("--max-num-seqs", type=int, metavar="N", help="sequences per step")
    cache.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="tokens per step")
    timeouts = parser.add_argument_group("timeouts (seconds)")
    timeouts.add_argument(
        "--engine-ready-timeout", type=float, metavar="S", help="how long startup may take"
    )
    timeouts.add_argument(
        "--step-timeout",
        type=float,
        metavar="S",
        help="step watchdog: a step longer than this is a hang",
    )
    timeouts.add_argument(
        "--shutdown-timeout", type=float, metavar="S", help="drain and shutdown deadline"
    )
    telemetry = parser.add_argument_group("telemetry")
    telemetry.add_argument(
        "--otlp-endpoint", metavar="URL", help="OTLP collector (default: the OTEL_* variables)"
    )
    telemetry.add_argument("--otlp-protocol", choices=("grpc", "http/protobuf"))
    telemetry.add_argument("--log-format", choices=("json", "console"))
    telemetry.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: `serve` and `generate` subcommands."""
    parser = argparse.ArgumentParser(
        prog="otel-engine",
        description="An LLM serving engine whose failures are observable and clean.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server.",
    )
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind")
    server.add_argument("--port", type=int, default=8000, help="port to bind")
    server.add_argument(
        "--api-key",
        default=os.environ.get("OTEL_ENGINE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $OTEL_ENGINE_API_KEY)",
    )
    _add_engine_flags(serve)

    generate = commands.add_parser(
        "generate",
        help="complete prompts offline and print them",
        description="Complete prompts offline and print them.",
    )
    generate.add_argument("prompts", nargs="*", metavar="PROMPT")
    generate.add_argument("--prompts-file", metavar="PATH", help="one prompt per line")
    generate.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    _add_engine_flags(generate)
    return parser


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, as `EngineConfig.from_kwargs` keyword arguments."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}


def _fail(message: str) -> int:
    print(f"otel-engine: error: {message}", file=sys.stderr, flush=True)
    return 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from otel_engine import AsyncLLM
    from otel_engine.entrypoints.api_server import bind_socket, run_server

    try:
        sock = bind_socket(args.host, args.port)
    except OSError as error:
        return _fail(f"cannot bind {args.host}:{args.port}: {error.strerror or error}")
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        engine = AsyncLLM.from_config(config)
    except KeyboardInterrupt:
        sock.close()
        logger.info("shutdown.complete", extra={"phase": "startup"})
        return 0
    except Exception as error:
        sock.close()
        logger.error(
            "engine.startup_failed",
            exc_info=error,
            extra={
                "failed_process": getattr(error, "failed_process", ""),
                "child_traceback": getattr(error, "traceback", ""),
            },
        )
        return _fail(f"engine startup failed: {type(error).__name__}: {error}")
    exit_code = 0
    try:
        logger.info(
            "engine.ready",
            extra={"model": engine.model_name, "max_model_len": engine.max_model_len},
        )
        exit_code = run_server(engine, sock, api_key=args.api_key)
    except KeyboardInterrupt:
        logger.info("shutdown.begin", extra={"phase": "before_serving"})
    finally:
        engine.shutdown()
        logger.info("shutdown.complete", extra={"exit_code": exit_code})
    return exit_code


def generate(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from otel_engine import LLM, SamplingParams
    from otel_engine.errors import OtelEngineError

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as file:
            prompts += [line.rstrip("\n") for line in file if line.strip()]
    if not prompts:
        return _fail("no prompts: give PROMPT arguments or --prompts-file")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    try:
        params.validate()
        with LLM(**options) as llm:
            inputs: list[str] | list[list[int]] = prompts
            if args.chat:
                inputs = [_chat_prompt(llm.tokenizer, prompt) for prompt in prompts]
            outputs = llm.generate(inputs, params)
    except OtelEngineError as error:
        return _fail(f"{type(error).__name__}: {error}")
    for output in outputs:
        print(output.outputs[0].text, flush=True)
    return 0


def _chat_prompt(tokenizer: Any, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = engine_options(args)
    try:
        config = EngineConfig.from_kwargs(**options)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    setup_process(role="api_server", level=config.observability.log_level)
    if args.command == "serve":
        return serve(args, config)
    return generate(args, options)


if __name__ == "__main__":
    sys.exit(main())
