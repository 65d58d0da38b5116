"""The sub-agent loop: model turns through the dataplane, tool calls against the tool servers.

Each turn sends the run's conversation to the dataplane with the tools the run may use. A reply
with tool calls starts a tool round: the calls run against the upstream MCP servers (one after
another, or all at once with spawn's `parallelToolCalls`), holding no turn slot meanwhile: the
engine only sees the next turn. Their results are appended as role "tool" messages, and the
round is journaled before the next turn is sent. A reply without tool calls is the run's answer.
Once `maxToolCalls` calls are spent the model is offered no tools, so a run takes at most
`maxToolCalls + 1` turns.

The reply that asks for tools, each call as it is sent and each answered call are journaled as
they happen, so the loop resumes after a restart from exactly where it was: a cut round runs only
the calls it had not sent. Tool calls are at most once: a call sent but not answered when the run
stopped may have taken effect, so it is not sent again; the model is told its outcome is unknown.
Budgets (budgets.py) are checked before each turn, after it, and before each call; a call of a
tool that needs approval (approvals.py) waits for the user first.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from luftpause.lifecycle import CALLER_HEADER, CALLER_MAX_BYTES, CLASS_HEADER, RUN_ID_HEADER
from luftpause.runtime import budgets, spans
from luftpause.runtime.approvals import DECLINED_TEXT, ask_approval, needs_approval
from luftpause.runtime.llm import Dataplane, TurnFailed
from luftpause.runtime.metrics import RuntimeMetrics
from luftpause.runtime.run import Run
from luftpause.runtime.runs import Runs
from luftpause.runtime.tool_calls import (
    ArgumentError,
    ToolCall,
    calls_in,
    prepare_arguments,
    recover_text_calls,
)
from luftpause.runtime.tool_servers import ToolServers, UpstreamTool

log = logging.getLogger(__name__)


_UNSAFE_HEADER_CHARS = re.compile(r"[^\x21-\x7e]")

# The answer to a call that was in flight when its run stopped (a restart, or a runtime that died
# while another took its runs over): it is not sent again.
UNKNOWN_OUTCOME = (
    "Error: the outcome of this tool call is unknown: it was sent, but the runtime making it stopped "
    "before the answer came, and it is not sent again (tool calls are at most once; idempotency key "
    "{key}). Check whether it took effect before calling it again."
)


def caller_header(caller: str) -> str:
    """A caller identity as a header value: visible ASCII only, at most 128 bytes."""
    return _UNSAFE_HEADER_CHARS.sub("_", caller)[:CALLER_MAX_BYTES]


class Agent:
    """Runs sub-agent loops; one instance serves every run."""

    def __init__(
        self,
        dataplane: Dataplane,
        tool_servers: ToolServers,
        default_model: str,
        metrics: RuntimeMetrics | None = None,
    ) -> None:
        self.metrics = metrics or RuntimeMetrics()
        self.dataplane = dataplane
        self.tool_servers = tool_servers
        self.default_model = default_model

    def headers(self, run: Run) -> dict[str, str]:
        headers = {RUN_ID_HEADER: run.handle, CLASS_HEADER: run.spec.serviceClass}
        if run.caller:
            headers[CALLER_HEADER] = caller_header(run.caller)
        return headers

    def allowed_tools(self, run: Run) -> dict[str, UpstreamTool]:
        tools, _ = self.tool_servers.catalog()
        if run.spec.tools is None:
            return tools
        return {name: tools[name] for name in run.spec.tools if name in tools}

    async def drive(self, runs: Runs, run: Run) -> None:
        """Runs the loop until the run has an answer or fails; cancellation is the caller's."""
        await self.tool_servers.settled()
        missing = [name for name in run.spec.tools or [] if name not in self.allowed_tools(run)]
        if missing:
            _, unavailable = self.tool_servers.catalog()
            log.warning(
                "run %s starts without %s: %s",
                run.handle,
                ", ".join(missing),
                "; ".join(unavailable) or "not listed",
            )
        if run.pending_turn is not None:
            # Resumed in the middle of a round: finish it before the next turn.
            await self.tool_round(runs, run, run.pending_turn, self.allowed_tools(run))
        while run.running:
            if not runs.check_budgets(run):
                break
            tools = self.allowed_tools(run)
            offered = tools if tools and run.counters["toolCalls"] < run.spec.maxToolCalls else {}
            started = time.monotonic()
            body, headers = self.request_body(run, offered), self.headers(run)
            with spans.chat(body["model"], headers) as span:
                try:
                    reply = await self.dataplane.complete(body, headers)
                except TurnFailed as e:
                    spans.failed(span, str(e))
                    run.counters["turnSeconds"] += time.monotonic() - started
                    runs.finish(run, "failed", error=f"turn {run.counters['turns'] + 1} failed: {e}")
                    break
                spans.replied(span, reply)
            run.counters["turnSeconds"] += time.monotonic() - started
            run.counters["turns"] += 1
            prompt_tokens, completion_tokens = budgets.reported_tokens(reply.get("usage"))
            run.counters["promptTokens"] += prompt_tokens
            run.counters["completionTokens"] += completion_tokens
            if not runs.check_budgets(run):
                break

            message = (reply["choices"][0] or {}).get("message") or {}
            content = message.get("content")
            calls = calls_in(message)
            if not calls and offered:
                calls = recover_text_calls(content, set(offered))
                if calls:
                    content = None
            if not calls:
                runs.finish(run, "finished", result=content or "")
                break
            if not offered:
                # Tools were not offered (budget spent, or none allowed): this turn had to answer.
                if content:
                    runs.finish(run, "finished", result=content)
                else:
                    runs.finish(
                        run,
                        "failed",
                        error="the model asked for tools when none were offered "
                        f"(tool-call budget {run.spec.maxToolCalls}) and gave no answer",
                    )
                break
            assistant = {
                "role": "assistant",
                "content": content,
                "tool_calls": [c.as_message_part() for c in calls],
            }
            runs.record_turn(run, assistant)
            await runs.journal.durable()  # on disk before any of its calls runs
            await self.tool_round(runs, run, assistant, offered)

    async def tool_round(
        self, runs: Runs, run: Run, assistant: dict[str, Any], offered: dict[str, UpstreamTool]
    ) -> None:
        """Answers every call of `assistant` not answered yet, then journals the whole round."""
        answered = {m.get("tool_call_id"): m for m in run.pending_results}
        every = calls_in(assistant)
        calls = [c for c in every if c.id not in answered]
        # The round's number among the run's rounds: the same when a round cut short is resumed.
        round_number = sum(1 for m in run.messages if m.get("role") == "assistant")

        async def answer(call: ToolCall) -> None:
            key = idempotency_key(run.handle, round_number, every.index(call))
            message = await self.tool_round_step(runs, run, call, offered, key)
            if message is not None:
                answered[call.id] = message
                runs.record_call(run, message)

        if run.spec.parallelToolCalls:
            await asyncio.gather(*(answer(c) for c in calls))
        else:
            for call in calls:
                await answer(call)
                if not run.running:
                    return
        if not run.running:
            return
        ordered = [answered[c.id] for c in calls_in(assistant) if c.id in answered]
        runs.record_round(run, [assistant, *ordered])
        await runs.journal.durable()  # on disk before its results go to the model

    def request_body(self, run: Run, offered: dict[str, UpstreamTool]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": run.spec.model or self.default_model, "messages": run.messages}
        if run.spec.maxTokens > 0:
            body["max_tokens"] = run.spec.maxTokens
        if offered:
            body["tools"] = [t.openai() for t in offered.values()]
            if run.spec.parallelToolCalls:
                body["parallel_tool_calls"] = True
        return body

    async def tool_round_step(
        self, runs: Runs, run: Run, call: ToolCall, offered: dict[str, UpstreamTool], key: str = ""
    ) -> dict[str, Any] | None:
        """Runs one call (or refuses it) and returns the role "tool" message answering it; None
        when the run ended meanwhile (cancelled, or over a budget). `key` goes to the tool server
        as the call's idempotency key (`idempotency_key`)."""
        tool = offered.get(call.name)
        server = tool.server if tool else ""
        if call.id in run.sent_calls:
            # Sent before the run resumed and never answered: it may have taken effect, so it is
            # not sent again (counted when it was sent; it counts as failed).
            self.metrics.tool_call(server, "unknown")
            run.counters["failedToolCalls"] += 1
            log.info(
                "run %s: tool call %s was in flight when the run stopped; not sent again",
                run.handle,
                call.name,
            )
            return {
                "role": "tool",
                "tool_call_id": call.id,
                "content": UNKNOWN_OUTCOME.format(key=run.sent_calls[call.id]),
            }
        if run.counters["toolCalls"] >= run.spec.maxToolCalls:
            # Several calls in one reply can overrun the budget; the extra ones are not run.
            text = f"Error: not run: the tool-call budget of {run.spec.maxToolCalls} is spent; answer with what you have."
            self.metrics.tool_call(server, "not_run")
            return {"role": "tool", "tool_call_id": call.id, "content": text}
        if not runs.check_budgets(run, calling_tool=True):
            return None
        run.counters["toolCalls"] += 1
        failed = True
        outcome = "refused"
        if tool is None:
            text = f"Error: there is no tool named {call.name!r}; the tools are {', '.join(sorted(offered))}."
        else:
            try:
                arguments = prepare_arguments(call, tool.input_schema)
            except ArgumentError as e:
                text = f"Error: {e}"
            else:
                allowed = True
                if needs_approval(tool.name, tool.annotations, run.spec.approveTools):
                    try:
                        allowed = await ask_approval(runs, run, call.id, tool.name, arguments)
                    except asyncio.CancelledError:
                        if not run.running:
                            return None  # ended while waiting (cancelled, over budget)
                        raise
                if not run.running:
                    return None
                if not allowed:
                    outcome = "declined"
                    text = DECLINED_TEXT
                else:
                    runs.record_sent(run, call.id, tool.name, key)
                    await runs.journal.durable()  # stored before the request leaves
                    if not run.running:
                        return None
                    if not runs.journal.holds(run.handle):
                        # Another runtime took the run over (this one lost its lease): it drives
                        # the call from here, and this loop stops without sending it.
                        runs.let_go(run.handle)
                        raise asyncio.CancelledError
                    started = time.monotonic()
                    with spans.tool_call(tool.name, call.id) as span:
                        result = await self.tool_servers.call(tool, arguments, idempotency_key=key)
                        spans.tool_answered(span, result.is_error, result.text)
                    run.counters["toolSeconds"] += time.monotonic() - started
                    failed = result.is_error
                    outcome = "error" if failed else "ok"
                    text = (
                        f"Error: {result.text}"
                        if result.is_error and not result.text.startswith("Error")
                        else result.text
                    )
        self.metrics.tool_call(server, outcome)
        if failed:
            run.counters["failedToolCalls"] += 1
            log.info("run %s: tool call %s failed: %s", run.handle, call.name, text[:200])
        return {"role": "tool", "tool_call_id": call.id, "content": text}


def idempotency_key(handle: str, round_number: int, index: int) -> str:
    """The key a tool call carries to its server: the run, the round (0 for the first) and the
    call's place in it; no two calls share one. Tool calls are at most once: a call is journaled
    as sent under its key before it leaves, and one sent but not answered when its run resumes is
    never sent again (`UNKNOWN_OUTCOME`), so a server sees each key once at most."""
    return f"{handle}/{round_number}/{index}"
