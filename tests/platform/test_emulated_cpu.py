"""The engine on CPUs below AVX-512 BF16: a CPU without AVX-512 emulated by qemu-user
(QEMU's Haswell: AVX2 and FMA; an AVX-512 instruction there is SIGILL), and oneDNN limited
to AVX2 on this CPU.

qemu-user does not follow execve, so every process of an emulated engine must start through
it: `emulated_python` is a copy of this virtual environment whose `bin/python` runs the real
interpreter under qemu, and `sys.executable` in there is that wrapper, which is what the
engine spawns its core with. The kernels cache is the one the other tests share, which holds
this CPU's build: an emulated engine must never load a build above AVX2 from it.

Emulation is about ten times slower than this CPU: each test here takes one to two minutes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from otel_engine.model import kernels
from tests.helpers.isa import QEMU_CPU, QEMU_ISA, require_qemu
from tests.helpers.paths import REPO_ROOT
from tests.helpers.procs import ServerProcess
from tests.helpers.tiny_model import write_tiny_gguf

pytestmark = pytest.mark.slow  # starts engines under an emulator

PROMPTS = ["The engine schedules", "Once upon a time", "def generate(prompt"]
NUM_TOKENS = 16
# bfloat16 logits of this model are 0.125 to 0.25 apart: the two paths round at different
# places, and where two tokens are within that (measured: 0.06 nats, the 11th token of the
# second prompt) their greedy picks may differ.
NEAR_TIE = 0.5
# Both paths of both dtypes in one emulated interpreter (importing torch there takes ~20 s):
# bfloat16 on the HF checkpoint, float32 on a GGUF file of its shape in GGUF blocks (so
# that float32 `auto` runs the AVX2 layer kernels and the 8-bit GGUF matmul). stdout gets
# {"<dtype> <kernels>": [[token ids, top-5 log-probs per token] per prompt]}, and before each
# engine a `run.start` log line says which engine the next lines are from. argv: the HF
# directory, the GGUF file, the prompts, the tokens, and the runs (all four by default).
GENERATE = """
import json, logging, sys
from otel_engine import LLM, SamplingParams
from otel_engine.observability.logging import configure_logging

configure_logging(role="emulated", fmt="json")
models = {"bfloat16": sys.argv[1], "float32": sys.argv[2]}
prompts, num_tokens = json.loads(sys.argv[3]), int(sys.argv[4])
wanted = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
runs = {}
for dtype in ("bfloat16", "float32"):
    for choice in ("auto", "torch"):
        run = f"{dtype} {choice}"
        if wanted is not None and run not in wanted:
            continue
        logging.getLogger("emulated").info("run.start", extra={"run": run})
        with LLM(models[dtype], dtype=dtype, kernels=choice, num_kv_blocks=64) as llm:
            outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
        runs[run] = [
            [list(o.token_ids), [dict(zip(p.top_token_ids, p.top_logprobs)) for p in o.logprobs]]
            for o in outputs
        ]
print(json.dumps(runs))
"""
# the tiny model's matrices (64 and 128 wide: whole 32-weight blocks) in three formats
LAYER_FORMATS = {
    **dict.fromkeys(("q_proj", "k_proj", "o_proj", "gate_proj"), "Q4_0"),
    "up_proj": "Q4_1",
    **dict.fromkeys(("v_proj", "down_proj"), "Q8_0"),
}
# AVX2 caps on this CPU: torch's, oneDNN's and the kernels' (bench/isa_caps.py's avx2)
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", kernels.ISA_ENV: "avx2"}


@pytest.fixture(scope="module")
def emulated_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`bin/python` of a virtual environment that is this one (the same packages, through a
    symlink) run under `qemu-x86_64 -cpu Haswell`, argv[0] kept so that the interpreter
    finds the environment and names itself in `sys.executable`."""
    qemu = require_qemu()
    root = tmp_path_factory.mktemp("emulated-venv")
    prefix = Path(sys.prefix)
    if (prefix / "pyvenv.cfg").exists():
        shutil.copy(prefix / "pyvenv.cfg", root / "pyvenv.cfg")
    (root / "lib").symlink_to(prefix / "lib")  # a venv's packages, or a prefix's stdlib
    (root / "bin").mkdir()
    python = root / "bin" / "python"
    emulator = shlex.join([qemu, "-cpu", QEMU_CPU])
    real = shlex.quote(os.path.realpath(sys.executable))
    python.write_text(f'#!/bin/sh\nexec {emulator} -0 "$0" {real} "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture(scope="module")
def native_build() -> kernels.KernelLibrary:
    """This CPU's kernels build, in the cache the emulated engines share."""
    library = kernels.load()
    assert library is not None
    return library


def json_records(text: str) -> list[dict[str, Any]]:
    """The JSON object lines of a log (qemu's own warnings and the rest skipped)."""
    records = []
    for line in text.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def assert_emulated_selection(record: dict[str, Any], kernels_flag: str = "auto") -> None:
    """A `kernels.selected` record of an engine that saw the emulated CPU: with `--kernels
    auto` the AVX2 build's layer kernels on (both dtypes), with `torch` none."""
    assert record["cpu_isa"] == QEMU_ISA
    paths = record["paths"]
    if kernels_flag == "auto":
        assert record["kernel_isa"] == QEMU_ISA
        assert paths["compiled_kernels"] == {"enabled": True, "reason": f"built for {QEMU_ISA}"}
    else:
        assert record["kernel_isa"] is None
        assert paths["compiled_kernels"]["enabled"] is False
    for name in ("int4_kernels", "prefill_kernel", "decoder_stack"):
        assert paths[name]["enabled"] is False, (name, paths[name])


def assert_same_until_a_near_tie(fast: list[Any], reference: list[Any]) -> None:
    """The same greedy tokens; where they part, the fast path's pick was among the
    reference's top five, within NEAR_TIE of its pick (then the continuations part ways)."""
    (tokens, _), (reference_tokens, reference_top) = fast, reference
    assert len(tokens) == len(reference_tokens) == NUM_TOKENS
    for token, other, top in zip(tokens, reference_tokens, reference_top, strict=True):
        if token != other:
            assert str(token) in top, (token, top)
            assert top[str(other)] - top[str(token)] <= NEAR_TIE, (token, top)
            return


def selected_by_run(stderr: str) -> dict[str, dict[str, Any]]:
    """Each run's `kernels.selected` record, from GENERATE's log."""
    selected: dict[str, dict[str, Any]] = {}
    run = None
    for record in json_records(stderr):
        if record["event"] == "run.start":
            run = record["run"]
        elif record["event"] == "kernels.selected":
            assert run is not None
            selected[run] = record
    return selected


def run_generate(
    python: list[str],
    models: list[str],
    runs: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], str]:
    """GENERATE under `python` (emulated or this interpreter): its runs and its log."""
    command = [*python, "-c", GENERATE, *models, json.dumps(PROMPTS), str(NUM_TOKENS)]
    result = subprocess.run(
        [*command, *([json.dumps(runs)] if runs is not None else [])],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1]), result.stderr


def max_logprob_difference(one: list[Any], other: list[Any]) -> float:
    """The largest difference between two runs' top-5 log-probs of the same tokens."""
    worst = 0.0
    for (_, tops), (_, other_tops) in zip(one, other, strict=True):
        for top, other_top in zip(tops, other_tops, strict=True):
            assert top.keys() == other_top.keys()
            worst = max(worst, *(abs(top[t] - other_top[t]) for t in top))
    return worst


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's shape as a GGUF file of Q4_0, Q4_1 and Q8_0 blocks (random weights)."""
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-blocks.gguf"
    return write_tiny_gguf(tiny_model_dir, path, "llama", quant=LAYER_FORMATS)


def test_generate_under_emulation_runs_the_avx2_kernels(
    emulated_python: Path, native_build: kernels.KernelLibrary, tiny_model_dir: str,
    tiny_gguf: str,
) -> None:  # fmt: skip
    """On a CPU without AVX-512 the engine detects AVX2, loads no AVX-512 build from the
    shared cache, and really runs the AVX2 build: float32 on a GGUF file (its layer kernels
    and 8-bit matmul) gives, bit for bit, the log-probs of this CPU capped to AVX2, which torch
    ops do not give; its greedy tokens are torch ops' up to a near-tie, as in bfloat16."""
    models = [tiny_model_dir, tiny_gguf]
    runs, log = run_generate([str(emulated_python)], models)
    native, native_log = run_generate(
        [sys.executable], models, ["float32 auto"], env={**os.environ, **AVX2_CAPS}
    )

    assert native["float32 auto"] == runs["float32 auto"]  # the same bits, token ids and all
    assert max_logprob_difference(runs["float32 auto"], runs["float32 torch"]) > 1e-5
    for dtype in ("float32", "bfloat16"):
        for fast, reference in zip(runs[f"{dtype} auto"], runs[f"{dtype} torch"], strict=True):
            assert_same_until_a_near_tie(fast, reference)
    selected = selected_by_run(log)
    assert set(selected) == set(runs)
    for run, record in selected.items():
        assert_emulated_selection(record, run.split()[1])
    assert selected["float32 auto"]["paths"]["quant_kernels"]["enabled"] is True
    assert selected_by_run(native_log)["float32 auto"]["kernel_isa"] == QEMU_ISA
    assert native_build.path.exists()  # neither loaded nor replaced by the emulated engines


class EmulatedServer(ServerProcess):
    """`otel-engine serve` started by the emulated interpreter (its core with it)."""

    def __init__(self, python: Path, args: list[str], **options: Any) -> None:
        super().__init__(args, **options)
        self.python = python

    @property
    def command(self) -> list[str]:
        return [str(self.python), *super().command[1:]]


def test_serve_under_emulation_answers_and_stops(
    emulated_python: Path,
    native_build: kernels.KernelLibrary,
    tiny_model_dir: str,
    tmp_path: Path,
) -> None:
    """The server and its engine core both run emulated (qemu is their executable; the
    core's `kernels.selected` says AVX2), answer a completion, and exit 0 on SIGTERM."""
    args = ["--model", tiny_model_dir, "--served-model-name", "tiny", "--num-kv-blocks", "64"]
    args += ["--dtype", "bfloat16", "--log-format", "json", "--engine-ready-timeout", "200"]
    qemu = os.path.realpath(require_qemu())
    with EmulatedServer(emulated_python, args, log_path=tmp_path / "server.log") as server:
        server.wait_healthy(timeout=200)
        processes = [psutil.Process(server.pid), *server.descendants()]
        assert [p.exe() for p in processes] == [qemu] * len(processes)
        assert len(processes) >= 2  # the server and its engine core
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0},
            timeout=120,
            trust_env=False,
        )
        assert response.status_code == 200, response.text
        assert 1 <= response.json()["usage"]["completion_tokens"] <= 8

        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(timeout=120) == 0
    selected = [r for r in server.json_lines() if r["event"] == "kernels.selected"]
    assert [r["role"] for r in selected] == ["engine_core"]
    assert_emulated_selection(selected[0])


def test_onednn_limited_to_avx2_loads_bfloat16_without_packing(tiny_model_dir: str) -> None:
    """With oneDNN held to AVX2 (no bfloat16 path), a bfloat16 model loads and answers, its
    weights left unpacked, the reason logged."""
    args = ["--model", tiny_model_dir, "--dtype", "bfloat16", "--num-kv-blocks", "64"]
    args += ["--log-format", "json", "--max-tokens", "8", "--temperature", "0", PROMPTS[0]]
    result = subprocess.run(
        [sys.executable, "-m", "otel_engine.cli", "generate", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert result.returncode == 0, result.stderr[-4000:]
    assert len(result.stdout.splitlines()) == 1  # the one completion
    selected = [r for r in json_records(result.stderr) if r["event"] == "kernels.selected"]
    assert len(selected) == 1
    packing = selected[0]["paths"]["onednn_packing"]
    assert packing["enabled"] is False
    assert packing["reason"]
