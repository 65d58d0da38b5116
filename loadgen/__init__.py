"""Load generator: closed-loop agents through the proxy and sub-agent fan-out over MCP.

Not built yet: `luftpause loadgen` arrives with the calibrated engine model (the simulator issue).
Until then `luftpause bench fanout` drives sub-agents over MCP and `examples/own_loop_agent.py`
shows one own-loop agent through the proxy.
"""
