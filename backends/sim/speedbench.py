"""How fast the virtual-clock engine simulates: engine steps per CPU-second.

``python -m backends.sim.speedbench`` keeps 64 sequences running (a closed
loop: every finished request is replaced at once, so prefills, finishes and
block allocation are all in the mix) with a listener that counts tokens, and
prints steps per CPU-second. Target: >= 50,000.
"""

from __future__ import annotations

import argparse
import time

from backends.sim.base import GenerationRequest, TokenEvent
from backends.sim.profiles import get_profile
from backends.sim.virtual import VirtualEngine


class _Client:
    __slots__ = ("engine", "issued", "limit", "tokens")

    def __init__(self, engine: VirtualEngine, limit: int) -> None:
        self.engine = engine
        self.issued = 0
        self.limit = limit
        self.tokens = 0

    def send(self, output_tokens: int) -> None:
        self.issued += 1
        request = GenerationRequest(
            request_id=f"{id(self)}-{self.issued}",
            prompt_tokens=1024,
            max_tokens=output_tokens,
            ignore_eos=True,
        )
        self.engine.submit(request, self)

    def on_token(self, now: float, event: TokenEvent) -> None:
        self.tokens += 1
        if event.finish_reason is not None and self.issued < self.limit:
            self.send(event.index + 1)


def measure(
    profile: str = "qwen3-4b/l40s/bf16/vllm", running: int = 64, steps: int = 200_000
) -> tuple[int, float]:
    """(engine steps executed, CPU seconds spent) for about ``steps`` steps."""
    engine = VirtualEngine(get_profile(profile))
    clients = [_Client(engine, limit=1 << 30) for _ in range(running)]
    for i, client in enumerate(clients):
        client.send(1024 + 16 * i)  # staggered lengths: finishes spread out
    start = time.process_time()
    for _ in range(steps):
        engine.advance()
    return steps, time.process_time() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="qwen3-4b/l40s/bf16/vllm")
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200_000)
    args = parser.parse_args(argv)
    steps, cpu = measure(args.profile, args.running, args.steps)
    print(
        f"{args.profile}: {steps:,} steps with {args.running} running sequences in "
        f"{cpu:.2f} CPU-s = {steps / cpu:,.0f} steps per CPU-second (target >= 50,000)"
    )


if __name__ == "__main__":
    main()
