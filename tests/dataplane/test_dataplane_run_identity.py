"""Run identity: the run header, else the tool_call_ids an agent echoes back, else a new run."""

from luftpause.dataplane.run_identity import ToolCallMemory, echoed_tool_call_ids, resolve_run_id


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


def test_the_run_header_wins_over_echoed_ids():
    memory = ToolCallMemory()
    memory.remember(["call_1"], "run-a", now=0.0)
    assert resolve_run_id("run-b", _tool_round(["call_1"]), memory, now=1.0) == "run-b"


def test_echoed_tool_call_ids_find_the_run_that_made_them():
    memory = ToolCallMemory()
    memory.remember(["call_1", "call_2"], "run-a", now=0.0)
    assert resolve_run_id(None, _tool_round(["call_2"]), memory, now=1.0) == "run-a"


def test_the_newest_echoed_id_decides():
    memory = ToolCallMemory()
    memory.remember(["old"], "run-old", now=0.0)
    memory.remember(["new"], "run-new", now=0.0)
    messages = _tool_round(["old"]) + _tool_round(["new"])
    assert resolve_run_id(None, messages, memory, now=1.0) == "run-new"


def test_ids_in_the_assistant_message_alone_are_enough():
    memory = ToolCallMemory()
    memory.remember(["call_9"], "run-a", now=0.0)
    messages = _tool_round(["call_9"])[:2]  # the tool result not sent yet
    assert resolve_run_id(None, messages, memory, now=1.0) == "run-a"


def test_no_header_and_no_known_id_make_a_new_run_each_time():
    memory = ToolCallMemory()
    first = resolve_run_id(None, _tool_round(["unknown"]), memory)
    second = resolve_run_id(None, [{"role": "user", "content": "hi"}], memory)
    assert first != second
    assert len(first) == 32 and int(first, 16) >= 0


def test_a_blank_run_header_counts_as_absent():
    memory = ToolCallMemory()
    memory.remember(["call_1"], "run-a", now=0.0)
    assert resolve_run_id("  ", _tool_round(["call_1"]), memory, now=1.0) == "run-a"


def test_ids_are_remembered_for_30_minutes():
    memory = ToolCallMemory()
    memory.remember(["call_1"], "run-a", now=0.0)
    assert memory.run_of("call_1", now=30 * 60.0) == "run-a"
    assert memory.run_of("call_1", now=30 * 60.0 + 1) is None
    assert resolve_run_id(None, _tool_round(["call_1"]), memory, now=30 * 60.0 + 1) != "run-a"


def test_prune_drops_only_ids_past_their_time():
    memory = ToolCallMemory()
    memory.remember(["old"], "run-a", now=0.0)
    memory.remember(["fresh"], "run-b", now=1000.0)
    assert memory.prune(now=30 * 60.0 + 1) == 1
    assert len(memory) == 1
    assert memory.run_of("fresh", now=30 * 60.0 + 1) == "run-b"


def test_forget_run_drops_its_ids():
    memory = ToolCallMemory()
    memory.remember(["a1", "a2"], "run-a", now=0.0)
    memory.remember(["b1"], "run-b", now=0.0)
    memory.forget_run("run-a")
    assert memory.run_of("a1", now=1.0) is None
    assert memory.run_of("b1", now=1.0) == "run-b"


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
