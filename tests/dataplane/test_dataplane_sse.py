"""The side reader: what it learns from a streamed or whole reply, however the bytes are cut."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from luftpause import counts
from luftpause.dataplane.sse import NotAnEventStream, StreamObserver, observe_completion, says_something


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


TEXT_STREAM = b"".join(
    [
        _event(_chunk({"role": "assistant", "content": ""})),
        _event(_chunk({"content": "Hel"})),
        _event(_chunk({"content": "lo"})),
        _event(_chunk({}, "stop")),
        _event({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}}),
        b"data: [DONE]\n\n",
    ]
)

TOOL_STREAM = b"".join(
    [
        _event(_chunk({"role": "assistant", "content": None})),
        _event(
            _chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": ""},
                        }
                    ]
                }
            )
        ),
        _event(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"q": "x"}'}}]})),
        _event(
            _chunk(
                {
                    "tool_calls": [
                        {
                            "index": 1,
                            "id": "call_b",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": "{}"},
                        }
                    ]
                }
            )
        ),
        _event(_chunk({}, "tool_calls")),
        b"data: [DONE]\n\n",
    ]
)


def _observe(stream: bytes, cuts: list[int]):
    observer = StreamObserver()
    first_token_at = []
    start = 0
    for n, end in enumerate([*sorted(cuts), len(stream)]):
        if observer.feed(stream[start:end]):
            first_token_at.append(n)
        start = end
    return observer.close(), first_token_at


def test_a_text_stream_gives_first_token_finish_reason_and_usage():
    seen, first = _observe(TEXT_STREAM, [])
    assert seen.first_token and first == [0]
    assert seen.finish_reason == "stop"
    assert (seen.prompt_tokens, seen.completion_tokens) == (12, 2)
    assert seen.tool_call_ids == []
    assert seen.done and seen.ran_to_its_end


def test_an_empty_role_chunk_is_not_the_first_token():
    observer = StreamObserver()
    assert observer.feed(_event(_chunk({"role": "assistant", "content": ""}))) is False
    assert observer.feed(_event(_chunk({"content": "x"}))) is True
    assert observer.feed(_event(_chunk({"content": "y"}))) is False


def test_a_tool_call_stream_gives_each_call_id_once():
    seen, first = _observe(TOOL_STREAM, [])
    assert seen.tool_call_ids == ["call_a", "call_b"]
    assert seen.finish_reason == "tool_calls"
    assert seen.first_token
    # Both calls name one tool: the run is paused on it, named once.
    assert seen.tool_names == ["lookup"]


def test_the_tools_a_reply_calls_are_named_each_once_and_bounded():
    calls = [
        {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": "{}"}}
        for n, name in enumerate(["read_file", "x" * 500, "read_file", 7, ""] + [f"t{k}" for k in range(30)])
    ]
    reply = {
        "choices": [{"message": {"role": "assistant", "tool_calls": calls}, "finish_reason": "tool_calls"}]
    }
    seen = observe_completion(json.dumps(reply).encode())
    assert len(seen.tool_call_ids) == len(calls)
    assert seen.tool_names[:2] == ["read_file", "x" * counts.TOOL_NAME_CHARS]
    assert len(seen.tool_names) == counts.MAX_TOOL_NAMES and "" not in seen.tool_names


@given(st.lists(st.integers(min_value=0, max_value=len(TOOL_STREAM)), max_size=12))
def test_any_cut_of_the_bytes_reads_the_same(cuts):
    seen, first = _observe(TOOL_STREAM, cuts)
    assert seen.tool_call_ids == ["call_a", "call_b"]
    assert seen.finish_reason == "tool_calls"
    assert seen.done and len(first) == 1


def test_crlf_line_endings_split_between_chunks():
    stream = TEXT_STREAM.replace(b"\n", b"\r\n")
    cut = stream.index(b"\r\n") + 1  # between "\r" and "\n"
    seen, _ = _observe(stream, [cut])
    assert seen.finish_reason == "stop" and seen.done


def test_streams_without_blank_lines_between_events_are_read():
    seen, _ = _observe(TEXT_STREAM.replace(b"\n\n", b"\n"), [])
    assert seen.first_token and seen.finish_reason == "stop" and seen.done


def test_a_stream_cut_short_did_not_run_to_its_end():
    seen, _ = _observe(TEXT_STREAM[: TEXT_STREAM.index(b'"stop"') - 30], [])
    assert seen.first_token
    assert not seen.ran_to_its_end


def test_an_error_event_inside_the_stream_is_noted():
    stream = _event(_chunk({"content": "x"})) + _event({"error": {"message": "out of memory", "code": 500}})
    seen, _ = _observe(stream + b"data: [DONE]\n\n", [])
    assert seen.error == "out of memory"
    # It still ended as a reply ends: the client gets it whole, and the turn is reported failed.
    assert seen.ran_to_its_end


def test_comments_event_names_and_ids_are_ignored():
    stream = b": keep-alive\n\nevent: message\nid: 7\nretry: 100\n" + TEXT_STREAM
    seen, _ = _observe(stream, [])
    assert seen.finish_reason == "stop" and seen.done


@pytest.mark.parametrize(
    "garbage",
    [
        b"event: message\ndata: {not json\n\n",
        b"<html>not an event stream</html>\n\n",
        b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n\x00\xff garbage\n',
    ],
    ids=["data-not-json", "not-sse", "after-a-token"],
)
def test_what_is_not_an_event_stream_of_json_is_an_error_before_it_is_passed_on(garbage: bytes):
    # The garbage first, then a stream that would have ended well: the observer must stop at it.
    with pytest.raises(NotAnEventStream):
        _observe(garbage + TEXT_STREAM, [])


def test_a_whole_reply_with_tool_calls():
    body = json.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 30, "completion_tokens": 5},
        }
    ).encode()
    seen = observe_completion(body)
    assert seen.first_token and seen.tool_call_ids == ["call_x"] and seen.finish_reason == "tool_calls"
    assert (seen.prompt_tokens, seen.completion_tokens) == (30, 5)


def test_a_whole_reply_that_is_not_json_says_nothing():
    seen = observe_completion(b"<html>bad gateway</html>")
    assert not seen.first_token and seen.finish_reason == "" and seen.tool_call_ids == []


def _compact(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("encode", [_event, _compact])
def test_the_byte_scan_skips_token_events_and_never_misses_the_rest(encode):
    token = _chunk({"content": "more"})
    assert not says_something(encode(token))
    assert not says_something(encode({**token, "usage": None}) * 3)
    assert says_something(encode(_chunk({}, "stop")))
    assert says_something(encode({**token, "usage": {"prompt_tokens": 1}}))
    assert says_something(encode(_chunk({"tool_calls": [{"index": 0, "id": "c1"}]})))
    assert says_something(encode({"error": {"message": "boom"}}))
    assert says_something(b"data: [DONE]\n\n")
    # A key's name inside a string is escaped, so text that merely mentions it is no event.
    assert not says_something(encode(_chunk({"content": 'say "finish_reason": "stop"'})))


def test_after_the_first_token_only_telling_events_are_decoded(monkeypatch):
    observer = StreamObserver()
    decoded = []
    real_loads = json.loads

    def counting_loads(data, *args, **kwargs):
        decoded.append(data)
        return real_loads(data, *args, **kwargs)

    monkeypatch.setattr("luftpause.dataplane.sse.json.loads", counting_loads)
    observer.feed(_event(_chunk({"role": "assistant", "content": "Hi"})))
    for _ in range(30):
        observer.feed(_event(_chunk({"content": " there"})))
    observer.feed(_event(_chunk({}, "stop")) + b"data: [DONE]\n\n")
    observation = observer.close()
    assert observation.first_token and observation.finish_reason == "stop" and observation.done
    assert len(decoded) == 2, "the first token's event and the finish, not the 30 in between"


# --- hide_usage: the stream as a client that did not ask for usage would have had it ---

USAGE = {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}
# TEXT_STREAM as the engine sends it unasked: no usage-only event.
TEXT_STREAM_UNASKED = TEXT_STREAM.replace(_event({"choices": [], "usage": USAGE}), b"")


def _relay(stream: bytes, cuts: list[int]) -> tuple[bytes, object]:
    """What a hiding observer passes on of `stream` fed in the pieces `cuts` make, and what it saw."""
    observer = StreamObserver(hide_usage=True)
    passed, start = [], 0
    for end in [*sorted(cuts), len(stream)]:
        observer.feed(stream[start:end])
        passed.append(observer.take())
        start = end
    seen = observer.close()
    passed.append(observer.take())
    return b"".join(passed), seen


def test_the_usage_only_event_is_dropped_with_its_blank_line_and_still_read():
    passed, seen = _relay(TEXT_STREAM, [])
    assert TEXT_STREAM_UNASKED != TEXT_STREAM
    assert passed == TEXT_STREAM_UNASKED
    assert (seen.prompt_tokens, seen.completion_tokens) == (12, 2) and seen.done


@given(st.lists(st.integers(min_value=0, max_value=len(TEXT_STREAM)), max_size=12))
def test_any_cut_of_the_bytes_passes_on_the_same_and_reads_the_same(cuts):
    passed, seen = _relay(TEXT_STREAM, cuts)
    assert passed == TEXT_STREAM_UNASKED
    assert (seen.prompt_tokens, seen.completion_tokens) == (12, 2)
    assert seen.finish_reason == "stop" and seen.done


def _crlf(stream: bytes) -> bytes:
    return stream.replace(b"\n", b"\r\n")


def _no_blank_lines(stream: bytes) -> bytes:
    return stream.replace(b"\n\n", b"\n")


def _no_final_break(stream: bytes) -> bytes:
    return stream.removesuffix(b"\n\n")


@pytest.mark.parametrize("variant", [_crlf, _no_blank_lines, _no_final_break])
def test_other_line_breaks_lose_the_usage_event_and_keep_their_own(variant):
    stream = variant(TEXT_STREAM)
    passed, seen = _relay(stream, [stream.index(b"usage") + 3])
    assert passed == variant(TEXT_STREAM_UNASKED)
    assert seen.prompt_tokens == 12 and seen.done


def test_usage_on_a_chunk_with_choices_is_taken_off_that_chunk_alone():
    last = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "é"}, "finish_reason": "stop"}]}
    stream = _event(_chunk({"content": "Hi"})) + _event({**last, "usage": USAGE}) + b"data: [DONE]\n\n"
    passed, seen = _relay(stream, [])
    assert (
        passed
        == _event(_chunk({"content": "Hi"}))
        + b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"\xc3\xa9"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    )
    assert (seen.prompt_tokens, seen.completion_tokens, seen.finish_reason) == (12, 2, "stop")


def test_null_usage_and_everything_else_pass_unchanged():
    # The OpenAI API's `"usage": null` on every chunk once usage is asked for goes on as it came.
    stream = (
        b": keep-alive\n\n"
        + _event({**_chunk({"role": "assistant", "content": ""}), "usage": None})
        + _event({**_chunk({"content": "Hi"}), "usage": None})
        + _event({**_chunk({}, "stop"), "usage": None})
        + b"data: [DONE]\n\n"
    )
    for cuts in ([], [5, 60, 61, len(stream) - 3]):
        passed, seen = _relay(stream, cuts)
        assert passed == stream
        assert seen.finish_reason == "stop" and seen.done


def test_an_error_event_with_usage_keeps_the_error():
    stream = _event(_chunk({"content": "x"})) + _event(
        {"choices": [], "error": {"message": "oom"}, "usage": USAGE}
    )
    passed, seen = _relay(stream, [])
    assert passed == _event(_chunk({"content": "x"})) + b'data: {"choices":[],"error":{"message":"oom"}}\n\n'
    assert seen.error == "oom"


def test_without_hide_usage_nothing_is_held_for_the_client():
    observer = StreamObserver()
    observer.feed(TEXT_STREAM)
    assert observer.take() == b""
