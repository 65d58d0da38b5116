"""What a request without a run header says about its run: the tool_call_ids it echoes, newest first."""

from luftpause.dataplane.run_identity import echoed_tool_call_ids


def _tool_round(call_ids: list[str]) -> list[dict]:
    """The messages of a turn that sends tool results back for `call_ids`."""
    return [
        {"role": "user", "content": "look it up"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
                for i in call_ids
            ],
        },
        *({"role": "tool", "tool_call_id": i, "content": "result"} for i in call_ids),
    ]


def test_the_newest_echoed_ids_come_first():
    messages = _tool_round(["old_1"]) + _tool_round(["new_1", "new_2"])
    assert list(echoed_tool_call_ids(messages)) == ["new_2", "new_1", "new_1", "new_2", "old_1", "old_1"]


def test_ids_in_the_assistant_message_alone_are_found():
    messages = _tool_round(["a1"])[:2]
    assert list(echoed_tool_call_ids(messages)) == ["a1"]


def test_malformed_messages_are_skipped_not_fatal():
    messages = [
        "not a message",
        {"role": "tool"},
        {"role": "tool", "tool_call_id": 7},
        {"role": "assistant", "tool_calls": "nope"},
        {"role": "assistant", "tool_calls": [None, {"id": ""}, {"id": "ok"}]},
    ]
    assert list(echoed_tool_call_ids(messages)) == ["ok"]
    assert list(echoed_tool_call_ids({"not": "a list"})) == []
