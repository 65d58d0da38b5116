"""The simulator: agents, engine replicas and a placement policy per arm, in virtual time.

`luftpause bench sim SCENARIO [--json] [--seed N] [--arms A,B] [knobs]` runs every arm of a scenario
(`scenarios`) against the fake engine's model (`luftpause.fake_engine.engine`, one per replica,
stepped on a virtual clock by `replica`), with the agents of `agents` and the placement of
`arms`; the `luftpause` arms run the scheduler's real `decide`. It prints a table, or with
`--json` one JSON object, and writes a record under bench/results/. Deterministic: the same
seed gives the same figures. How the engine's parameters were fixed: CALIBRATION.md here. The
knobs (`cli.KNOBS`: KV pool, slots, tool latency and count, context size, agents) vary a scenario.
"""

from __future__ import annotations

from luftpause.bench.sim.cli import main

__all__ = ["main"]
