"""What the fake engine says: the deterministic tool-call rule, arguments from schemas, filler text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.fake_engine.replies import ReplyError, compose_reply, planned_tool_calls

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
DEEP = {
    "type": "function",
    "function": {
        "name": "deep_search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "depth": {"type": "integer", "minimum": 2, "maximum": 4},
                "mode": {"enum": ["fast", "thorough"]},
                "filters": {"$ref": "#/$defs/Filters"},
                "note": {"anyOf": [{"type": "null"}, {"type": "string"}]},
            },
            "required": ["query", "depth", "mode", "filters", "note"],
            "$defs": {
                "Filters": {
                    "type": "object",
                    "properties": {
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "exact": {"type": "boolean"},
                    },
                    "required": ["tags", "exact"],
                }
            },
        },
    },
}
TOOLS = [LOOKUP, DEEP]


def run_conversation(question: str, tools=TOOLS, tool_choice=None) -> tuple[list[dict], list]:
    """Plays an agent loop against the reply function until it answers in text; returns the
    conversation and the replies, as a harness would see them."""
    messages: list[dict] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    replies = []
    for _ in range(10):
        reply = compose_reply(messages, tools, tool_choice, None, reply_tokens=32)
        replies.append(reply)
        if reply.tool_call is None:
            return messages, replies
        call = reply.tool_call
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result of {call.name}"})
    raise AssertionError("the conversation never ended in a text answer")


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=0, max_size=200))
def test_each_conversation_makes_one_to_three_tool_calls_then_answers(question: str) -> None:
    _, replies = run_conversation(question)
    calls = [r for r in replies if r.tool_call is not None]
    assert 1 <= len(calls) <= 3
    assert all(r.finish_reason == "tool_calls" for r in calls)
    assert replies[-1].finish_reason == "stop" and replies[-1].text
    assert len(calls) == planned_tool_calls([{"role": "user", "content": question}])


def test_tool_call_counts_cover_one_two_and_three() -> None:
    counts = {len(run_conversation(f"question number {i}")[1]) - 1 for i in range(30)}
    assert counts == {1, 2, 3}


def test_the_most_tool_calls_is_a_parameter_whose_default_is_three() -> None:
    questions = [[{"role": "user", "content": f"question number {i}"}] for i in range(60)]
    assert [planned_tool_calls(q) for q in questions] == [planned_tool_calls(q, 3) for q in questions]
    assert {planned_tool_calls(q, 1) for q in questions} == {1}
    assert {planned_tool_calls(q, 6) for q in questions} == {1, 2, 3, 4, 5, 6}
    with pytest.raises(ValueError, match="at least one tool call"):
        planned_tool_calls(questions[0], 0)
    deep = questions[0]
    while compose_reply(deep, TOOLS, None, None, 32, max_tool_calls=1).tool_call is not None:
        deep = [*deep, {"role": "tool", "tool_call_id": "x", "content": "found"}]
    assert len(deep) == 2  # one call, then the answer


def test_the_same_conversation_gets_the_same_replies() -> None:
    first = run_conversation("Who wrote Dune?")
    second = run_conversation("Who wrote Dune?")
    assert first == second


def test_count_depends_only_on_the_first_user_message() -> None:
    base = [{"role": "user", "content": "Compare two cities."}]
    with_system = [{"role": "system", "content": "anything"}, *base, {"role": "user", "content": "more"}]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Compare two cities."}]}]
    assert planned_tool_calls(base) == planned_tool_calls(with_system) == planned_tool_calls(as_parts)


def test_tool_call_ids_differ_between_calls_of_a_run_and_look_like_openai_ids() -> None:
    question = next(
        q for q in (f"q{i}" for i in range(100)) if planned_tool_calls([{"role": "user", "content": q}]) == 3
    )
    _, replies = run_conversation(question)
    ids = [r.tool_call.id for r in replies if r.tool_call]
    assert len(ids) == 3 == len(set(ids))
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_arguments_satisfy_the_tool_schema() -> None:
    messages = [{"role": "user", "content": "Find the tallest mountain in Europe please"}]
    reply = compose_reply(messages, [DEEP], "required", None, reply_tokens=32)
    assert reply.tool_call is not None and reply.tool_call.name == "deep_search"
    args = json.loads(reply.tool_call.arguments)
    assert args["query"] == "Find the tallest mountain in Europe"  # the message's first six words
    assert 2 <= args["depth"] <= 4 and isinstance(args["depth"], int)
    assert args["mode"] in ("fast", "thorough")
    assert isinstance(args["filters"]["exact"], bool) and isinstance(args["filters"]["tags"][0], str)
    assert isinstance(args["note"], str)
    # Optional properties stay out, as a model usually leaves them.
    lookup = compose_reply(messages, [LOOKUP], "required", None, reply_tokens=32).tool_call
    assert lookup is not None and json.loads(lookup.arguments) == {"query": args["query"]}


def test_streamed_pieces_reassemble_the_tool_call() -> None:
    reply = compose_reply([{"role": "user", "content": "x"}], [LOOKUP], None, None, reply_tokens=32)
    assert reply.tool_call is not None
    assert reply.pieces[0] == "lookup"
    assert "".join(reply.pieces[1:]) == reply.tool_call.arguments
    assert reply.completion_tokens == len(reply.pieces)


def test_tool_choice_none_or_no_tools_answers_in_text() -> None:
    messages = [{"role": "user", "content": "hello"}]
    assert compose_reply(messages, TOOLS, "none", None, reply_tokens=32).tool_call is None
    assert compose_reply(messages, [], None, None, reply_tokens=32).tool_call is None
    assert compose_reply(messages, None, "auto", None, reply_tokens=32).tool_call is None


def test_named_tool_choice_picks_that_tool_or_is_refused() -> None:
    messages = [{"role": "user", "content": "hello"}]
    choice = {"type": "function", "function": {"name": "deep_search"}}
    reply = compose_reply(messages, TOOLS, choice, None, reply_tokens=32)
    assert reply.tool_call is not None and reply.tool_call.name == "deep_search"
    with pytest.raises(ReplyError, match="missing"):
        compose_reply(
            messages, TOOLS, {"type": "function", "function": {"name": "missing"}}, None, reply_tokens=32
        )


def test_text_is_cut_by_max_tokens() -> None:
    messages = [{"role": "user", "content": "hello"}]
    full = compose_reply(messages, None, None, None, reply_tokens=32)
    assert (full.completion_tokens, full.finish_reason) == (32, "stop")
    assert compose_reply(messages, None, None, 64, reply_tokens=32).finish_reason == "stop"
    cut = compose_reply(messages, None, None, 5, reply_tokens=32)
    assert (cut.completion_tokens, cut.finish_reason) == (5, "length")
    assert full.text is not None and cut.text is not None and full.text.startswith(cut.text)
