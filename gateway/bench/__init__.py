"""`kneecap bench`: sweep load against a target, find the throughput-latency knee.

The sweep runs against an OpenAI-compatible URL (``loadgen``) or the simulator's
engine on its virtual clock (``simtarget``); both hand back the same per-request
records, so the statistics, the knee and every report are shared.
"""
