"""The runtime's spans, after the OpenTelemetry GenAI semantic conventions (tracing on: luftpause/tracing.py).

- `invoke_agent`: one per run's loop, from its start (spawn, or resume after a restart) to its
  end; a child of its parent run's `invoke_agent`, or of the span of the MCP request that called
  spawn (the `mcp` SDK's server span, itself the child of the `traceparent` the client put in the
  request's `_meta`). That context is journaled with the run, so a run resumed after a restart
  gets a new `invoke_agent` under the same parent, in the same trace.
- `chat {model}`: one per model turn, with the token counts and finish reasons of its reply; its
  `traceparent` goes to the dataplane as a header, whose turn span is then its child.
- `execute_tool {tool}`: one per tool call made against a tool server; the `mcp` SDK puts its
  context in the call's `_meta`, where a traced tool server finds its parent.

With tracing off every function here returns at once and makes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode

from luftpause import logs, tracing
from luftpause.lifecycle import TRACEPARENT_HEADER
from luftpause.runtime import budgets
from luftpause.runtime.run import Run


def parent_of_new_run(parent: Run | None) -> str | None:
    """The context a run being spawned is traced under: its parent run's span, else the span of
    the request spawning it; None when neither has one (or tracing is off)."""
    if tracing.TRACER is None:
        return None
    if parent is not None and parent.span is not None:
        return tracing.traceparent_of(parent.span) or None
    return tracing.current_traceparent() or None


def start_run(run: Run) -> None:
    """Starts the run's `invoke_agent` span (its loop is about to run)."""
    if tracing.TRACER is None:
        return
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.id": run.handle,
        "gen_ai.request.model": run.spec.model or "",
        "luftpause.run.resumed": run.restored,
    }
    if run.spec.parent is not None:
        attributes["luftpause.run.parent"] = run.spec.parent
    run.span = tracing.TRACER.start_span(
        "invoke_agent", context=tracing.parent(run.traceparent), kind=SpanKind.INTERNAL, attributes=attributes
    )


@contextlib.contextmanager
def running(run: Run) -> Iterator[None]:
    """The run's span is the current one while its loop runs (its turns' and calls' parent), and
    the run is what the loop's log lines are about (their trace ids: the current span's)."""
    with logs.about(run_id=run.handle):
        if run.span is None:
            yield
            return
        with trace.use_span(run.span, record_exception=False, set_status_on_exception=False):
            yield


def end_run(run: Run) -> None:
    """Ends the run's span with how the run stands: ended, or still running (stopped by shutdown)."""
    span, run.span = run.span, None
    if span is None:
        return
    span.set_attributes(
        {
            "luftpause.run.status": run.status,
            "gen_ai.usage.input_tokens": int(run.counters["promptTokens"]),
            "gen_ai.usage.output_tokens": int(run.counters["completionTokens"]),
        }
    )
    if run.status == "failed":
        span.set_status(StatusCode.ERROR, run.error or "failed")
    span.end()


@contextlib.contextmanager
def chat(model: str, headers: dict[str, str]) -> Iterator[Span | None]:
    """A model turn's `chat` span, whose context `headers` (to the dataplane) then carry; None
    with tracing off."""
    if tracing.TRACER is None:
        yield None
        return
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
    with tracing.TRACER.start_as_current_span(
        f"chat {model}", kind=SpanKind.CLIENT, attributes=attributes, record_exception=False
    ) as span:
        headers[TRACEPARENT_HEADER] = tracing.traceparent_of(span)
        yield span


def replied(span: Span | None, reply: dict[str, Any]) -> None:
    """What a turn's reply says, on its `chat` span: its id, model, finish reasons and tokens."""
    if span is None:
        return
    prompt_tokens, completion_tokens = budgets.reported_tokens(reply.get("usage"))
    choices = reply.get("choices") or []
    reasons = [str(c.get("finish_reason")) for c in choices if isinstance(c, dict) and c.get("finish_reason")]
    span.set_attributes(
        {
            "gen_ai.response.id": str(reply.get("id") or ""),
            "gen_ai.response.model": str(reply.get("model") or ""),
            "gen_ai.response.finish_reasons": reasons,
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": completion_tokens,
        }
    )


def failed(span: Span | None, error: str) -> None:
    if span is not None:
        span.set_attribute("error.type", "turn_failed")
        span.set_status(StatusCode.ERROR, error)


@contextlib.contextmanager
def tool_call(tool: str, call_id: str) -> Iterator[Span | None]:
    """A tool call's `execute_tool` span; None with tracing off."""
    if tracing.TRACER is None:
        yield None
        return
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": tool,
        "gen_ai.tool.call.id": call_id,
        "gen_ai.tool.type": "extension",
    }
    with tracing.TRACER.start_as_current_span(
        f"execute_tool {tool}", kind=SpanKind.INTERNAL, attributes=attributes, record_exception=False
    ) as span:
        yield span


def tool_answered(span: Span | None, is_error: bool, text: str) -> None:
    if span is not None and is_error:
        span.set_attribute("error.type", "tool_error")
        span.set_status(StatusCode.ERROR, text[:200])
