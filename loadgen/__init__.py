"""Load generator: closed-loop own-loop agents through the proxy (`luftpause loadgen`).

`conversation` is what an agent says (shared with the simulator in `bench/sim`), `agents` runs
them against the dataplane with a live progress line and a JSON summary (runs/min, run time p50
and p90, turns, tool calls, errors, turns by replica). Sub-agent fan-out over MCP is
`luftpause bench fanout`.
"""
