"""A request's whole tool plan, as the server makes it in two steps (`ToolSupport.draft`
before the prompt is rendered, `ToolSupport.constrain` after the context check), for tests
that look at the plan alone."""

from __future__ import annotations

from typing import Any

from otel_engine.entrypoints.tools.plan import ToolPlan, ToolSupport
from otel_engine.entrypoints.tools.request import Function
from otel_engine.sampling_params import StructuredOutput


def plan_tools(
    support: ToolSupport,
    tools: list[Function] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool,
    answer_format: StructuredOutput | None = None,
) -> ToolPlan | None:
    plan = support.draft(tools, tool_choice, parallel, answer_format)
    if plan is not None:
        support.constrain(plan, answer_format)
    return plan
