"""Benchmarks: figures measured side by side in one run, written under `bench/results/`.

Benchmarks are not tests. Each prints ratios between arms run in the same process, interleaved,
and writes a JSON record and a markdown table so that a figure in the docs can be traced to
the command and the run that produced it.
"""
