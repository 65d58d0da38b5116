"""A replica's defaults, taken unless its config says otherwise: here, with no imports, so that
the scheduler's pure core reads them without loading the config and pydantic with it
(tests/scheduler/test_core_purity.py). `luftpause.config` offers them as its own.
"""

# Turns of ours that may wait in one engine's own queue at once (the rule is
# scheduler/admission.py's).
LOOKAHEAD = 2
# The fewest runs of a size an engine's KV pool must keep warm for the run gate to hold runs of
# that size there (the rule is scheduler/gate.py's).
GATE_MIN_RUNS = 10
# How long a replica whose turns keep failing is first taken out of rotation; each further
# ejection lasts one more such time, at most ten (scheduler/outliers.py).
OUTLIER_EJECTION_BASE_S = 30.0
