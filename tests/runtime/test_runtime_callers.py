"""Caller identity of MCP requests and who may see which run (callers.py), on request contexts
shaped as the SDK hands them to the tools."""

from types import SimpleNamespace

from luftpause.runtime.callers import Who, token_identity, who_of


def ctx(headers: dict[str, str], name: str | None = "mcp", version: str | None = "0.1.0"):
    info = SimpleNamespace(name=name, version=version) if name else None
    return SimpleNamespace(
        headers=headers, session=SimpleNamespace(client_params=SimpleNamespace(client_info=info))
    )


def test_a_legacy_session_is_its_own_caller_and_owned_by_its_client():
    who = who_of(ctx({"mcp-session-id": "s-1", "x-luftpause-caller": "alice"}), None)
    assert who == Who(caller="s-1", owner="mcp/0.1.0@alice")


def test_a_sessionless_client_is_its_name_with_its_header_or_its_bearer():
    assert who_of(ctx({"x-luftpause-caller": "bob"}), None).caller == "mcp/0.1.0@bob"
    by_token = who_of(ctx({"authorization": "Bearer s3cret"}), None)
    assert by_token.caller == f"mcp/0.1.0@{token_identity('s3cret')}"
    assert "s3cret" not in by_token.caller
    assert who_of(ctx({}), None).caller == "mcp/0.1.0"
    assert who_of(ctx({}, name=None), None).caller == "anonymous"


def test_the_operator_token_sees_every_run_and_others_only_their_own():
    run = SimpleNamespace(caller="s-1", owner="mcp/0.1.0@alice", restored=False)
    operator = who_of(ctx({"authorization": "Bearer op"}), "op")
    assert operator.operator and operator.may_see(run)
    assert who_of(ctx({"mcp-session-id": "s-1"}), "op").may_see(run)
    # The same client on another session: not while the run's own session may still be live...
    alice_again = who_of(ctx({"mcp-session-id": "s-2", "x-luftpause-caller": "alice"}), "op")
    assert not alice_again.may_see(run)
    # ...but once the run was restored from the journal (its session died with the old process).
    assert alice_again.may_see(SimpleNamespace(**{**vars(run), "restored": True}))
    assert not who_of(ctx({"x-luftpause-caller": "bob"}), "op").may_see(
        SimpleNamespace(**{**vars(run), "restored": True})
    )
    # A run journaled before owners were recorded is everyone's.
    assert who_of(ctx({}), None).may_see(SimpleNamespace(caller="old", owner=None, restored=True))
