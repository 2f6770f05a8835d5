"""Where a request may go: its prompt estimated, its pools planned, its backend picked.

:func:`plan_route` runs once per request before admission: it estimates the
prompt's tokens (``gateway.tokens``), refuses at once with 400
``context_length_exceeded`` a prompt no backend's context could start, and plans
the home pool and the pools it may borrow idle headroom from
(``policies.long_context``), among the replicas whose context holds the requested
output too when there are any. :func:`make_pick` is the ``pick()`` admission
calls, each time capacity may have appeared: it turns live replicas into
:class:`~policies.routing.Load` values, lets the pool's router choose, and
returns a :class:`~policies.token_budget.Claim` (a permit plus the request's
tokens) on the chosen replica.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from backends.replica import Replica
from gateway.errors import ContextLengthExceeded, ModelNotFound, Unavailable
from gateway.routing import load_of, session_of
from gateway.runtime import Runtime
from gateway.settings import Settings
from gateway.tokens import Estimate, tokenize_on_backend
from policies.admission import NoHealthyBackend
from policies.long_context import (
    FIRST_TOKEN,
    PoolPlan,
    choose_across_pools,
    exceeds_every_context,
    fits_context,
    output_to_hold,
    plan_pools,
)
from policies.prompt_size import PromptShape, output_tokens, shape_of
from policies.routing import RouteRequest
from policies.token_budget import Claim


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request may go and what it costs; fixed before admission."""

    model: str
    plan: PoolPlan
    shape: PromptShape
    estimate: Estimate
    # Output tokens the context must hold besides the prompt: the requested output where
    # a healthy replica holds it all, else one (the engine then decides about the rest).
    context_tokens: int
    cost: int  # prompt + max output tokens: its share of a token budget
    session: str | None
    # The fewest tokens the longest sequence may have: what a context must hold.
    longest_prompt: int

    def could_serve(self, replica: Replica, tried: set[str]) -> bool:
        """Its model, not tried already, context enough; health and pool aside."""
        return self.model in replica.models and replica.name not in tried and self.fits(replica)

    def fits(self, replica: Replica) -> bool:
        """The replica's context can hold the prompt and the output this route asks for."""
        return fits_context(
            replica.max_model_len, self.longest_prompt, self.context_tokens, self.estimate.exact
        )

    @property
    def pools(self) -> tuple[str, ...]:
        return (self.plan.home, *self.plan.lenders)


def candidates(runtime: Runtime, pool: str, route: Route, tried: set[str]) -> list[Replica]:
    return [
        r
        for r in runtime.current.backends.in_pool(pool)
        if r.healthy and route.could_serve(r, tried)
    ]


def awaiting_probe(runtime: Runtime, route: Route, tried: set[str]) -> bool:
    """A replica a reload just added could serve this request once probed: better to
    wait for that verdict (a probe round starts at once) than to refuse."""
    return any(
        not r.probed and route.could_serve(r, tried)
        for pool in route.pools
        for r in runtime.current.backends.in_pool(pool)
    )


def least_busy(replicas: list[Replica]) -> Replica:
    """The replica with the most headroom, for calls outside admission (``/tokenize``)."""
    return min(replicas, key=lambda r: r.in_flight / max(1, r.limit))


def backend_auth(replica: Replica) -> dict[str, str]:
    """The backend's own key as a header, when it has one."""
    key = replica.config.resolved_api_key()
    return {"authorization": f"Bearer {key}"} if key else {}


async def _estimate(
    runtime: Runtime, payload: Mapping[str, Any], shape: PromptShape, serving: list[Replica]
) -> Estimate:
    settings = runtime.current.settings
    estimator = settings.routing.estimator
    model = payload["model"]
    if estimator.mode == "backend":
        healthy = [r for r in serving if r.healthy]
        if healthy:
            target = least_busy(healthy)
            counted = await tokenize_on_backend(
                runtime.client,
                target.url,
                payload,
                headers=backend_auth(target),
                timeout_s=estimator.tokenize_timeout_s,
            )
            if counted is not None:
                if counted.max_model_len is not None:
                    target.discovered_max_model_len = counted.max_model_len
                return Estimate(counted.count, exact=True)
    if estimator.mode == "tokenizer" and model in estimator.tokenizers:
        return await anyio.to_thread.run_sync(
            runtime.routing.estimate_locally, model, shape, settings.routing
        )
    return runtime.routing.estimate_locally(model, shape, settings.routing)


async def plan_route(
    runtime: Runtime, payload: Mapping[str, Any], headers: Mapping[str, str]
) -> Route:
    """Estimate the prompt, refuse what no context could start, plan the pools."""
    settings = runtime.current.settings
    routing = settings.routing
    runtime.routing.configure(routing)
    model = payload["model"]
    serving = runtime.current.backends.serving(model)
    if not serving:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    # Replicas a reload just added are not probed yet; they may well be up.
    healthy = [r for r in serving if r.healthy or not r.probed]
    shape = shape_of(payload)
    if not healthy:
        estimate = runtime.routing.estimate_locally(model, shape, routing)
        runtime.recorder.rejected(_pool_by_length(settings, serving, estimate), "no_backend")
        raise Unavailable(f"no healthy backend serves model `{model}`")
    estimate = await _estimate(runtime, payload, shape, serving)
    explicit = output_tokens(payload, 0)
    # Each sequence of a batch (a list of prompts or inputs) has a context of its own.
    longest = math.ceil(estimate.fewest * shape.longest_share)
    lengths = [r.max_model_len for r in serving]
    # Only what no engine could start is refused here: prompt + max_tokens over the
    # context is the engine's to judge (it stops the output there, or answers its own 400).
    if exceeds_every_context(lengths, longest, FIRST_TOKEN, estimate.exact):
        raise _prompt_too_long(payload, lengths, longest, estimate.exact)
    context_tokens = output_to_hold(
        (r.max_model_len for r in healthy), longest, max(FIRST_TOKEN, explicit), estimate.exact
    )
    spill = routing.spill
    holding = {
        r.pool
        for r in healthy
        if fits_context(r.max_model_len, longest, context_tokens, estimate.exact)
    }
    plan = plan_pools(
        settings.pools,
        holding,
        math.ceil(estimate.tokens * shape.longest_share),  # the pools split sequence lengths
        to_longer=spill.to_longer,
        to_shorter=spill.to_shorter,
    )
    if plan is None:
        runtime.recorder.rejected(_pool_by_length(settings, serving, estimate), "no_backend")
        raise Unavailable(f"no healthy backend of `{model}` has the context for this prompt")
    return Route(
        model=model,
        plan=plan,
        shape=shape,
        estimate=estimate,
        context_tokens=context_tokens,
        cost=estimate.tokens + (explicit or routing.token_budget.default_output_tokens),
        session=session_of(headers, payload, routing),
        longest_prompt=longest,
    )


def _pool_by_length(settings: Settings, serving: list[Replica], estimate: Estimate) -> str:
    """The pool a refused request would have gone to, for its rejection's label."""
    plan = plan_pools(settings.pools, {r.pool for r in serving}, estimate.tokens)
    return plan.home if plan is not None else serving[0].pool


def _prompt_too_long(
    payload: Mapping[str, Any], lengths: list[int | None], prompt_tokens: int, exact: bool
) -> ContextLengthExceeded:
    """The gateway's own refusal speaks of the prompt only: what it is refused for."""
    largest = max(n for n in lengths if n is not None)
    about = "" if exact else "about "
    return ContextLengthExceeded(
        f"This model's maximum context length is {largest} tokens. However, you requested "
        f"{about}{prompt_tokens} tokens in the prompt, which leaves no room for output.",
        param=_prompt_param(payload),
    )


def _prompt_param(payload: Mapping[str, Any]) -> str:
    for field in ("messages", "prompt", "input"):
        if field in payload:
            return field
    return "prompt"


def make_could_use(route: Route, tried: set[str]) -> Callable[[Claim[Replica]], bool]:
    """Whether this request could be served on a claim's replica: admission lets a request
    go ahead of waiters only onto replicas none of them could use."""
    pools = frozenset(route.pools)

    def could_use(claim: Claim[Replica]) -> bool:
        return claim.backend.pool in pools and route.could_serve(claim.backend, tried)

    return could_use


def make_pick(
    runtime: Runtime, route: Route, tried: set[str]
) -> Callable[[], Claim[Replica] | None]:
    """The router for admission: home pool first, then lenders' idle headroom."""
    config = runtime.current.settings.routing
    request = RouteRequest(cost=route.cost, session=route.session)

    def pick() -> Claim[Replica] | None:
        # Read the live snapshot each time: a waiter must see replicas readmitted
        # or added while it queued, and fail fast when none is left.
        settings = runtime.current.settings
        mono = time.monotonic()
        replicas = {pool: candidates(runtime, pool, route, tried) for pool in route.pools}
        if not any(replicas.values()):
            if awaiting_probe(runtime, route, tried):
                return None
            pools = "`, `".join(route.pools)
            raise NoHealthyBackend(f"no healthy backend in pool `{pools}` serves `{route.model}`")
        chosen = choose_across_pools(
            route.plan,
            request,
            loads=lambda pool: [load_of(r, settings, mono) for r in replicas[pool]],
            router=lambda pool: runtime.routing.router(pool, config),
            queued=lambda pool: runtime.admission(pool).depth(),
            max_load=config.spill.max_load,
        )
        if chosen is None:
            return None
        pool, load = chosen
        return Claim(next(r for r in replicas[pool] if r.name == load.name), route.cost)

    return pick
