"""The committed gRPC stubs must be what `scheduler.proto` generates today."""

from pathlib import Path

import pytest

from luftpause.proto import generate


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    generate.generate(tmp_path)
    for name in generate.STUBS:
        committed = (generate.HERE / name).read_text()
        fresh = (tmp_path / name).read_text()
        assert committed == fresh, (
            f"proto/{name} is stale: run `python -m luftpause.proto.generate` and commit the result"
        )


def test_stubs_expose_the_two_rpcs() -> None:
    from luftpause.proto import rpc

    servicer = rpc.SchedulerServicer
    assert {"Turns", "Resync"} <= set(dir(servicer))
