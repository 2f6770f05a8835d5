"""How much slower a small piece of Python runs after the core did something else for a while.

    taskset -c 0 python docs/experiments/cold-snippet.py [ROUNDS]

The piece is one ``json.loads`` of a request body and a dict copy (ROUNDS times,
default 1), timed alone after each pause: none, a sleep, or a busy spin of the
same length. Throwaway measurement code, kept for the figures in relay-floors.md.
"""

import json
import statistics
import sys
import time

BODY = json.dumps(
    {
        "model": "Qwen/Qwen3-4B",
        "messages": [{"role": "user", "content": "hello there " * 20}],
        "stream": True,
        "max_tokens": 128,
    }
).encode()
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 1


def piece() -> int:
    size = 0
    for _ in range(ROUNDS):
        payload = json.loads(BODY)
        size += len(dict(payload)) + len(payload["messages"][0]["content"])
    return size


def median_us(pause_s: float, spin: bool, samples: int) -> float:
    times = []
    for _ in range(samples):
        if spin:
            until = time.perf_counter() + pause_s
            while time.perf_counter() < until:
                pass
        elif pause_s:
            time.sleep(pause_s)
        start = time.perf_counter()
        piece()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


for label, pause_s, spin, samples in (
    ("back to back", 0.0, False, 200),
    ("after a 0.1 ms sleep", 0.0001, False, 200),
    ("after a 1 ms sleep", 0.001, False, 200),
    ("after a 30 ms sleep", 0.03, False, 100),
    ("after a 30 ms busy spin", 0.03, True, 100),
):
    print(f"{label:26s} {median_us(pause_s, spin, samples):8.1f} µs")
