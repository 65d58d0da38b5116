"""The dataplane: the OpenAI-compatible proxy agents point their base_url at.

It resolves each turn's run, has the scheduler admit it, forwards it unchanged to the placed
engine (but for a priority, where the engine honours one), streams the reply back while reading
it on the side, and reports what happened.
`app.serve(config)` runs it. Modules: `app` (routes), `proxy` (the per-turn path), `decide`
(`POST /v1/decide`), `engine_client` (HTTP/1.1 to the engines), `sse` (the side reader),
`scheduler_client` (the Turns stream and Resync), `runs` (the view kept for resyncs), `run_identity`,
`headers`, `priority` (engine priorities in the body), `auth` (`LUFTPAUSE_TOKEN`), `metrics`
(`GET /metrics`), `errors`.
"""
