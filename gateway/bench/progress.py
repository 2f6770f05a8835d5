"""The live progress line on stderr.

On a terminal one line is rewritten in place at most every ``interval``
seconds of wall time (also during virtual-clock runs, which is why it reads
the wall clock itself rather than the target's). Elsewhere (CI logs) only a
line per finished point is written; with no stream (``--quiet``) nothing.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TextIO

from gateway.bench.phase import LoadPoint, Phase
from gateway.bench.stats import PointSummary

# A synthetic workload's label is its --prompt-tokens mix ("1024", "1024:0.8,8192:0.2"); a
# replayed one's is its file's name ("req.jsonl"), which is no number of tokens.
_MIX_LABEL = re.compile(r"\d+(:[^,]+)?(,\d+:[^,]+)*")


def prompts_of(workload: str) -> str:
    """A series' prompts in words: "1024-token prompts", "prompts from req.jsonl"."""
    if _MIX_LABEL.fullmatch(workload):
        return f"{workload}-token prompts"
    return f"prompts from {workload}"


class ProgressDisplay:
    def __init__(
        self,
        stream: TextIO | None,
        *,
        live: bool | None = None,
        interval: float = 0.25,
        wall: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._live = (stream is not None and stream.isatty()) if live is None else live
        self._interval = interval
        self._wall = wall
        self._last = float("-inf")
        self._head = ""
        self._width = 0

    def begin(self, number: int, total: int, target: str, workload: str, point: LoadPoint) -> None:
        self._head = f"[{number}/{total}] {target} · {prompts_of(workload)} · {point.label}"
        self._last = float("-inf")
        self._write(f"{self._head} · starting")

    def tick(self, phase: Phase, now: float) -> None:
        if not self._live or self._wall() - self._last < self._interval:
            return
        self._last = self._wall()
        done, p95, tok_s = phase.running(now)
        of = f"/{phase.target}" if phase.target else ""
        ttft = f"{p95 * 1e3:.0f} ms" if p95 is not None else "-"
        self._write(f"{self._head} · {done}{of} requests · p95 TTFT {ttft} · {tok_s:,.0f} tok/s")

    def end(self, summary: PointSummary) -> None:
        p95 = f"{summary.ttft.at(95.0) * 1e3:.0f} ms" if summary.ttft else "-"
        errors = f" · {summary.errors} errors" if summary.errors else ""
        verdict = {True: " · SLO ok", False: " · SLO missed", None: ""}[summary.slo_ok]
        self._write(
            f"{self._head} · {summary.requests} requests · p95 TTFT {p95} · "
            f"{summary.output_tok_s:,.0f} tok/s{errors}{verdict}",
            final=True,
        )

    def note(self, text: str) -> None:
        self._write(text, final=True)

    def _write(self, text: str, *, final: bool = False) -> None:
        if self._stream is None:  # --quiet
            return
        if self._live:
            pad = " " * max(0, self._width - len(text))
            self._stream.write("\r" + text + pad + ("\n" if final else ""))
            self._width = 0 if final else len(text)
        elif final:
            self._stream.write(text + "\n")
        self._stream.flush()
