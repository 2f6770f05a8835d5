"""The relay benchmark: what the gateway adds over talking to the backend directly.

``python -m gateway.perf.relay_bench`` runs a fast raw-socket backend
(:mod:`gateway.perf.backend`), a raw-socket load generator
(:mod:`gateway.perf.loadgen`) and the gateway as a real process pinned to one
core, and prints direct vs through-gateway figures side by side.
"""
