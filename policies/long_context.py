"""Which pool a prompt belongs to, which pools may lend it headroom, and what never fits.

What never fits is a prompt that leaves no context room for one output token (for an
embedding, the prompt alone): an engine starts anything else. The prompt is judged by
the fewest tokens it can be (an exact count, or a character estimate's lower bound,
``gateway.tokens.Estimate``), so nothing that fits is refused. The requested output
(``max_tokens``) only steers: replicas whose context holds the prompt as estimated and the
whole output are preferred (:func:`context_fit`); when none does, the engine decides (it
stops the output at its context, or refuses in its own words).

Pools hold prompt-length ranges ``[min_prompt_tokens, max_prompt_tokens)``.
A request's *home* is the first pool (in config order) whose range holds its
estimated prompt tokens, among the pools that can serve it (a healthy backend
with the model and the context length). When none can, it goes to the serving
pool whose range is nearest (availability before placement: with every long
replica down, long prompts still run on the short ones, where token-budget
admission keeps them from flooding the KV cache).

Spill: a request whose home pool is saturated may borrow *idle* headroom of
other pools, never displace their own traffic. ``to_longer`` lets short
prompts borrow from pools of longer ranges (on by default); ``to_shorter``
lets long prompts borrow from pools of shorter ranges (off by default: a 32K
prefill on a chat replica stalls every chat request on it). Whether a lender
is idle is decided at admission time (:func:`lender_fits`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.settings import PoolConfig
from policies.routing import Load, Router, RouteRequest

# All an engine needs beyond the prompt to start a request: room for one output token.
# vLLM (0.32) and SGLang then stop the output at the context (finish_reason "length");
# an older vLLM refuses prompt + max_tokens over it with its own 400, naming max_tokens.
FIRST_TOKEN = 1


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs 4x
class PoolPlan:
    home: str
    lenders: tuple[str, ...] = ()  # pools whose idle headroom it may borrow, nearest first


def _distance(pool: PoolConfig, prompt_tokens: int) -> int:
    if prompt_tokens < pool.min_prompt_tokens:
        return pool.min_prompt_tokens - prompt_tokens
    upper = pool.max_prompt_tokens
    return 0 if upper is None or prompt_tokens < upper else prompt_tokens - upper + 1


def plan_pools(
    pools: Mapping[str, PoolConfig],
    serving: Collection[str],
    prompt_tokens: int,
    *,
    to_longer: bool = True,
    to_shorter: bool = False,
) -> PoolPlan | None:
    """The home pool among ``serving`` and its lenders; None when nothing serves."""
    names = [name for name in pools if name in serving]
    if len(names) < 2:  # most models live in one pool: its home, and nothing to borrow
        return PoolPlan(names[0]) if names else None
    # A range that holds it, the first in config order (ranges may overlap); else the
    # nearest range, and in a gap between two equally near ones the longer pool.
    holding = [n for n in names if _distance(pools[n], prompt_tokens) == 0]
    home = (
        holding[0]
        if holding
        else min(
            names,
            key=lambda n: (_distance(pools[n], prompt_tokens), -pools[n].min_prompt_tokens),
        )
    )
    floor = pools[home].min_prompt_tokens
    longer = sorted(
        (n for n in names if pools[n].min_prompt_tokens > floor),
        key=lambda n: pools[n].min_prompt_tokens,
    )
    shorter = sorted(
        (n for n in names if pools[n].min_prompt_tokens < floor),
        key=lambda n: -pools[n].min_prompt_tokens,
    )
    lenders = (longer if to_longer else []) + (shorter if to_shorter else [])
    return PoolPlan(home, tuple(lenders))


def fits_context(context_length: int | None, prompt_tokens: int, output_tokens: int) -> bool:
    """A backend of unknown context length is given the benefit of the doubt."""
    if context_length is None:
        return True
    return prompt_tokens + output_tokens <= context_length


def exceeds_every_context(
    context_lengths: Sequence[int | None], fewest_prompt: int, output_tokens: int
) -> bool:
    """True when no backend could hold the prompt, at the fewest tokens it can be, and
    ``output_tokens`` (all lengths known and too small); the gateway refuses on
    :data:`FIRST_TOKEN`, what no engine starts. When in doubt, the backend decides."""
    if not context_lengths or any(length is None for length in context_lengths):
        return False
    return not any(fits_context(length, fewest_prompt, output_tokens) for length in context_lengths)


@dataclass(slots=True)  # not frozen: built per request, where frozen's __init__ costs 4x
class ContextFit:
    """What a replica's context must hold for a request to go there: ``prompt`` tokens
    and ``output`` more."""

    prompt: int
    output: int

    def holds(self, context_length: int | None) -> bool:
        return fits_context(context_length, self.prompt, self.output)


def context_fit(
    context_lengths: Sequence[int | None],
    likely_prompt: int,
    fewest_prompt: int,
    wanted_output: int,
    least_output: int,
) -> ContextFit:
    """The replicas a request may go to: those whose context holds its prompt as estimated
    (``likely_prompt``: a preference, not a refusal) and ``wanted_output`` (the requested
    output, at least ``least_output``), while any does; else those that may start it: the
    fewest tokens the prompt can be (``fewest_prompt``) and ``least_output`` (one token;
    none for an embedding), as :func:`exceeds_every_context` refuses.
    """
    preferred = ContextFit(likely_prompt, max(least_output, wanted_output))
    if any(preferred.holds(n) for n in context_lengths):
        return preferred
    return ContextFit(fewest_prompt, least_output)


def output_to_hold(
    context_lengths: Iterable[int | None], prompt_tokens: int, requested_output: int
) -> int:
    """The output tokens a replica's context must hold besides the prompt.

    The requested output when some context holds prompt and output: those replicas are
    preferred, the output is never cut short where it need not be. Else
    :data:`FIRST_TOKEN`: any replica that can start the request may take it.
    """
    if any(fits_context(n, prompt_tokens, requested_output) for n in context_lengths):
        return requested_output
    return FIRST_TOKEN


def lender_fits(load: Load, cost: int, max_load: float) -> bool:
    """A lender's backend takes a spilled request only into idle headroom."""
    return load.fits(cost) and load.pressure(cost) <= max_load


def choose_across_pools(
    plan: PoolPlan,
    request: RouteRequest,
    *,
    loads: Callable[[str], Sequence[Load]],
    router: Callable[[str], Router],
    queued: Callable[[str], int],
    max_load: float,
    waits_in: str | None = None,
) -> tuple[str, Load] | None:
    """The (pool, backend) to admit to: home first, then lenders' idle headroom.

    ``loads(pool)`` are the candidate backends of a pool (called lazily: a
    lender's only when home has no room), ``router(pool)`` its router,
    ``queued(pool)`` the requests waiting in its queue. A lender with waiters of
    its own lends nothing, and only backends that :func:`lender_fits`.

    ``waits_in``: the pool whose queue the request waits in, when it is not the plan's
    home (a waiter re-planned because its own pool lost every backend). That home is
    then its home for what it may take, but its own waiters come first: it takes
    nothing there while any wait, as a newcomer queued behind them would not.
    """
    waits_in = plan.home if waits_in is None else waits_in
    for pool in (plan.home, *plan.lenders):
        if pool != waits_in and queued(pool):
            continue
        candidates = loads(pool)
        if not candidates:
            continue
        if pool != plan.home:
            candidates = [x for x in candidates if lender_fits(x, request.cost, max_load)]
        chosen = router(pool).choose(candidates, request)
        if chosen is not None:
            return pool, chosen
    return None
