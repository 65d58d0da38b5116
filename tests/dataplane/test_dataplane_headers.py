"""The class and caller headers: what is accepted, what is a 400, how a caller is cut."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from luftpause.dataplane import headers
from luftpause.dataplane.errors import BadTurnRequest
from luftpause.proto import pb


def test_class_defaults_to_interactive():
    assert headers.service_class(None) == pb.INTERACTIVE


@pytest.mark.parametrize(("value", "expected"), [("interactive", pb.INTERACTIVE), ("batch", pb.BATCH)])
def test_class_accepts_its_two_values(value, expected):
    assert headers.service_class(value) == expected


@pytest.mark.parametrize("value", ["urgent", "Batch", "", "batch,interactive"])
def test_any_other_class_is_a_bad_request_naming_the_allowed_values(value):
    with pytest.raises(BadTurnRequest) as refused:
        headers.service_class(value)
    assert refused.value.status_code == 400
    assert "'interactive'" in refused.value.message and "'batch'" in refused.value.message
    assert "x-luftpause-class" in refused.value.message


def test_absent_caller_is_the_anonymous_caller():
    assert headers.caller(None) == ""


def _as_header(text: str) -> str:
    """What a server hands over for a header sent as UTF-8: the bytes decoded as latin-1."""
    return text.encode("utf-8").decode("latin-1")


def test_short_callers_pass_unchanged():
    assert headers.caller(_as_header("team-ä/agent 7")) == "team-ä/agent 7"


def test_long_callers_are_cut_at_128_bytes():
    assert headers.caller("x" * 300) == "x" * 128


def test_a_cut_never_splits_a_character():
    # 127 ASCII bytes, then a 2-byte character straddling byte 128.
    cut = headers.caller(_as_header("a" * 127 + "é" + "tail"))
    assert cut == "a" * 127


@given(st.text(min_size=0, max_size=200))
def test_a_cut_caller_is_a_prefix_of_at_most_128_bytes(text):
    cut = headers.caller(_as_header(text))
    assert len(cut.encode("utf-8")) <= 128
    assert text.startswith(cut)
    # Nothing more was dropped than the character the cut fell into.
    assert len(text.encode("utf-8")) <= 128 or len(cut.encode("utf-8")) > 128 - 4
