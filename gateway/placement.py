"""Where a request may go: its prompt counted, its pools planned, kept up to date.

:func:`plan_route` runs once per request before admission: it counts the prompt's
tokens (``gateway.prompt_count``), refuses at once with 400
``context_length_exceeded`` a prompt no backend's context could start, and plans
the home pool and the pools it may borrow idle headroom from
(``policies.long_context``), among the replicas whose context holds the requested
output too when there are any. :func:`live_route` plans a waiter again when its home
lost its replicas. ``gateway.admission_pick`` turns the plan into admission's ``pick()``.

A request's tokens are its prompt plus, for each sequence the engine runs (each
prompt of a batch, ``n`` times), its maximum output; an embedding has no output,
and needs no context room beyond its input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from backends.replica import Replica
from gateway.errors import ContextLengthExceeded, ModelNotFound, Unavailable
from gateway.prompt_count import count_prompt
from gateway.routing import session_of
from gateway.runtime import Runtime
from gateway.settings import Settings
from gateway.tokens import Estimate
from gateway.upstream_identity import Identity
from policies.long_context import (
    FIRST_TOKEN,
    ContextFit,
    PoolPlan,
    context_fit,
    exceeds_every_context,
    plan_pools,
)
from policies.prompt_size import PromptShape, output_tokens, shape_of

EMBEDDINGS = "/v1/embeddings"  # no output: its input may fill the context


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs 4x
class Route:
    """Where one request may go and what it costs; fixed before admission."""

    model: str
    plan: PoolPlan
    shape: PromptShape
    estimate: Estimate
    # What a replica's context must hold: the prompt and the requested output where a
    # healthy replica holds both, else what an engine needs to start it.
    fit: ContextFit
    requested_output: int  # max_tokens as asked, 0 when not: to plan the route again
    least_output: int  # what an engine needs besides the prompt: one token, for embeddings none
    cost: int  # prompt + max output of each sequence: its share of a token budget
    session: str | None
    # Some replica listed the model when it was planned (else only replicas a reload
    # added without `models` and not probed yet may serve it).
    listed: bool

    def could_serve(self, replica: Replica, tried: set[str]) -> bool:
        """Its model (or may be), not tried already, context enough; health, pool aside."""
        return (
            may_serve(replica, self.model)
            and replica.name not in tried
            and self.fit.holds(replica.max_model_len)
        )

    @property
    def pools(self) -> tuple[str, ...]:
        return (self.plan.home, *self.plan.lenders)


def may_serve(replica: Replica, model: str) -> bool:
    """It serves ``model``, or may: added by a reload without ``models`` and not probed
    yet, it has not said what it serves (requests wait for that first verdict)."""
    return replica.serves(model) or (not replica.probed and not replica.config.models)


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


def _servers(runtime: Runtime, model: str) -> tuple[list[Replica], bool]:
    """The replicas that serve ``model`` or may (see :func:`may_serve`), and whether any
    listed it; 404 when none may."""
    serving: list[Replica] = []
    listed = False
    for replica in runtime.current.backends.replicas:  # one pass: this runs per request
        if replica.serves(model):
            serving.append(replica)
            listed = True
        elif not replica.probed and not replica.config.models:  # may_serve's other half
            serving.append(replica)
    if not serving:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    return serving, listed


async def plan_route(
    runtime: Runtime,
    payload: Mapping[str, Any],
    headers: Mapping[str, str],
    endpoint: str,
    identity: Identity,
) -> Route:
    """Estimate the prompt, refuse what no context could start, plan the pools. A call
    made to count the prompt on a backend carries ``identity`` (:func:`upstream_identity`)."""
    snapshot = runtime.current
    settings = snapshot.settings
    routing = settings.routing
    runtime.routing.configure(routing)
    model = payload["model"]
    serving, listed = _servers(runtime, model)
    # Replicas a reload just added are not probed yet; they may well be up.
    healthy = [r for r in serving if r.healthy or not r.probed]
    shape = shape_of(payload)
    if not healthy:
        estimate = runtime.routing.estimate_locally(model, shape, routing)
        runtime.recorder.rejected(_pool_by_length(settings, serving, estimate), "no_backend")
        raise Unavailable(f"no healthy backend serves model `{model}`")
    estimate = await count_prompt(runtime, payload, shape, serving, identity)
    if runtime.current is not snapshot:
        # A reload while the prompt was counted (on a backend's /tokenize, in a tokenizer
        # thread): planned on the pools and replicas there are now, not on removed ones.
        settings = runtime.current.settings
        routing = settings.routing  # one snapshot for the whole plan
        serving, listed = _servers(runtime, model)
        healthy = [r for r in serving if r.healthy or not r.probed]
        if not healthy:
            runtime.recorder.rejected(_pool_by_length(settings, serving, estimate), "no_backend")
            raise Unavailable(f"no healthy backend serves model `{model}`")
    embedding = endpoint == EMBEDDINGS
    # An embedding has no output: an engine takes an input as long as its context.
    least_output = 0 if embedding else FIRST_TOKEN
    explicit = 0 if embedding else output_tokens(payload, 0)
    # Each sequence of a batch (a list of prompts or inputs) has a context of its own.
    lengths = [r.max_model_len for r in serving]
    # Only what no engine could start is refused here, at the fewest tokens the prompt can
    # be: prompt + max_tokens over the context is the engine's to judge (it stops the
    # output there, or answers its own 400).
    if exceeds_every_context(lengths, estimate.longest_fewest(shape), least_output):
        likely = estimate.longest_likely(shape)
        raise _prompt_too_long(payload, lengths, likely, estimate.exact, embedding)
    fit, plan = _place(settings, healthy, estimate, shape, explicit, least_output)
    if plan is None:
        runtime.recorder.rejected(_pool_by_length(settings, serving, estimate), "no_backend")
        raise Unavailable(f"no healthy backend of `{model}` has the context for this prompt")
    output = 0 if embedding else explicit or routing.token_budget.default_output_tokens
    return Route(
        model=model,
        plan=plan,
        shape=shape,
        estimate=estimate,
        fit=fit,
        requested_output=explicit,
        least_output=least_output,
        cost=estimate.tokens + shape.sequences * output,
        session=session_of(headers, payload, routing),
        listed=listed,
    )


def _place(
    settings: Settings,
    healthy: list[Replica],
    estimate: Estimate,
    shape: PromptShape,
    requested_output: int,
    least_output: int,
) -> tuple[ContextFit, PoolPlan | None]:
    """What a context must hold and the pool plan, among ``healthy`` replicas (healthy,
    or not probed yet): for a new request, and for a waiter planned again."""
    # The longest sequence as estimated (the pools split sequence lengths; a context
    # that holds it and the output is preferred), and the fewest tokens it can have.
    likely = estimate.longest_likely(shape)
    fit = context_fit(
        [r.max_model_len for r in healthy],
        likely,
        estimate.longest_fewest(shape),
        requested_output,
        least_output,
    )
    spill = settings.routing.spill
    holding = {r.pool for r in healthy if fit.holds(r.max_model_len)}
    plan = plan_pools(
        settings.pools,
        holding,
        likely,
        to_longer=spill.to_longer,
        to_shorter=spill.to_shorter,
    )
    return fit, plan


_NOTHING_TRIED: frozenset[str] = frozenset()


def live_route(runtime: Runtime, route: Route, tried: set[str]) -> Route | None:
    """The route as it stands now: the same while its home pool has a replica that could
    serve it (healthy, or added and not probed yet); else planned again, as a request
    arriving now would be, among the replicas it has not tried. None: nothing can serve
    it any more. A waiter is never left to sleep on a pool that lost its backends (a
    crash, a reload that removed or re-addressed them) nor on a pool a reload removed."""
    home = route.plan.home
    # Lost means no replica left, whatever this request tried: a retry whose home replicas
    # all failed it keeps its plan (it may borrow only idle headroom, as before), rather
    # than make a lender its home.
    if any(
        (r.healthy or not r.probed) and route.could_serve(r, _NOTHING_TRIED)
        for r in runtime.current.backends.in_pool(home)
    ):
        return route
    settings = runtime.current.settings
    healthy = [
        r
        for r in runtime.current.backends.replicas
        if (r.healthy or not r.probed) and r.name not in tried and may_serve(r, route.model)
    ]
    fit, plan = _place(
        settings,
        healthy,
        route.estimate,
        route.shape,
        route.requested_output,
        route.least_output,
    )
    if plan is None:
        return None
    return replace(route, plan=plan, fit=fit)


def _pool_by_length(settings: Settings, serving: list[Replica], estimate: Estimate) -> str:
    """The pool a refused request would have gone to, for its rejection's label."""
    plan = plan_pools(settings.pools, {r.pool for r in serving}, estimate.tokens)
    return plan.home if plan is not None else serving[0].pool


def _prompt_too_long(
    payload: Mapping[str, Any],
    lengths: list[int | None],
    prompt_tokens: int,
    exact: bool,
    embedding: bool,
) -> ContextLengthExceeded:
    """The gateway's own refusal speaks of the prompt only: what it is refused for."""
    largest = max(n for n in lengths if n is not None)
    about = "" if exact else "about "
    if embedding:  # vLLM's words for an input over the context
        return ContextLengthExceeded(
            f"This model's maximum context length is {largest} tokens. However, you requested "
            f"{about}{prompt_tokens} tokens in the input for embedding generation. Please "
            "reduce the length of the input.",
            param=_prompt_param(payload),
        )
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
