"""A simulated OpenAI-compatible inference engine (SGLang-like) for tests and benchmarks without GPUs.

`model` is the engine (slots, queue, timing), `replies` what it says, `server` its HTTP face.
"""
