"""The whole system in virtual time: clients, admission, limit control, simulated engines.

``SystemSim`` plays the gateway's admission and control loop (with the real
replicas, windows, ``LimitLoop`` and controllers) in front of virtual-clock
engines; ``load`` has the client populations, ``report`` turns a run into
figures, ``acceptance`` prints issue 6's acceptance and ``http_check`` checks
the same claim through the real HTTP path. Routing policies plug in through
``Router`` and ``Admits`` (see ``model``).
"""

from backends.sim.system.load import ClosedLoop, Poisson, Shape
from backends.sim.system.model import (
    Admits,
    PoolSpec,
    RoundRobin,
    Router,
    SimBackend,
    SimRequest,
    always,
    least_loaded,
    within_limit,
    within_token_budget,
)
from backends.sim.system.sim import BackendSpec, Interval, SystemSim

__all__ = [
    "Admits",
    "BackendSpec",
    "ClosedLoop",
    "Interval",
    "Poisson",
    "PoolSpec",
    "RoundRobin",
    "Router",
    "Shape",
    "SimBackend",
    "SimRequest",
    "SystemSim",
    "always",
    "least_loaded",
    "within_limit",
    "within_token_budget",
]
