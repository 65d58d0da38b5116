"""JSON the dataplane changes on its way through: a member put first, or a value encoded anew.

The dataplane passes a client's body on as its bytes, spacing and escapes included; where an
engine needs one more top-level member (a `priority`, `stream_options`), it goes in right after
the object's opening brace and the rest is copied as it came. Only the caller knows, from the
JSON it decoded anyway, that the body's top level does not already have that member. Where a
member that is there must change (or a stream event must lose one), the value is encoded anew
(`encoded`), which is rare enough to cost nothing on the whole.
"""

from __future__ import annotations

import json
import re

# JSON's insignificant whitespace (RFC 8259); `bytes.strip()` would take more.
_SPACE = re.compile(rb"[ \t\n\r]*")


def with_first_member(body: bytes, member: bytes) -> bytes:
    """`body`, a JSON object, with `member` (`"key":value`, encoded) as its first member.

    A body that does not open with `{` in UTF-8 (a UTF-16 or UTF-32 one, which JSON parsers
    also accept, has NUL bytes in its first four) is returned unchanged.
    """
    space = _SPACE.match(body)
    assert space is not None  # the pattern matches the empty string too: never None
    brace = space.end()
    if body[brace : brace + 1] != b"{" or b"\x00" in body[:4]:
        return body
    after = brace + 1
    # `{}` takes no comma; a turn's body never is one, but the insertion must stay valid JSON.
    space = _SPACE.match(body, after)
    assert space is not None
    first = space.end()
    if body[first : first + 1] != b"}":
        member += b","
    return b"".join((body[:after], member, memoryview(body)[after:]))


def encoded(value: object) -> bytes:
    """`value` as compact JSON, for the rare body or event that must be encoded anew.

    Compact and with text as UTF-8, as the engines' own encoders write it (pydantic's, in SGLang
    and vLLM), so that the bytes differ from theirs as little as may be; text with a lone
    surrogate (from a `\\ud800` escape), which UTF-8 cannot hold, is written with escapes instead.
    """
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()
