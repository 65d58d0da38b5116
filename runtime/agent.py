"""The sub-agent loop: model turns through the dataplane, tool calls against the tool servers.

Each turn sends the run's conversation to the dataplane with the tools the run may use. A reply
with tool calls starts a tool round: the calls run one after another against the upstream MCP
servers (holding no turn slot meanwhile: the engine only sees the next turn), their results are
appended as role "tool" messages, and the round is journaled before the next turn is sent. A
reply without tool calls is the run's answer. Once `maxToolCalls` calls are spent the model is
offered no tools, so a run takes at most `maxToolCalls + 1` turns.

The loop starts from whatever conversation the run holds, which is how a run restored from the
journal resumes after its last complete tool round.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from luftpause.runtime.llm import Dataplane, TurnFailed
from luftpause.runtime.runs import Run, Runs
from luftpause.runtime.tool_calls import (
    ArgumentError,
    ToolCall,
    calls_in,
    prepare_arguments,
    recover_text_calls,
)
from luftpause.runtime.tool_servers import ToolServers, UpstreamTool

log = logging.getLogger(__name__)

CALLER_MAX_BYTES = 128

_UNSAFE_HEADER_CHARS = re.compile(r"[^\x21-\x7e]")


def caller_header(caller: str) -> str:
    """A caller identity as a header value: visible ASCII only, at most 128 bytes."""
    return _UNSAFE_HEADER_CHARS.sub("_", caller)[:CALLER_MAX_BYTES]


class Agent:
    """Runs sub-agent loops; one instance serves every run."""

    def __init__(self, dataplane: Dataplane, tool_servers: ToolServers, default_model: str) -> None:
        self.dataplane = dataplane
        self.tool_servers = tool_servers
        self.default_model = default_model

    def headers(self, run: Run) -> dict[str, str]:
        headers = {"x-luftpause-run-id": run.handle, "x-luftpause-class": run.spec.serviceClass}
        if run.caller:
            headers["x-luftpause-caller"] = caller_header(run.caller)
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
        while run.running:
            tools = self.allowed_tools(run)
            offered = tools if tools and run.counters["toolCalls"] < run.spec.maxToolCalls else {}
            try:
                reply = await self.dataplane.complete(self.request_body(run, offered), self.headers(run))
            except TurnFailed as e:
                runs.finish(run, "failed", error=f"turn {run.counters['turns'] + 1} failed: {e}")
                break
            run.counters["turns"] += 1
            usage = reply.get("usage") or {}
            run.counters["promptTokens"] += int(usage.get("prompt_tokens") or 0)
            run.counters["completionTokens"] += int(usage.get("completion_tokens") or 0)

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
            round_messages = [
                {"role": "assistant", "content": content, "tool_calls": [c.as_message_part() for c in calls]}
            ]
            for call in calls:
                round_messages.append(await self.tool_round_step(run, call, offered))
            runs.record_round(run, round_messages)

    def request_body(self, run: Run, offered: dict[str, UpstreamTool]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": run.spec.model or self.default_model, "messages": run.messages}
        if run.spec.maxTokens > 0:
            body["max_tokens"] = run.spec.maxTokens
        if offered:
            body["tools"] = [t.openai() for t in offered.values()]
        return body

    async def tool_round_step(
        self, run: Run, call: ToolCall, offered: dict[str, UpstreamTool]
    ) -> dict[str, Any]:
        """Runs one call (or refuses it) and returns the role "tool" message answering it."""
        if run.counters["toolCalls"] >= run.spec.maxToolCalls:
            # Several calls in one reply can overrun the budget; the extra ones are not run.
            text = f"Error: not run: the tool-call budget of {run.spec.maxToolCalls} is spent; answer with what you have."
            return {"role": "tool", "tool_call_id": call.id, "content": text}
        run.counters["toolCalls"] += 1
        failed = True
        tool = offered.get(call.name)
        if tool is None:
            text = f"Error: there is no tool named {call.name!r}; the tools are {', '.join(sorted(offered))}."
        else:
            try:
                arguments = prepare_arguments(call, tool.input_schema)
            except ArgumentError as e:
                text = f"Error: {e}"
            else:
                result = await self.tool_servers.call(tool, arguments)
                failed = result.is_error
                text = (
                    f"Error: {result.text}"
                    if result.is_error and not result.text.startswith("Error")
                    else result.text
                )
        if failed:
            run.counters["failedToolCalls"] += 1
            log.info("run %s: tool call %s failed: %s", run.handle, call.name, text[:200])
        return {"role": "tool", "tool_call_id": call.id, "content": text}
