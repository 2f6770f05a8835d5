"""The control loop: each backend's window becomes a Sample, its controller a limit.

Pure and clock-free apart from the times handed in, so the same code runs in
the gateway (ticked every ``admission.control_interval_s``) and in whole-system
simulations on a virtual clock. Controllers outlive config snapshots: on
reload a backend's controller is rebuilt from the new config starting at its
current limit (see :func:`policies.registry.reconfigure`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from backends.replica import EngineGauges, Replica
from policies.base import LimitController, Sample
from policies.registry import LimitConfig, build_controller, reconfigure

# Fewer TTFTs than this in the window make a p95 that means nothing.
MIN_LATENCY_SAMPLES = 5


def sample_of(replica: Replica, now: float, engine: EngineGauges | None, demand: int) -> Sample:
    """``engine``: the engine's own gauges if freshly scraped, else None."""
    stats = replica.window.stats(now)
    waiting = None if engine is None or engine.waiting is None else int(engine.waiting)
    enough = stats.ttft_samples >= MIN_LATENCY_SAMPLES
    return Sample(
        now=now,
        ttft_p95=stats.ttft_p95 if enough else None,
        itl_p95=stats.itl_p95 if enough else None,
        output_tokens_per_s=stats.output_tokens_per_s,
        in_flight=replica.in_flight,
        completed=stats.completed,
        engine_waiting=waiting,
        demand=demand,
        engine_kv_usage=None if engine is None else engine.kv_usage,
        ttft_p95_bound=enough and stats.ttft_p95_bound,
    )


@dataclass(slots=True)
class _Control:
    replica: Replica  # the one it learned: an id may be a new object's once that one is gone
    config: LimitConfig
    controller: LimitController


class LimitLoop:
    """A controller per replica object, not per name: what it learned is that engine's, so
    a backend renamed at its URL (the same replica, see ``Runtime._keepable``) keeps it, and
    one re-addressed (a new replica: another engine, maybe) starts afresh."""

    def __init__(self) -> None:
        self._controls: dict[int, _Control] = {}

    def sync(
        self, replicas: Iterable[Replica], config_of: Callable[[Replica], LimitConfig]
    ) -> None:
        """Startup and reload: a controller per replica, limits applied at once."""
        live: dict[int, _Control] = {}
        for replica in replicas:
            config = config_of(replica)
            control = self._control_of(replica)
            if control is None:
                control = _Control(replica, config, build_controller(config))
            elif control.config != config:
                control = _Control(replica, config, reconfigure(control.controller, config))
            live[id(replica)] = control
            replica.limit = control.controller.limit
        self._controls = live

    def tick(
        self,
        replicas: Iterable[Replica],
        now: float,
        engine_of: Callable[[Replica], EngineGauges | None],
        demand_of: Callable[[Replica], int],
    ) -> bool:
        """Feed every controller one sample; True when some limit went up."""
        raised = False
        for replica in replicas:
            control = self._control_of(replica)
            if control is None:
                continue
            sample = sample_of(replica, now, engine_of(replica), demand_of(replica))
            limit = control.controller.update(sample)
            raised |= limit > replica.limit
            replica.limit = limit
        return raised

    def _control_of(self, replica: Replica) -> _Control | None:
        control = self._controls.get(id(replica))
        return control if control is not None and control.replica is replica else None
