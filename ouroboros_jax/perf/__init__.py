"""Speed and memory: measured (`bench`, with the simulator's `calibration`; `memory`), compiled
for a target device (`compile`, `ouroboros compile`) and predicted (`simulate`).

Nothing is imported here: `simulate` stays standard library only at import, and `compile` brings
in JAX and the training layer; import the modules by their path.
"""
