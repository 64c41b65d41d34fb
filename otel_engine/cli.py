"""`otel-engine serve | generate`: the command line (also `python -m otel_engine.cli`).

`build_parser()` is the single definition of the flags; docs/configuration.md is generated
from it (`docs/gen_configuration.py`). Engine flags map one to one onto
`EngineConfig.from_kwargs` fields. Telemetry is set up once here, before the engine starts
its children (which inherit the settings); `serve` flushes it on every way out.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from otel_engine.config import ConfigError, EngineConfig, LogFormat, choice_fields
from otel_engine.entrypoints.network.limits import CHARS_PER_TOKEN_BOUND, ServerLimits
from otel_engine.entrypoints.tools.base import ToolFormatName
from otel_engine.model.default_model import DEFAULT_MODEL
from otel_engine.observability.logging import adopt_library_loggers
from otel_engine.observability.setup import setup_main_process
from otel_engine.observability.tracing import shutdown_telemetry
from otel_engine.sampling_params import SamplingParams, apply_generation_defaults
from otel_engine.timing import TELEMETRY_FLUSH_S

if TYPE_CHECKING:
    pass

logger = logging.getLogger("otel_engine.api_server")

ENGINE_FLAGS = (
    "model",
    "served_model_name",
    "dtype",
    "device",
    "max_model_len",
    "seed",
    "kernels",
    "int4",
    "quant_activations",
    "generation_config",
    "override_generation_config",
    "block_size",
    "enable_prefix_caching",
    "num_kv_blocks",
    "kv_cache_memory_gib",
    "kv_cache_dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "speculative_method",
    "num_speculative_tokens",
    "ngram_min",
    "ngram_max",
    "speculative_model",
    "tensor_parallel_size",
    "distributed_executor_backend",
    "ray_address",
    "ray_placement_strategy",
    "ray_cpus_per_rank",
    "engine_ready_timeout",
    "step_timeout",
    "shutdown_timeout",
    "otlp_endpoint",
    "otlp_protocol",
    "log_format",
    "log_level",
    "otlp_logs",
    "log_prompts",
    "crash_history_steps",
    "crash_dump_dir",
)
# `serve` only: what the server does when its engine fails (engine/recovery.py).
RECOVERY_FLAGS = ("on_engine_failure", "max_engine_restarts", "engine_restart_window")


def _card_values() -> str:
    return ", ".join(f"{name} {value}" for name, value in DEFAULT_MODEL.card_defaults.items())


def _choices(name: str) -> list[str]:
    """The values of an engine flag's closed set (config.choice_fields)."""
    return [member.value for member in choice_fields()[name]]


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `generate`; None means the `EngineConfig` default."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        help=f"HF model directory or .gguf file (default: {DEFAULT_MODEL.served_name})",
    )
    model.add_argument(
        "--served-model-name", help="model name in the API (default: the model directory's name)"
    )
    model.add_argument(
        "--dtype",
        choices=_choices("dtype"),
        help="weight and activation dtype. auto: the checkpoint's, except that a bfloat16 or "
        "float16 checkpoint (a .gguf file counts as bfloat16) runs in float32 on a CPU "
        "without that dtype's arithmetic (AVX-512 BF16 / AMX for bfloat16), where torch "
        "only emulates it (kernels.selected says which and why; an explicit half-precision "
        "dtype there logs dtype.emulated with its measured cost). A .gguf file's float "
        "tensors and its blocks of the formats the engine reads are exact in float32; "
        "tensors of other formats are rounded to bfloat16 once (model.gguf_rounded says so)",
    )
    model.add_argument("--device", choices=_choices("device"), help="cpu or cuda")
    model.add_argument(
        "--kernels",
        choices=_choices("kernels"),
        help="auto: on CPU, the fast paths this CPU and torch can run: the compiled kernels "
        "(built with the system C compiler for the CPU's instruction set on first use) and "
        "oneDNN's prepacked weights, each where it applies, else torch ops (the start log's "
        "kernels.selected says which and why); torch: plain torch ops everywhere (default: auto)",
    )
    model.add_argument(
        "--int4",
        choices=_choices("int4"),
        help="auto: when --kernels is auto and the CPU has AVX-512 BF16, a GGUF file's layer "
        "matrices are multiplied as the file stores them, in place of bfloat16 copies: Q4_0 and "
        "Q4_1 layers of up to 256 MiB in all (or any, with --quant-activations bfloat16) by "
        "the 4-bit kernels (up to 16 tokens a step from the 4 bits; larger steps by tiles of "
        "the file's blocks where torch's matmul runs on AMX, else by bfloat16 panels built at "
        "load), larger ones and Q8_0, Q4_K, Q5_K and Q6_K from their blocks (up to 8 tokens in "
        "one pass over them, up to 48 in AMX tiles where the CPU has AMX, larger steps by "
        "tiles dequantized as they are used; no bfloat16 copy is kept), and with the latter "
        "the embedding and LM head in theirs; a float32 model on a CPU with AVX2 or more runs "
        "every such matrix from its blocks (see --quant-activations); off: copies of every "
        "matrix in the model dtype (default: auto)",
    )
    model.add_argument(
        "--quant-activations",
        choices=_choices("quant_activations"),
        help="with --int4 auto, how the activations meet a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, "
        "Q5_K and Q6_K blocks in steps of up to 8 tokens: int8: quantized to 8 bits per "
        "block of 256 (K-quants) or 32 (the others) and multiplied by integer dot products "
        "(AVX-512 VNNI), as llama.cpp does (one token's pass over a layer's blocks about twice "
        "as fast; each output's error within 2%% of its row's largest); in float32 the same "
        "way in steps of up to 64 tokens (AVX2 and up: vpmaddubsw, or VNNI), larger steps "
        "on the file's exact values with x exact (AVX2: a float32 GEMM fed from the blocks) "
        "or in 16 bits per 32 values (AVX-512: integer pairs); "
        "bfloat16 (a bfloat16 model's): "
        "multiplied as they are by the file's exact "
        "weights; float32 (a float32 model's): every GGUF matrix a dense float32 copy of the "
        "file's exact values (default: int8)",
    )
    model.add_argument(
        "--generation-config",
        choices=_choices("generation_config"),
        help="auto: requests that omit temperature, top_p, top_k, min_p or repetition_penalty "
        "get the model's generation_config.json values (the default model's card values: "
        f"{_card_values()}); none: the API's own defaults",
    )
    model.add_argument(
        "--override-generation-config",
        metavar="JSON",
        help="sampling defaults that win over the model's, e.g. '{\"temperature\": 0.7}'",
    )
    model.add_argument(
        "--max-model-len", type=int, metavar="N", help="context length (default: the model's)"
    )
    model.add_argument("--seed", type=int, help="engine seed for requests without one")
    model.add_argument(
        "--tensor-parallel-size", type=int, metavar="N", help="number of worker ranks"
    )
    model.add_argument(
        "--distributed-executor-backend",
        choices=_choices("distributed_executor_backend"),
        help="where the worker ranks run: mp, processes on this machine (default); ray, "
        "actors of a running Ray cluster, one placement-group bundle per rank, across its "
        "nodes (pip install 'otel-engine[ray]')",
    )
    model.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="the Ray cluster to join, as `ray start --address` takes it (default: "
        "$RAY_ADDRESS, else the cluster started on this machine with `ray start --head`)",
    )
    model.add_argument(
        "--ray-placement-strategy",
        choices=_choices("ray_placement_strategy"),
        help="how the ranks' bundles are spread over the nodes (default: PACK, as few nodes as "
        "fit; STRICT_SPREAD: one rank per node)",
    )
    model.add_argument(
        "--ray-cpus-per-rank",
        type=float,
        metavar="N",
        help="CPUs each rank's bundle asks of its node, and its torch threads (default: 1)",
    )
    cache = parser.add_argument_group("KV cache and batching")
    cache.add_argument("--block-size", type=int, metavar="N", help="tokens per KV block")
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="reuse the KV of prompt prefixes already computed (whole blocks), so that a "
        "resent conversation or a shared system prompt is not computed again",
    )
    cache.add_argument(
        "--num-kv-blocks", type=int, metavar="N", help="KV blocks (wins over --kv-cache-memory-gib)"
    )
    cache.add_argument(
        "--kv-cache-memory-gib", type=float, metavar="GIB", help="memory budget for the KV cache"
    )
    cache.add_argument(
        "--kv-cache-dtype",
        choices=_choices("kv_cache_dtype"),
        help="what the KV cache stores. auto: the dtype the model runs in, except float16 "
        "when a bfloat16 or float16 checkpoint (a .gguf file counts as bfloat16) runs in "
        "float32: half the cache's memory and reads, as llama.cpp's default f16 cache. "
        "float16 is also taken with --dtype float32; otherwise it must be the model's dtype",
    )
    cache.add_argument("--max-num-seqs", type=int, metavar="N", help="sequences per step")
    cache.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="tokens per step")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-method",
        choices=_choices("speculative_method"),
        help="verify several proposed tokens per decode step, exactly (greedy and seeded "
        "output as without it): ngram, tokens that followed the longest recent match of "
        "the request's own prompt and output; draft, a smaller model with the same "
        "tokenizer (--speculative-model). Default: off",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="most tokens proposed per request and step, in [1, 16] (default 8); each step "
        "verifies fewer where they would not pay: a request's proposals fail, or the batch "
        "is large enough that each verified token costs its share of the step",
    )
    spec.add_argument(
        "--ngram-min", type=int, metavar="N", help="shortest n-gram prompt lookup matches (2)"
    )
    spec.add_argument(
        "--ngram-max", type=int, metavar="N", help="longest n-gram prompt lookup matches (4)"
    )
    spec.add_argument(
        "--speculative-model",
        metavar="PATH",
        help="the draft model of --speculative-method draft: an HF directory or .gguf file "
        "with the model's tokenizer, e.g. the same model in a lower-bit format",
    )
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
        "--otlp-endpoint",
        metavar="URL",
        help="OTLP collector base URL for traces, metrics and (--otlp-logs) logs "
        "(default: the OTEL_EXPORTER_OTLP_* variables; none: no export)",
    )
    telemetry.add_argument(
        "--otlp-protocol",
        choices=_choices("otlp_protocol"),
        help="OTLP transport (default: $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)",
    )
    telemetry.add_argument(
        "--otlp-logs",
        action="store_true",
        default=None,
        help="also export log records over OTLP, tied to the active span",
    )
    telemetry.add_argument(
        "--log-format",
        choices=_choices("log_format"),
        help="json: one JSON object per line on stderr; console: for humans (default: serve "
        "json when stderr is not a terminal, else console; generate console)",
    )
    telemetry.add_argument(
        "--log-level",
        type=str.upper,
        choices=_choices("log_level"),
        help="root log level (default: INFO)",
    )
    telemetry.add_argument(
        "--log-prompts",
        action="store_true",
        default=None,
        help="DEBUG ONLY: log each request's prompt and stop strings (request.prompt); "
        "the only way prompt text ever reaches the logs",
    )
    telemetry.add_argument(
        "--crash-history-steps",
        type=int,
        metavar="N",
        help="steps the engine core keeps as plain numbers for the crash dump's history "
        "part (default 64; 0 disables)",
    )
    telemetry.add_argument(
        "--crash-dump-dir",
        metavar="DIR",
        help="also write each crash dump, with the engine config, to "
        "DIR/crash-<utc time>-<pid>.json (mode 0600) before clients get their errors",
    )


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """What one client may cost the server (`ServerLimits`; docs/operations.md)."""
    defaults = ServerLimits()
    limits = parser.add_argument_group("limits per client")
    limits.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        metavar="N",
        help="open HTTP connections; past it an idle one is closed for the new one, or the "
        "new one gets 503 too_many_connections (lowered to fit the descriptor limit)",
    )
    limits.add_argument(
        "--request-read-timeout",
        type=float,
        default=defaults.request_read_timeout,
        metavar="S",
        help="a connection must send a whole request (headers and body) within S seconds of "
        "its first byte, or it is closed (408)",
    )
    limits.add_argument(
        "--stream-write-timeout",
        type=float,
        default=defaults.stream_write_timeout,
        metavar="S",
        help="a response the client does not read for S seconds is aborted "
        "(error_type client_stalled)",
    )
    limits.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        metavar="N",
        help=f"longest prompt accepted, in characters, checked before tokenizing (default: "
        f"{CHARS_PER_TOKEN_BOUND} per token of context)",
    )


def _add_recovery_flags(parser: argparse.ArgumentParser) -> None:
    recovery = parser.add_argument_group("recovery")
    recovery.add_argument(
        "--on-engine-failure",
        choices=_choices("on_engine_failure"),
        help="when the engine core or a worker fails (an exception, a crash, an OOM kill, a "
        "hung step): shutdown fails every in-flight request (engine_dead) and exits 1; restart "
        "records the crash the same way, starts a new engine in this server and carries every "
        "in-flight request over as prompt + the tokens already sent, so its client gets what "
        "it would have got without the fault, later (a new request that fails the engine at "
        "its first step, again when tried alone, fails alone: engine_fault_request) "
        "(default: shutdown)",
    )
    recovery.add_argument(
        "--max-engine-restarts",
        type=int,
        metavar="N",
        help="with --on-engine-failure restart: at most N restarts in any "
        "--engine-restart-window; the next failure shuts down (default: 3)",
    )
    recovery.add_argument(
        "--engine-restart-window",
        type=float,
        metavar="S",
        help="the window of --max-engine-restarts, in seconds (default: 600)",
    )


def server_limits(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_prompt_chars=args.max_prompt_chars,
        max_connections=args.max_connections,
        request_read_timeout=args.request_read_timeout,
        stream_write_timeout=args.stream_write_timeout,
    )


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: `serve` and `generate` subcommands."""
    parser = argparse.ArgumentParser(
        prog="otel-engine",
        description="An LLM serving engine whose failures are observable and clean.",
        allow_abbrev=False,  # a typo'd flag in a manifest fails instead of matching a prefix
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server.",
        allow_abbrev=False,
    )
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind")
    server.add_argument("--port", type=int, default=8000, help="port to bind")
    server.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1; every local user can read it in the "
        "process list (a warning says so): prefer --api-key-file or $OTEL_ENGINE_API_KEY "
        "(default: $OTEL_ENGINE_API_KEY)",
    )
    server.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="read the API key from this file (its first line; a mounted secret)",
    )
    server.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="parse special tokens written in chat message content (and names) as control "
        "tokens, as before: a client can then forge turns of other roles (default: only the "
        "chat template's own markup yields control tokens)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=["auto", *ToolFormatName],
        default="auto",
        help="the format the model writes tool calls in: auto (from the chat template: hermes "
        "for <tool_call> markup as Qwen2.5's, llama3_json, mistral, phi4_mini; generic for a "
        "template with no tool format, which puts the tools in a system message and holds the "
        "answer to text or a JSON object of calls by a grammar)",
    )
    server.add_argument(
        "--vllm-metric-names",
        action="store_true",
        help="also show on /metrics the names vLLM's router, the Gateway API inference "
        "extension's endpoint picker and vLLM dashboards read (vllm:num_requests_waiting, "
        "vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:cache_config_info, ...: "
        "docs/observability.md), with the same values as the otel_engine_* families",
    )
    server.add_argument(
        "--final-scrape-wait",
        type=float,
        default=0.0,
        metavar="S",
        help="after an engine failure, keep /metrics up until one scrape has read the failure "
        "(at most S seconds) before exiting; set it above the Prometheus scrape interval "
        "(default: 0, exit at once)",
    )
    _add_limit_flags(serve)
    _add_recovery_flags(serve)
    _add_engine_flags(serve)

    generate = commands.add_parser(
        "generate",
        help="complete prompts offline and print them",
        description="Complete prompts offline and print them.",
        allow_abbrev=False,
    )
    generate.add_argument("prompts", nargs="*", metavar="PROMPT")
    generate.add_argument("--prompts-file", metavar="PATH", help="one prompt per line")
    generate.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    generate.add_argument(
        "--temperature",
        type=float,
        help="0 is greedy (default: the model's generation default, "
        "--override-generation-config included, as serve gives a request that omits it; "
        "with none, 1.0)",
    )
    generate.add_argument(
        "--chat",
        action="store_true",
        help="each prompt as a user message, rendered as the server renders chat messages",
    )
    _add_engine_flags(generate)

    replay = commands.add_parser(
        "replay",
        help="run the failing batch of a crash dump file again",
        description="Run the failing batch of a --crash-dump-dir file again, with synthetic "
        "token ids, and say whether it fails the same way (exit 0: reproduced, 1: no "
        "failure, 2: a different failure, 3: the dump cannot be replayed here). The engine "
        "config is the dump's; the flags given here win. Each request samples with the "
        "values the dump shows, except the fields --override-generation-config given here "
        "sets; the model's generation defaults fill only fields the dump lacks.",
        allow_abbrev=False,
    )
    replay.add_argument("file", metavar="FILE", help="a crash-<utc time>-<pid>.json file")
    _add_engine_flags(replay)
    return parser


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, as `EngineConfig.from_kwargs` keyword arguments;
    the log format defaults by command (`default_log_format`)."""
    options = {
        name: getattr(args, name)
        for name in ENGINE_FLAGS + RECOVERY_FLAGS
        if getattr(args, name, None) is not None
    }
    options.setdefault("log_format", default_log_format(args.command))
    return options


def default_log_format(command: str) -> LogFormat:
    """`serve`: json unless stderr (where logs go) is a terminal; `generate`: console."""
    if command == "serve" and not _is_terminal(sys.stderr):
        return LogFormat.JSON
    return LogFormat.CONSOLE


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def unsupported_platform(command: str, config: EngineConfig) -> str | None:
    """Why `command` cannot run on this system, before anything is started (None: it can).
    Child processes are supervised through Linux's pidfd_open: `serve` (whose engine core is
    a child) and tensor parallelism (its workers) need Linux; the in-process engine at one
    rank (`generate`, `LLM`) does not."""
    if hasattr(os, "pidfd_open"):
        return None
    needs = "serve" if command == "serve" else None
    if config.parallel.tensor_parallel_size > 1:
        needs = "--tensor-parallel-size > 1"
    if needs is None:
        return None
    return (
        f"{needs} needs Linux (its processes are supervised with pidfd_open, which "
        f"{sys.platform} lacks); the in-process engine (otel-engine generate, LLM) runs here "
        "with --tensor-parallel-size 1"
    )


def _fail(message: str) -> int:
    print(f"otel-engine: error: {message}", file=sys.stderr, flush=True)
    return 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from otel_engine import AsyncLLM
    from otel_engine.entrypoints.api_server import run_server
    from otel_engine.entrypoints.network.guard import ApiKeyError, resolve_api_key
    from otel_engine.entrypoints.network.server import bind_socket

    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file, os.environ)
    except ApiKeyError as error:
        return _fail(str(error))
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
        shutdown_telemetry(TELEMETRY_FLUSH_S)
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
        shutdown_telemetry(TELEMETRY_FLUSH_S)
        return _fail(f"engine startup failed: {type(error).__name__}: {error}")
    adopt_library_loggers()  # transformers & co. attach their own handlers on first use
    exit_code = 0
    try:
        logger.info(
            "engine.ready",
            extra={
                "model": engine.model_name,
                "max_model_len": engine.max_model_len,
                "tensor_parallel_size": config.parallel.tensor_parallel_size,
            },
        )
        exit_code = run_server(
            engine,
            sock,
            api_key=api_key,
            final_scrape_wait=args.final_scrape_wait,
            limits=server_limits(args),
            allow_special_tokens_in_content=args.allow_special_tokens_in_content,
            tool_call_parser=args.tool_call_parser,
            vllm_metric_names=args.vllm_metric_names,
        )
    except KeyboardInterrupt:
        logger.info("shutdown.begin", extra={"phase": "before_serving"})
    finally:
        engine.shutdown()
        logger.info("shutdown.complete", extra={"exit_code": exit_code})
        shutdown_telemetry(min(TELEMETRY_FLUSH_S, config.timeouts.shutdown_timeout))
    return exit_code


def generate(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from otel_engine import LLM
    from otel_engine.errors import OtelEngineError

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as file:
            prompts += [line.rstrip("\n") for line in file if line.strip()]
    if not prompts:
        return _fail("no prompts: give PROMPT arguments or --prompts-file")
    try:
        generate_params(args, {}).validate()  # a bad flag fails before the engine starts
        with LLM(**options) as llm:
            params = generate_params(args, llm.generation_defaults.values)
            if args.chat:
                outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
            else:
                outputs = llm.generate(prompts, params)
    except OtelEngineError as error:
        return _fail(f"{type(error).__name__}: {error}")
    for output in outputs:
        print(output.outputs[0].text, flush=True)
    return 0


def generate_params(args: argparse.Namespace, defaults: Mapping[str, float]) -> SamplingParams:
    """`generate`'s sampling parameters: the flags given, the model's generation `defaults`
    for the rest (`apply_generation_defaults`, as the server does for a request)."""
    given: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        given["temperature"] = args.temperature
    return apply_generation_defaults(given, defaults)


def flag_error(error: ConfigError, argv: Sequence[str]) -> str:
    """`error` in the user's words: the flag and the value as `argv` has them (the last
    time, as argparse takes it), or in the config's when no flag gave the value."""
    flag = "--" + error.field.replace("_", "-")
    for index in range(len(argv) - 1, -1, -1):
        token = argv[index]
        if token.startswith(flag + "="):
            return f"{flag} {error.rule}, got {token[len(flag) + 1 :]}"
        if token == flag and index + 1 < len(argv):
            return f"{flag} {error.rule}, got {argv[index + 1]}"
    return str(error)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    options = engine_options(args)
    try:
        config = EngineConfig.from_kwargs(**options)
    except ConfigError as error:
        parser.error(flag_error(error, argv))
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    problem = unsupported_platform(args.command, config)
    if problem is not None:
        return _fail(problem)
    setup_main_process(config)
    if args.command == "serve":
        return serve(args, config)
    if args.command == "replay":
        return _replay(args, options)
    return generate(args, options)


def _replay(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from otel_engine import replay

    given = {k: v for k, v in options.items() if k != "model"}
    try:
        code, line = replay.replay(args.file, args.model, given)
    except replay.ReplayError as error:
        print(f"replay: cannot replay: {error}", file=sys.stderr)
        return replay.UNUSABLE
    except (KeyError, TypeError, ValueError) as error:  # a dump missing what replay reads
        print(f"replay: cannot replay: {type(error).__name__}: {error}", file=sys.stderr)
        return replay.UNUSABLE
    print(line, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
