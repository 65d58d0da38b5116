"""The scheduler: decides where and when each turn of each run goes on the engine pool.

`core.decide(state, event) -> (state, actions)` is the whole policy, pure and replayable, over
`state.State` (persistent maps and the B-tree sets of `ordered`), the events in `events` and the
actions in `actions`. `host` carries events in and actions out, and serves gRPC to the dataplanes
(the Turns stream and Resync, translated by `wire`, guarded by `grpc_auth`); `main.serve(config)`
is the process: that, the prober (`prober`), a 1 s clock, and the status document and page
(`status`) on the status port.
"""

from luftpause.scheduler.core import decide, replay
from luftpause.scheduler.state import State

__all__ = ["State", "decide", "replay"]
