"""What the sweep needs from a target: an HTTP endpoint or a simulated engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.bench.phase import LoadPoint, Phase
from gateway.bench.stats import PointSummary
from gateway.bench.workload import Workload


class Progress(Protocol):
    def tick(self, phase: Phase, now: float) -> None:
        """A request finished; ``now`` is on the target's clock."""
        ...


class PointProgress(Progress, Protocol):
    """Progress that also hears when each load point begins and ends."""

    def begin(
        self, number: int, total: int, target: str, workload: str, point: LoadPoint
    ) -> None: ...

    def end(self, summary: PointSummary) -> None: ...


class Target(Protocol):
    label: str

    async def prepare(self, workloads: Sequence[Workload]) -> list[str]:
        """Check the target can serve the workloads; returns notes for the report.

        Raises :class:`gateway.bench.client.TargetError` when it cannot.
        """
        ...

    async def run_point(
        self, point: LoadPoint, workload: Workload, progress: Progress
    ) -> Phase: ...

    async def aclose(self) -> None: ...
