"""`otel-engine serve | generate`: the flags, offline generation, and the server's lifecycle."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_engine import LLM, SamplingParams
from otel_engine.cli import build_parser, engine_options, main
from otel_engine.config import EngineConfig
from tests.helpers.procs import ServerProcess, free_port

pytestmark = pytest.mark.slow  # starts servers or engine processes

CORE_SERVE_FLAGS = {
    "--model",
    "--host",
    "--port",
    "--tensor-parallel-size",
    "--dtype",
    "--device",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--block-size",
    "--num-kv-blocks",
    "--otlp-endpoint",
    "--otlp-protocol",
    "--log-format",
    "--log-level",
    "--api-key",
    "--engine-ready-timeout",
    "--step-timeout",
    "--shutdown-timeout",
    "--enable-prefix-caching",  # prefix caching, on by default
    "--no-enable-prefix-caching",
}
EXTRA_FLAGS = {
    "--served-model-name",
    "--kv-cache-memory-gib",
    "--kv-cache-dtype",
    "--seed",
    "--kernels",
    "--int4",
    "--quant-activations",
    "--generation-config",
    "--override-generation-config",
    "--otlp-logs",
    "--log-prompts",
    "--final-scrape-wait",
    "--tool-call-parser",
    "--max-connections",
    "--request-read-timeout",
    "--stream-write-timeout",
    "--max-prompt-chars",
    "--api-key-file",
    "--allow-special-tokens-in-content",
    "--vllm-metric-names",
    # tensor parallel across machines (docs/operations.md, "Tensor parallel across machines")
    "--distributed-executor-backend",
    "--ray-address",
    "--ray-placement-strategy",
    "--ray-cpus-per-rank",
    # recovery in place (docs/operations.md, "Recovery in place")
    "--on-engine-failure",
    "--max-engine-restarts",
    "--engine-restart-window",
    # speculative decoding (docs/speculative.md)
    "--speculative-method",
    "--num-speculative-tokens",
    "--ngram-min",
    "--ngram-max",
    "--speculative-model",
}
# the post-mortem flags (docs/operations.md, "Reading a crash")
POST_MORTEM_FLAGS = {"--crash-dump-dir", "--crash-history-steps"}
PROMPTS = ["The engine schedules", "Once upon a time"]
# the model's whole context: the default 1 GiB of KV cache takes seconds to set up
SMALL_KV = ("--num-kv-blocks", "64")
GREEDY = ("--temperature", "0")  # without it, generate samples with the model's defaults


@pytest.fixture(autouse=True)
def _keep_test_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() in this process must not reconfigure the test process's logging."""
    monkeypatch.setattr("otel_engine.cli.setup_main_process", lambda *_, **__: None)


def _flags(command: str) -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt for action in commands.choices[command]._actions for opt in action.option_strings}


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_engine.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_serve_has_exactly_the_documented_flags() -> None:
    """`serve` takes the documented core flags plus the extras (model name, KV memory, seed,
    OTLP logs, prompt logging, the final scrape after an engine failure, the limits per
    client, the CPU kernel and 4-bit weight choices) and the post-mortem ones."""
    expected = CORE_SERVE_FLAGS | EXTRA_FLAGS | POST_MORTEM_FLAGS | {"-h", "--help"}
    assert expected == _flags("serve")


def _commands(
    parser: argparse.ArgumentParser | None = None, prefix: tuple[str, ...] = ()
) -> list[list[str]]:
    """The top level and every subcommand at any depth, as the parser has them (argparse has
    no public way to list them: its subparsers action holds them)."""
    parser = parser or build_parser()
    found = [list(prefix)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


def test_help_covers_the_known_subcommands() -> None:
    """The enumeration below sees the parser's subcommands (it would pass vacuously if not)."""
    assert {"serve", "generate", "replay"} <= {c[0] for c in _commands() if c}


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "otel-engine")
def test_every_help_prints_and_exits_0(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--help` of the top level and of every subcommand the parser has formats every flag's
    help (argparse reads a lone % in it as a format)."""
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])

    assert 0 == exited.value.code
    assert "usage:" in capsys.readouterr().out


def test_serve_defaults_bind_localhost_8000() -> None:
    """The server binds 127.0.0.1:8000 unless told otherwise."""
    args = build_parser().parse_args(["serve"])

    assert ("127.0.0.1", 8000) == (args.host, args.port)


@pytest.mark.parametrize(
    ("command", "is_terminal", "expected"),
    [("serve", False, "json"), ("serve", True, "console"), ("generate", False, "console")],
)
def test_log_format_default_follows_command_and_terminal(
    monkeypatch: pytest.MonkeyPatch, command: str, is_terminal: bool, expected: str
) -> None:
    """serve logs JSON unless stderr is a terminal; generate logs for humans; a flag wins."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: is_terminal)
    args = build_parser().parse_args([command])

    assert expected == engine_options(args)["log_format"]
    flagged = build_parser().parse_args([command, "--log-format", "json"])
    assert "json" == engine_options(flagged)["log_format"]


def test_invalid_engine_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A value EngineConfig rejects exits with status 2 and names the flag as typed."""
    with pytest.raises(SystemExit) as excinfo:
        main(["generate", "--block-size", "3", "hello"])

    assert 2 == excinfo.value.code
    assert "--block-size must be a power of two, got 3" in capsys.readouterr().err


def test_generate_prints_each_completion(
    tiny_model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate` prints the completion of every prompt, in order."""
    with LLM(model=tiny_model_dir, num_kv_blocks=64) as llm:
        expected = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))

    code = main(
        ["generate", "--model", tiny_model_dir, *SMALL_KV, *GREEDY, "--max-tokens", "6", *PROMPTS]
    )

    assert 0 == code
    assert "".join(o.outputs[0].text + "\n" for o in expected) == capsys.readouterr().out


def test_generate_reads_prompts_file(
    tiny_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--prompts-file gives the same output as the same prompts on the command line."""
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    base = ["generate", "--model", tiny_model_dir, *SMALL_KV, *GREEDY, "--max-tokens", "4"]
    main([*base, *PROMPTS])
    expected = capsys.readouterr().out

    main([*base, "--prompts-file", str(path)])

    assert expected == capsys.readouterr().out


def test_generate_chat_applies_template(
    tiny_model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--chat completes each prompt as a user message, as `LLM.chat` does."""
    with LLM(model=tiny_model_dir, num_kv_blocks=64) as llm:
        messages = [{"role": "user", "content": PROMPTS[0]}]
        expected = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0))

    base = ["generate", "--model", tiny_model_dir, *SMALL_KV, *GREEDY, "--max-tokens", "5"]
    main([*base, "--chat", PROMPTS[0]])

    assert expected[0].outputs[0].text + "\n" == capsys.readouterr().out


def test_generate_without_prompts_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """`generate` with no prompt exits 1 with one error line."""
    assert 1 == main(["generate"])
    assert capsys.readouterr().err.startswith("otel-engine: error:")


def test_serve_startup_failure_exits_1_with_one_line(tmp_path: Path) -> None:
    """A bad model path: exit code 1 and a last stderr line that says why."""
    result = _run_cli("serve", "--model", str(tmp_path / "missing"), "--port", str(free_port()))

    assert 1 == result.returncode
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("otel-engine: error: engine startup failed:")


def test_serve_busy_port_exits_1_before_engine_start(tiny_model_dir: str) -> None:
    """A port already in use fails at once with a clear line, before loading the model."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        started = time.monotonic()
        result = _run_cli("serve", "--model", tiny_model_dir, "--port", str(busy.getsockname()[1]))

    assert 1 == result.returncode
    assert "cannot bind" in result.stderr.strip().splitlines()[-1]
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly_on_signal(tiny_model_dir: str, signum: int) -> None:
    """serve answers, then on SIGTERM/SIGINT exits 0 with no child left, logging its lifecycle."""
    with ServerProcess(
        ["--model", tiny_model_dir, *SMALL_KV, "--served-model-name", "tiny"]
    ) as server:
        server.wait_healthy()
        import openai

        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        result = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert 1 <= result.usage.completion_tokens <= 3
        assert server.descendants()

        os.kill(server.pid, signum)
        code = server.wait(timeout=60)
        log = "\n".join(server.lines())

    assert 0 == code
    for event in ("engine.ready", "server.listening", "shutdown.begin", "shutdown.complete"):
        assert event in log


def test_an_abbreviated_flag_is_refused() -> None:
    """`--otlp-log` is a typo in a manifest, not `--otlp-logs`: argparse must not guess."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--otlp-log"])
    assert build_parser().parse_args(["serve", "--otlp-logs"]).otlp_logs


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], True), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)],
)
def test_prefix_caching_flag_reaches_the_engine_config(flags: list[str], expected: bool) -> None:
    """On unless `--no-enable-prefix-caching` (vLLM's spelling)."""
    options = engine_options(build_parser().parse_args(["serve", *flags]))

    assert expected == EngineConfig.from_kwargs(**options).cache.enable_prefix_caching


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["serve", "--port", "1"], "serve needs Linux"),
        (["generate", "--tensor-parallel-size", "2", "hi"], "--tensor-parallel-size > 1"),
    ],
)
def test_without_pidfd_the_supervised_commands_fail_before_starting(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    refused: str,
) -> None:
    """On a system without pidfd_open (not Linux) `serve` and tensor parallelism exit 1 with
    one line before anything is bound, loaded or spawned."""
    monkeypatch.delattr(os, "pidfd_open")
    spawned: list[object] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: spawned.append(a))

    assert 1 == main(argv)

    err = capsys.readouterr().err.strip().splitlines()
    assert 1 == len(err)
    assert refused in err[0]
    assert [] == spawned


def test_without_pidfd_the_in_process_engine_is_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The in-process engine at one rank supervises no process: it is allowed anywhere."""
    from otel_engine.cli import unsupported_platform

    monkeypatch.delattr(os, "pidfd_open")

    assert unsupported_platform("generate", EngineConfig.from_kwargs()) is None


def test_start_warns_of_a_rounded_gguf_and_a_context_capped_by_the_kv_cache(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Issue 24: `--dtype float32` with a GGUF file that has tensors the conversion rounds to
    bfloat16 (a format not read in blocks: Q5_0), and a KV budget that holds less than the
    model's context, are each said at start (warnings naming why and the flags), and the
    request that does not fit is refused with the server's limit, not the model's."""
    from tests.helpers.tiny_model import write_tiny_gguf

    quant = {"down_proj": "Q5_0"}
    gguf = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "llama", quant=quant)
    # A fresh cache for the conversion; the kernels builds and the bandwidth probe are the
    # shared cache's (neither compiled nor measured again)
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("kernels", "bandwidth"):
        shared = Path(os.environ["OTEL_ENGINE_CACHE_DIR"]) / name
        shared.mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(shared)
    env = {**os.environ, "OTEL_ENGINE_CACHE_DIR": str(cache)}
    base = [sys.executable, "-m", "otel_engine.cli", "generate", "--model", gguf]
    flags = ["--dtype", "float32", "--num-kv-blocks", "4", "--log-format", "json"]

    def generate(max_tokens: str) -> subprocess.CompletedProcess[str]:
        command = [*base, *flags, "--max-tokens", max_tokens, "Hello"]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=180, check=False, env=env
        )

    fits, too_long = generate("4"), generate("100")

    assert 0 == fits.returncode, fits.stderr[-2000:]
    (rounded,) = [json.loads(line) for line in fits.stderr.splitlines() if "gguf_rounded" in line]
    layers = json.loads((Path(tiny_model_dir) / "config.json").read_text())["num_hidden_layers"]
    assert layers == rounded["tensors"]  # each layer's down_proj; the float tensors are exact
    assert '"model.context_capped"' in fits.stderr
    assert '"max_model_len": 64' in fits.stderr
    assert 0 != too_long.returncode
    assert "this server's maximum context length is 64 tokens" in too_long.stderr
    assert "--kv-cache-memory-gib or --num-kv-blocks" in too_long.stderr
