"""The side reader: what it learns from a streamed or whole reply, however the bytes are cut."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from luftpause.dataplane.sse import StreamObserver, observe_completion, says_something


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


def test_comments_and_garbage_are_ignored():
    stream = b": keep-alive\n\nevent: message\ndata: {not json\n\n" + TEXT_STREAM
    seen, _ = _observe(stream, [])
    assert seen.finish_reason == "stop" and seen.done


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
