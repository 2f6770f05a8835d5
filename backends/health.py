"""Active health probes: a dead replica is ejected, a recovered one readmitted.

Each round probes every replica of the current snapshot concurrently. A replica
passively ejected (``Replica.record_failure``) is readmitted only by a probe that
answers once its ejection is over: its ``/health`` may say 200 while it fails every
request. A replica that has no configured models gets them from its ``/v1/models`` on
each successful probe, so a backend that changes what it serves is followed; the
context length (``max_model_len``) is learned there too on each probe, unless
configured.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import anyio
import httpx

from backends.pool import BackendSet
from backends.replica import OnEjection, Replica, install_rotations, uncounted
from gateway.overload import GatewayOutOfResources, shortage_hint
from gateway.settings import HealthConfig

log = logging.getLogger("kneecap.health")


async def probe(client: httpx.AsyncClient, replica: Replica, config: HealthConfig) -> str | None:
    """None when the backend is healthy, else why not, for the log: an operator must see
    why a backend never came up (a URL ending in ``/v1`` answers 404), not only when one
    goes down."""
    headers = {}
    key = replica.config.resolved_api_key()
    if key:
        headers["authorization"] = f"Bearer {key}"
    try:
        response = await client.get(
            replica.url + config.path, headers=headers, timeout=config.timeout_s
        )
        if response.status_code != 200:
            return f"GET {replica.url + config.path} answered {response.status_code}"
        if not replica.config.models:
            models = await client.get(
                replica.url + "/v1/models", headers=headers, timeout=config.timeout_s
            )
            models.raise_for_status()
            replica.learn_models(models.json())
    except GatewayOutOfResources:
        raise  # no verdict on the backend: see probe_all
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    # Best effort, and on every probe: an engine redeployed at the same address with
    # another --max-model-len is followed (learnt once, a grown context stayed refused).
    if replica.config.models and replica.config.max_model_len is None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            models = await client.get(
                replica.url + "/v1/models", headers=headers, timeout=config.timeout_s
            )
            if models.status_code == 200:
                replica.learn_models(models.json())
    return None


async def probe_all(
    client: httpx.AsyncClient,
    backends: BackendSet,
    config: HealthConfig,
    on_change: Callable[[Replica], None],
    clock: Callable[[], float] = time.monotonic,
    on_ejection: OnEjection = uncounted,
) -> None:
    install_rotations(backends.replicas, config, clock, on_ejection)

    async def one(replica: Replica) -> None:
        try:
            failure = await probe(client, replica, config)
        except GatewayOutOfResources as exc:
            # The gateway could not even ask: the backend keeps its last verdict (none
            # yet, for a new one), rather than go DOWN for the gateway's own limit.
            log.warning(
                "could not probe backend %s: %s; the gateway's own limit (%s), not the "
                "backend's fault; its health is left as it was",
                replica.name,
                exc,
                shortage_hint(exc),
            )
            return
        except Exception:  # whatever one backend answers must not stop the others' probes
            log.exception("probing backend %s failed", replica.name)
            failure = "the probe failed"
        now = clock()
        if replica.held_out(now):
            return  # its ejection runs on, whatever its /health says
        ejected = replica.ejected_until is not None  # and is over: the probe decides now
        replica.ejected_until = None
        ok = failure is None
        was, first = replica.healthy, not replica.probed
        if ok and not was:
            log.info("backend %s is up", replica.name)
            # Only a readmission resets the failure count: a probe between two failed
            # requests kept a backend failing every request from reaching the threshold.
            replica.readmitted(now)
        elif not ok and (was or first or ejected):
            log.warning("backend %s is DOWN: %s", replica.name, failure)
            if was:  # out of rotation now; a new or an ejected one was not in it
                on_ejection(replica.name, "probe_failed")
        replica.healthy = ok
        replica.probed = True
        if ok != was or first:  # requests queued for a new replica's first verdict hear it
            on_change(replica)

    async with anyio.create_task_group() as group:
        for replica in backends.replicas:
            group.start_soon(one, replica)


class HealthProber:
    """Probes every ``interval_s``, or at once when asked (a reload added replicas)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        current: Callable[[], tuple[BackendSet, HealthConfig]],
        on_change: Callable[[Replica], None],
        on_ejection: OnEjection = uncounted,
    ) -> None:
        self._client = client
        self._current = current
        self._on_change = on_change
        self._on_ejection = on_ejection
        self._wake = anyio.Event()

    def probe_soon(self) -> None:
        """A reload: the new snapshot's pools and knobs rule passive ejection from now, not
        from the next round (one in progress may take ``timeout_s``)."""
        backends, config = self._current()
        install_rotations(backends.replicas, config, on_ejection=self._on_ejection)
        self._wake.set()

    async def run(self) -> None:
        """Runs until cancelled; reads the snapshot each round so reloads apply. The first
        round is the startup's own, before serving: the next comes an interval later, not
        at once (a second verdict in the first moment readmitted what the first requests
        had just ejected)."""
        while True:
            _, config = self._current()
            with anyio.move_on_after(config.interval_s):
                await self._wake.wait()
            self._wake = anyio.Event()
            backends, config = self._current()
            await probe_all(
                self._client, backends, config, self._on_change, on_ejection=self._on_ejection
            )
