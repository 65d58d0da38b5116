"""The dataplane: the OpenAI-compatible proxy agents point their base_url at.

It resolves each turn's run, has the scheduler admit it, forwards it unchanged to the placed
engine, streams the reply back while reading it on the side, and reports what happened.
`app.serve(config)` runs it; `proxy` holds the per-turn path.
"""
