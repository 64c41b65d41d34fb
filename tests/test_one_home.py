"""One home for each concept, held by tests: request error codes are one closed set
(`ErrorCode`), no code is a bare string in the package, and the docs list every one of them
(and none that does not exist); the values of every closed set (an enum of the package) are
written in its module alone; importing one module does not load the whole engine."""

from __future__ import annotations

import ast
import re

from otel_engine.errors import ErrorCode
from tests.helpers.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "observability.md"


def test_no_error_code_is_a_bare_string_in_the_package() -> None:
    """Every `code=` argument and every `RequestRejected(...)` code is an `ErrorCode`
    member (or a variable), never a string literal."""
    found = []
    for path in sorted((REPO_ROOT / "otel_engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            values = [k.value for k in node.keywords if k.arg == "code"]
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name in ("RequestRejected", "_write_raw") and node.args:
                values.append(node.args[0] if name == "RequestRejected" else node.args[1])
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {value.value!r}")
    assert [] == found


def test_the_docs_list_exactly_the_error_codes() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("`error_type` values") : text.index("counted by\n`otel_engine")]
    listed = set(re.findall(r"`([a-z_]+)`", section)) - {"error_type", "code", "type"}
    types = {"invalid_request_error", "internal_server_error"}  # an error's type, no code
    connection = {"invalid_framing", "request_timeout", "too_many_connections"}
    tail = text[text.index("counted by\n`otel_engine") :][:400]

    assert {c.value for c in ErrorCode} - connection == listed - types
    assert all(f"`{code}`" in tail for code in connection)


def test_importing_one_module_does_not_load_the_engine() -> None:
    """Issue 24: the package's public names load on first use, so a process that imports
    `otel_engine.errors` (every worker does) gets three modules, not the engine."""
    import subprocess
    import sys

    code = (
        "import sys, otel_engine.errors; "
        "print(sorted(m for m in sys.modules if m.startswith('otel_engine')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "['otel_engine', 'otel_engine.errors', 'otel_engine.version']" == result.stdout.strip()


# --- Closed sets: every string-valued enum of the package is the one home of its values. ---

PACKAGE = REPO_ROOT / "otel_engine"
# Names under which code holds a member of a set, beside the set's own name in snake case
# (`FinishReason`: `finish_reason`). A literal is flagged only where it meets one of these.
CONCEPT_NAMES: dict[str, tuple[str, ...]] = {
    "ErrorCode": ("code", "error_type"),
    "FailureCause": ("cause", "cause_type"),
    "FaultKind": ("kind",),
    "EngineFailureMode": ("on_engine_failure",),
    "QuantActivations": ("quant_activations", "activations"),
    "Dtype": ("dtype", "kv_cache_dtype"),
    "Device": ("device",),
    "ExecutorBackend": ("distributed_executor_backend", "backend"),
    "RayPlacementStrategy": ("ray_placement_strategy", "strategy"),
    "KernelsMode": ("kernels", "kernels_flag"),
    "Int4Mode": ("int4", "int4_flag"),
    "GenerationConfigMode": ("generation_config", "mode"),
    "OtlpProtocol": ("otlp_protocol", "protocol"),
    "LogFormat": ("log_format",),
    "LogLevel": ("log_level", "level"),
    "FinishReason": ("reason", "finish_reasons"),
    "HealthState": ("state",),
    "ConnectionCloseReason": ("reason",),
    "InvalidJsonReason": ("reason",),
    "ToolCallOutcome": ("outcome",),
    "LimitedBy": ("context_limited_by",),
    "ProcessRole": ("role", "where"),
    "FaultPhase": ("phase",),
    "IsaLevel": ("isa", "cpu_isa", "kernel_isa", "detected", "target"),
}
# Calls whose first argument is a member of a set (the metric and health sinks).
SINKS = {
    "maybe_inject": "ProcessRole",
    "process_title": "ProcessRole",
    "set_health": "HealthState",
    "closed": "ConnectionCloseReason",
    "on_connection_closed": "ConnectionCloseReason",
    "on_tool_calls": "ToolCallOutcome",
    "on_structured_output_invalid": "InvalidJsonReason",
    "on_engine_restart": "FailureCause",
}
# What the scan finds that is not in its enum's module (`path: Set 'value'`): none; a new row
# is a second home to remove, not to list.
BARE_MEMBERS: list[str] = []  # every closed set has its one home


def _closed_sets() -> dict[str, tuple[str, frozenset[str]]]:
    """Every enum class of the package with string members: name -> (its module, values)."""
    sets: dict[str, tuple[str, frozenset[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef) or not any(
                ast.unparse(base).split(".")[-1].endswith("Enum") for base in node.bases
            ):
                continue
            values = {
                item.value.value
                for item in node.body
                if isinstance(item, ast.Assign)
                and isinstance(item.value, ast.Constant)
                and isinstance(item.value.value, str)
            }
            if values:
                assert node.name not in sets, f"two closed sets named {node.name}"
                sets[node.name] = (str(path.relative_to(REPO_ROOT)), frozenset(values))
    return sets


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _terminal_name(node: ast.AST) -> str | None:
    """`x.finish_reason` and `finish_reason` are both `finish_reason`; `d["state"]` is
    `state`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    if isinstance(node, ast.Call):
        return _terminal_name(node.func)
    return None


def _constants(nodes: list[ast.expr]) -> list[ast.Constant]:
    return [n for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _strings(nodes: list[ast.expr]) -> list[ast.Constant]:
    """The string constants among `nodes`, and the values `x or "stop"` and
    `"a" if c else "b"` may take."""
    found = []
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node)
        elif isinstance(node, ast.BoolOp):
            found += _strings(node.values)
        elif isinstance(node, ast.IfExp):
            found += _strings([node.body, node.orelse])
    return found


class _BareMembers(ast.NodeVisitor):
    """The string literals of one module that stand for a member of a closed set: compared
    with, assigned to, passed as or defaulting a name of the set; two or more of one set in
    one literal collection of nothing else; the first argument of the set's sink."""

    def __init__(self, sets: dict[str, tuple[str, frozenset[str]]], module: str) -> None:
        self.hits: set[tuple[str, str, int, int]] = set()  # set, value, where
        self._names: dict[str, list[str]] = {}
        self._sets = {n: values for n, (home, values) in sets.items() if home != module}
        for set_name in self._sets:
            for concept in (_snake(set_name), *CONCEPT_NAMES.get(set_name, ())):
                self._names.setdefault(concept, []).append(set_name)

    def _hit(self, set_name: str, constants: list[ast.Constant]) -> None:
        for c in constants:
            if c.value in self._sets[set_name]:
                self.hits.add((set_name, c.value, c.lineno, c.col_offset))

    def _named(self, name: str | None, constants: list[ast.Constant]) -> None:
        for set_name in self._names.get(name or "", ()):
            self._hit(set_name, constants)

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        constants = _strings(operands)
        for operand in operands:
            if isinstance(operand, (ast.Tuple, ast.List, ast.Set)):
                constants += _strings(operand.elts)
        for operand in operands:
            self._named(_terminal_name(operand), constants)
        self.generic_visit(node)

    def _collection(self, constants: list[ast.Constant]) -> None:
        values = {c.value for c in constants}
        for set_name, members in self._sets.items():
            if len(values) >= 2 and values <= members:  # a copy of the set, or of a part
                self._hit(set_name, constants)

    def visit_Tuple(self, node: ast.Tuple) -> None:
        self._collection(_constants(node.elts))
        self.generic_visit(node)

    visit_List = visit_Tuple  # type: ignore[assignment]
    visit_Set = visit_Tuple  # type: ignore[assignment]

    def visit_Dict(self, node: ast.Dict) -> None:
        self._collection(_constants([k for k in node.keys if k is not None]))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        for keyword in node.keywords:
            self._named(keyword.arg, _strings([keyword.value]))
        sink = SINKS.get(_terminal_name(node.func) or "")
        if sink in self._sets and node.args:
            self._hit(sink, _strings(node.args[:1]))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                for name, value in zip(target.elts, node.value.elts, strict=False):
                    self._named(_terminal_name(name), _strings([value]))
            else:
                self._named(_terminal_name(target), _strings([node.value]))
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._named(_terminal_name(node.target), _strings([node.value]))
        self.generic_visit(node)

    def visit_arguments(self, node: ast.arguments) -> None:
        positional = [*node.posonlyargs, *node.args]
        defaults = zip(
            positional[len(positional) - len(node.defaults) :], node.defaults, strict=True
        )
        for arg, default in [*defaults, *zip(node.kwonlyargs, node.kw_defaults, strict=True)]:
            if default is not None:
                self._named(arg.arg, _strings([default]))
        self.generic_visit(node)


def bare_members() -> list[str]:
    sets = _closed_sets()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(REPO_ROOT))
        visitor = _BareMembers(sets, module)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        found += [f"{module}: {name} {value!r}" for name, value, _, _ in visitor.hits]
    return sorted(found)


def test_no_bare_member_of_a_closed_set() -> None:
    """A string that stands for a member of a closed set (an enum of the package) appears
    only in its enum's module: compared, assigned, passed, defaulted or listed elsewhere, it
    is a second home. The rows left are the ones still to convert (and only shrink)."""
    assert BARE_MEMBERS == bare_members()


def test_the_closed_sets_include_the_ones_the_code_was_written_against() -> None:
    """The scan is only as good as its set list: each set it knows by name exists."""
    assert set(CONCEPT_NAMES) | set(SINKS.values()) <= set(_closed_sets())


def test_the_scan_flags_each_context_and_passes_other_strings() -> None:
    sets = {"FailureCause": ("otel_engine/errors.py", frozenset({"WorkerDied", "StepTimeout"}))}
    source = """
if error.cause == "WorkerDied": pass
f(cause="StepTimeout")
CAUSES = ("WorkerDied", "StepTimeout")
metrics.on_engine_restart("WorkerDied")
def g(cause="StepTimeout"): pass
cause = "WorkerDied"
name = "WorkerDied"
title = ("WorkerDied", "other")
mixed = ("WorkerDied", "StepTimeout", "other")
"""
    visitor = _BareMembers(sets, "otel_engine/x.py")
    visitor.visit(ast.parse(source))

    assert [2, 3, 4, 4, 5, 6, 7] == sorted(line for _, _, line, _ in visitor.hits)
