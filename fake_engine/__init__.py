"""A simulated OpenAI-compatible inference engine (SGLang-like) for tests and benchmarks without GPUs.

`model` is the engine (slots, FIFO queue, timing), `tokens` how it counts, `replies` what it says
(deterministic tool calls), `logprobs` and `classify` its token scores and single-pass answers,
`protocol` and `metrics` the wire shapes, `server` the HTTP app (`create_app`, `serve`).
Timing overrides for a separate process: $LUFTPAUSE_FAKE_ENGINE_TIMING="field=value,...".
"""
