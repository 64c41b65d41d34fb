"""How far otel-engine's log-likelihoods are from transformers' float32 on the same weights:
the loglikelihood check of lm-eval, per dtype and activation mode, at one CPU level.

    .venv/bin/python bench/loglik.py [--model PATH] [--num-texts 16] [--tokens 256]
        [--modes float32-int8,float32-float32,bfloat16,auto,float32-int8-steps8,...]
        [--isa baseline|avx2|avx512|avx512bf16] [--json out.json]

1. texts: the repository's own English prose (README.md, then docs/*.md in name order;
   paragraphs outside code blocks that are not headings, tables or HTML), joined per file
   into chunks of `--tokens` tokens with the model's tokenizer (no special tokens) and taken
   round-robin over the files: the same texts at the same commit, nothing downloaded. Each
   prompt is the tokenizer's EOS token (lm-eval's prefix for a rolling loglikelihood)
   followed by the chunk, so every token of the chunk is scored;
2. reference: transformers float32 (`AutoModelForCausalLM.from_config`), its weights the
   checkpoint's, a GGUF file's blocks dequantized exactly to float32 (`QuantTensor.dequantize`,
   as gguf-py computes them; never rounded to bfloat16), one forward per text: log p(token_i |
   tokens_<i) from the float32 log-softmax, and the argmax of each position;
3. otel-engine: per mode, a fresh process (under `--isa`'s caps: bench/isa_caps.py) runs
   `LLM.generate` on the same token ids with `prompt_logprobs=1`, `max_tokens=1`: each prompt
   token's log-probability and its position's most likely token. Modes: `float32-int8`
   (`--dtype float32`, x quantized to 8 bits for GGUF blocks: the default),
   `float32-float32` (`--quant-activations float32`: the exact dense product),
   `bfloat16`, `auto` (what it picked, from the start log `kernels.selected`, is printed),
   and `float32-int8-steps8`, `float32-float32-steps8`, `bfloat16-steps8`: the same at 8
   tokens a step (`max_num_batched_tokens`; the last, run only when asked for, checks that
   chunking alone changes nothing).
   A step of more rows than the 8-bit kernels take (model/quant.py: `QUANT_MAX_ROWS`, 8, in
   bfloat16; `QUANT_F32_MAX_ROWS`, 64, in float32) multiplies GGUF blocks dequantized a
   tile at a time, so a whole prompt in one step is exact; the `-steps8` modes run the 8-bit
   path as decode steps do.

Per mode it prints, over all scored tokens: mean |Δ log-prob| (nats), the difference of the
mean log-likelihood per token (otel-engine minus transformers, nats), the max |Δ|, how often both
engines' most likely token agree (greedy top-1), and the token count; and the CPU level the
run is at (`kernels.cpu_isa()`, the caps in force). Without `--isa` the level is this CPU's,
or whatever the caps in the environment say (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`,
`OTEL_ENGINE_KERNEL_ISA`), which then hold the reference too. Prints numbers only; nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import print_table, write_json
from isa_caps import runnable

from otel_engine.model.quant import QUANT_MAX_ROWS

REPO = Path(__file__).resolve().parents[1]
CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OTEL_ENGINE_KERNEL_ISA")
MIN_PARAGRAPH_CHARS = 80  # shorter paragraphs are mostly labels and one-line notes
RESULT_PREFIX = "RESULT "


@dataclass(frozen=True)
class Mode:
    """One otel-engine configuration to compare with the reference."""

    name: str
    dtype: str
    quant_activations: str
    # Tokens a step computes at most (None: the engine's default). GGUF blocks multiply
    # steps of up to QUANT_MAX_ROWS rows with x in 8 bits (float32: QUANT_F32_MAX_ROWS);
    # larger steps dequantize them a tile at a time (model/quant.py). A prompt fed that many
    # tokens a step is multiplied as decode steps are.
    max_num_batched_tokens: int | None = None

    def options(self) -> dict[str, Any]:
        """The `LLM` keyword arguments of this mode."""
        steps = {"max_num_batched_tokens": self.max_num_batched_tokens}
        return {
            "dtype": self.dtype,
            "quant_activations": self.quant_activations,
            **(steps if self.max_num_batched_tokens else {}),
        }


MODES = {
    mode.name: mode
    for mode in (
        Mode("float32-int8", "float32", "int8"),
        Mode("float32-float32", "float32", "float32"),
        Mode("bfloat16", "bfloat16", "int8"),
        Mode("auto", "auto", "int8"),
        Mode(f"float32-int8-steps{QUANT_MAX_ROWS}", "float32", "int8", QUANT_MAX_ROWS),
        Mode(f"float32-float32-steps{QUANT_MAX_ROWS}", "float32", "float32", QUANT_MAX_ROWS),
        Mode(f"bfloat16-steps{QUANT_MAX_ROWS}", "bfloat16", "int8", QUANT_MAX_ROWS),
    )
}

# The control float32-float32-steps8 is slow (dense float32, 8 rows a step): asked for only.
DEFAULT_MODES = [name for name in MODES if name != f"float32-float32-steps{QUANT_MAX_ROWS}"]


@dataclass(frozen=True)
class Scores:
    """Per text, each scored token's log-probability and its position's most likely token."""

    logprobs: list[list[float]]
    top1: list[list[int]]


def prose_paragraphs(markdown: str) -> list[str]:
    """The paragraphs of a Markdown text that read as English: outside fenced code, not
    headings, tables, HTML or indented code, at least `MIN_PARAGRAPH_CHARS` long; each one
    line."""
    paragraphs: list[str] = []
    current: list[str] = []
    in_fence = False
    for line in [*markdown.splitlines(), ""]:
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            current = []
            continue
        if in_fence:
            continue
        if line.strip():
            current.append(line.strip())
            continue
        text = " ".join(current)
        first = current[0] if current else ""
        current = []
        if len(text) < MIN_PARAGRAPH_CHARS or first.startswith(("#", "|", "<", "    ")):
            continue
        paragraphs.append(text)
    return paragraphs


def chunk_tokens(paragraphs: list[list[int]], length: int) -> list[list[int]]:
    """Consecutive paragraphs' tokens joined and cut into chunks of exactly `length` (the
    remainder is dropped)."""
    joined = [token for paragraph in paragraphs for token in paragraph]
    return [joined[i : i + length] for i in range(0, len(joined) - length + 1, length)]


def round_robin(groups: list[list[list[int]]], count: int) -> list[list[int]]:
    """The first chunk of every group, then the second of every group, ..., `count` at most."""
    picked: list[list[int]] = []
    for index in range(max((len(g) for g in groups), default=0)):
        picked += [g[index] for g in groups if index < len(g)]
    return picked[:count]


def select_texts(tokenizer: Any, num_texts: int, length: int) -> list[list[int]]:
    """`num_texts` chunks of `length` token ids from the repository's README and docs."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    separator = tokenizer.encode("\n\n", add_special_tokens=False)
    groups = []
    for path in files:
        paragraphs = prose_paragraphs(path.read_text(encoding="utf-8"))
        tokens = [tokenizer.encode(p, add_special_tokens=False) + separator for p in paragraphs]
        groups.append(chunk_tokens(tokens, length))
    texts = round_robin(groups, num_texts)
    if len(texts) < num_texts:
        print(f"[texts] only {len(texts)} texts of {length} tokens in the docs", flush=True)
    return texts


def compare(reference: Scores, engine: Scores) -> dict[str, Any]:
    """Token-level distance of `engine`'s scores from `reference`'s, over every text."""
    deltas, agree, ref_sum, got_sum = [], 0, 0.0, 0.0
    for ref_lp, got_lp, ref_top, got_top in zip(
        reference.logprobs, engine.logprobs, reference.top1, engine.top1, strict=True
    ):
        if len(ref_lp) != len(got_lp):
            raise ValueError(f"{len(got_lp)} scored tokens, the reference has {len(ref_lp)}")
        deltas += [g - r for r, g in zip(ref_lp, got_lp, strict=True)]
        agree += sum(r == g for r, g in zip(ref_top, got_top, strict=True))
        ref_sum += sum(ref_lp)
        got_sum += sum(got_lp)
    num_tokens = len(deltas)
    return {
        "mean_abs_delta": sum(abs(d) for d in deltas) / num_tokens,
        "mean_loglik_delta": (got_sum - ref_sum) / num_tokens,
        "max_abs_delta": max(abs(d) for d in deltas),
        "top1_agreement": agree / num_tokens,
        "num_tokens": num_tokens,
        "mean_loglik": got_sum / num_tokens,
    }


def reference_scores(model_dir: str, prompts: list[list[int]]) -> Scores:
    """transformers float32 on the checkpoint's weights, GGUF blocks dequantized exactly."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from otel_engine.model.weights import QuantTensor, iter_weights

    transformers.logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(model_dir)
    weights = {
        name: tensor.dequantize() if isinstance(tensor, QuantTensor) else tensor.float()
        for name, tensor in iter_weights(model_dir, keep_quantized=True)
    }
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = model.load_state_dict(weights, strict=False)
    model.tie_weights()
    untied = [n for n in missing if not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if untied:
        raise RuntimeError(f"the checkpoint lacks {untied}")
    model.eval()
    logprobs, top1 = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], dtype=torch.long)
            logits = model(ids).logits[0, :-1].float()
            scores = torch.log_softmax(logits, dim=-1)
            logprobs.append(scores.gather(1, ids[0, 1:, None])[:, 0].tolist())
            top1.append(scores.argmax(dim=-1).tolist())
    return Scores(logprobs, top1)


def child(args: argparse.Namespace) -> None:
    """One mode in this process: print its scores and what the engine selected as JSON."""
    import logging

    from otel_engine import LLM, SamplingParams

    selected: dict[str, Any] = {}

    class Selected(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "kernels.selected" and getattr(record, "rank", 0) == 0:
                keys = ("dtype", "dtype_reason", "cpu_isa", "kernel_isa", "paths", "choices")
                selected.update({k: getattr(record, k, None) for k in keys})

    runner_log = logging.getLogger("otel_engine.executor.model_runner")
    runner_log.addHandler(Selected(logging.INFO))
    runner_log.setLevel(logging.INFO)
    prompts = json.loads(Path(args.prompts).read_text())
    mode = MODES[args.child]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    start = time.perf_counter()
    with LLM(model=args.model, **mode.options()) as llm:
        outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    logprobs, top1 = [], []
    for output in outputs:
        entries = output.prompt_logprobs or []
        logprobs.append([e.logprob for e in entries])
        top1.append([e.top_token_ids[0] for e in entries])
    paths = selected.pop("paths", None) or {}
    selected["paths_on"] = [name for name, path in paths.items() if path.get("enabled")]
    result = {"logprobs": logprobs, "top1": top1, "selected": selected, "seconds": seconds}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_mode(
    mode: Mode, prompts_file: str, caps: dict[str, str], args: argparse.Namespace
) -> dict[str, Any]:
    env = {**os.environ, **caps, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, __file__, "--child", mode.name, "--prompts", prompts_file]
    command += ["--model", args.model] if args.model else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX) :]))
    raise RuntimeError(f"mode {mode.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def nats(value: float, signed: bool = False) -> str:
    """A difference in nats: 4 decimals, or 2 significant digits below 0.001."""
    sign = "+" if signed else ""
    return f"{value:{sign}.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:{sign}.1e}"


def describe_selected(selected: dict[str, Any]) -> str:
    choices = selected.get("choices") or {}
    return (
        f"dtype {selected.get('dtype')} ({selected.get('dtype_reason')}), activations "
        f"{choices.get('activations')}, CPU level {selected.get('cpu_isa')}, kernels "
        f"{selected.get('kernel_isa') or 'off'}, paths on: "
        f"{', '.join(selected.get('paths_on') or []) or 'none'}"
    )


def print_summary(report: dict[str, Any]) -> None:
    print(
        f"\n== {report['model']}: {report['num_texts']} texts x {report['tokens']} tokens; "
        f"CPU level {report['isa']} (this CPU: {report['cpu_isa']}); caps: "
        + (", ".join(f"{k}={v}" for k, v in report["caps"].items()) or "none")
    )
    print(
        f"reference: transformers float32, mean log-likelihood "
        f"{report['reference_mean_loglik']:.4f} nats/token"
    )
    rows = []
    for name, mode in report["modes"].items():
        if "error" in mode:
            rows.append([name, *["-"] * 5, "failed"])
            continue
        rows.append(
            [
                name,
                nats(mode["mean_abs_delta"]),
                nats(mode["mean_loglik_delta"], signed=True),
                nats(mode["max_abs_delta"]),
                f"{100 * mode['top1_agreement']:.2f}%",
                str(mode["num_tokens"]),
                f"{mode['selected'].get('dtype')}, act {mode['selected'].get('activations')}",
            ]
        )
    headers = ["mode", "mean |Δ|", "Δ mean ll", "max |Δ|", "top-1 agree", "tokens", "ran as"]
    print_table(headers, rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--model", help="HF directory or .gguf file (default: the default model)")
    parser.add_argument("--num-texts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256, help="scored tokens per text")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--isa", help="run otel-engine at this CPU level (bench/isa_caps.py)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.modes = [MODES[name] for name in args.modes.split(",")]
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.child:
        child(args)
        return
    from otel_engine.model.kernels import cpu_isa
    from otel_engine.model.loader import load_tokenizer, prepare_model_dir

    model_dir = prepare_model_dir(args.model)
    caps = runnable(args.isa).env() if args.isa else {}
    in_force = {name: os.environ[name] for name in CAP_VARS if name in os.environ} | caps
    report: dict[str, Any] = {
        "model": args.model or "default",
        "num_texts": args.num_texts,
        "tokens": args.tokens,
        "cpu_isa": cpu_isa(),
        "isa": args.isa or os.environ.get("OTEL_ENGINE_KERNEL_ISA") or cpu_isa(),
        "caps": in_force,
        "modes": {},
    }
    print(f"[isa] CPU level {report['isa']} (this CPU: {report['cpu_isa']}); caps: {in_force}")
    tokenizer = load_tokenizer(model_dir)
    prefix = tokenizer.eos_token_id
    if prefix is None:
        raise ValueError("the tokenizer has no EOS token to prefix the texts with")
    prompts = [[prefix, *text] for text in select_texts(tokenizer, args.num_texts, args.tokens)]
    start = time.perf_counter()
    reference = reference_scores(model_dir, prompts)
    ref_tokens = sum(len(lp) for lp in reference.logprobs)
    report["reference_mean_loglik"] = sum(map(sum, reference.logprobs)) / ref_tokens
    print(
        f"[reference] transformers float32: {len(prompts)} texts, {ref_tokens} tokens in "
        f"{time.perf_counter() - start:.1f} s, mean log-likelihood "
        f"{report['reference_mean_loglik']:.4f} (perplexity "
        f"{math.exp(-report['reference_mean_loglik']):.2f})",
        flush=True,
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(prompts, file)
    try:
        for mode in args.modes:
            try:
                result = run_mode(mode, file.name, caps, args)
            except RuntimeError as error:
                print(f"[{mode.name}] {error}", file=sys.stderr, flush=True)
                report["modes"][mode.name] = {"error": str(error)}
                continue
            stats = compare(reference, Scores(result["logprobs"], result["top1"]))
            selected = result["selected"]
            stats["selected"] = {
                **selected,
                "activations": (selected.get("choices") or {}).get("activations"),
            }
            report["modes"][mode.name] = stats
            print(
                f"[{mode.name}] {result['seconds']:.1f} s; {describe_selected(selected)}; mean "
                f"|Δ| {nats(stats['mean_abs_delta'])}, Δ mean ll "
                f"{nats(stats['mean_loglik_delta'], signed=True)}, max |Δ| "
                f"{nats(stats['max_abs_delta'])}, "
                f"top-1 agreement {100 * stats['top1_agreement']:.2f}%",
                flush=True,
            )
    finally:
        os.unlink(file.name)
    print_summary(report)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
