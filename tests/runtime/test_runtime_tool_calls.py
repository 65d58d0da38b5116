"""Tool-call hygiene: what a sub-agent's malformed calls become before they reach a tool server."""

import json

import pytest

from luftpause.runtime.tool_calls import (
    ArgumentError,
    ToolCall,
    calls_in,
    prepare_arguments,
    recover_text_calls,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "exact": {"type": "boolean"},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["query"],
}


def call(arguments: str) -> ToolCall:
    return ToolCall(id="call_1", name="lookup", arguments=arguments)


def test_scalars_are_coerced_to_the_schema_types():
    args = prepare_arguments(call('{"query": 42, "limit": "3", "exact": "True", "score": "0.5"}'), SCHEMA)
    assert args == {"query": "42", "limit": 3, "exact": True, "score": 0.5}


def test_arguments_that_are_not_json_are_refused_with_the_parse_error():
    with pytest.raises(ArgumentError, match="not valid JSON"):
        prepare_arguments(call('{"query": "x"'), SCHEMA)


def test_arguments_that_are_not_an_object_are_refused_with_the_expected_shape():
    with pytest.raises(ArgumentError, match=r'expected \{"query": <string>'):
        prepare_arguments(call('["x"]'), SCHEMA)


def test_a_schema_passed_back_instead_of_arguments_is_refused_with_the_expected_shape():
    # What a 1B model does: it echoes the tool's schema as its arguments.
    with pytest.raises(ArgumentError) as e:
        prepare_arguments(call(json.dumps({"query": {"type": "string", "description": "what"}})), SCHEMA)
    message = str(e.value)
    assert "invalid arguments for lookup: query" in message
    assert '"query": <string>, "limit": <integer, optional>' in message


def test_a_missing_required_argument_is_refused():
    with pytest.raises(ArgumentError, match="'query' is a required property"):
        prepare_arguments(call('{"limit": 2}'), SCHEMA)


def test_empty_arguments_mean_an_empty_object():
    assert prepare_arguments(call(""), {"type": "object", "properties": {}}) == {}


def test_calls_in_an_assistant_message_keep_their_ids_and_arguments_as_text():
    message = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"query":"x"}'},
            },
            {"type": "function", "function": {"name": "deep_search", "arguments": {"query": "y"}}},
        ],
    }
    first, second = calls_in(message)
    assert (first.id, first.name, first.arguments) == ("call_a", "lookup", '{"query":"x"}')
    assert second.id.startswith("call_") and json.loads(second.arguments) == {"query": "y"}


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "lookup", "parameters": {"query": "rivers"}}',
        '```json\n{"type": "function", "function": {"name": "lookup", "arguments": {"query": "rivers"}}}\n```',
        '<function=lookup>{"query": "rivers"}</function>',
    ],
)
def test_a_call_written_as_text_is_recovered(text):
    (recovered,) = recover_text_calls(text, {"lookup", "deep_search"})
    assert recovered.name == "lookup" and json.loads(recovered.arguments) == {"query": "rivers"}


@pytest.mark.parametrize(
    "text",
    [
        "I would use lookup to find this, but the answer is 42.",
        '{"name": "unknown_tool", "parameters": {}}',
        '{"answer": 42}',
        'Here: <function=lookup>{"query": "x"}</function> and more prose',
    ],
)
def test_text_that_is_not_a_whole_call_to_an_offered_tool_stays_an_answer(text):
    assert recover_text_calls(text, {"lookup"}) == []
