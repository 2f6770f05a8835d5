"""The pure rules behind tests/test_routing_fixes.py: sequences, exact ids, caps, fits."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.tokens import CharsPerToken
from policies import long_context
from policies.prompt_size import shape_of
from policies.routing import Load

IDS = [1, 2, 3]


@pytest.mark.parametrize(
    ("payload", "sequences"),
    [
        ({"prompt": "hi"}, 1),
        ({"prompt": "hi", "n": 8}, 8),
        ({"prompt": "hi", "best_of": 5, "n": 2}, 5),  # best_of candidates, n returned
        ({"prompt": ["a", "b", "c", "d"]}, 4),
        ({"prompt": [IDS, IDS], "n": 3}, 6),
        ({"prompt": IDS, "n": 4}, 4),  # one prompt of ids
        ({"messages": [{"role": "user", "content": "hi"}], "n": 8}, 8),
        ({"input": ["a", "b"]}, 2),
        # Not a count: the engine's to refuse, counted as one.
        ({"prompt": "hi", "n": True}, 1),
        ({"prompt": "hi", "n": "8"}, 1),
        ({"prompt": "hi", "n": 0}, 1),
    ],
)
def test_the_sequences_an_engine_runs(payload: dict[str, Any], sequences: int) -> None:
    assert shape_of(payload).sequences == sequences


def test_a_prompt_of_token_ids_only_is_an_exact_count() -> None:
    estimator = CharsPerToken()
    ids = estimator.estimate_with_floor("m", shape_of({"prompt": list(range(700))}))
    assert (ids.tokens, ids.exact, ids.fewest) == (700, True, 700)
    batch = estimator.estimate_with_floor("m", shape_of({"prompt": [IDS, IDS]}))
    assert (batch.tokens, batch.exact) == (6, True)
    # Text, or a chat template around anything, is estimated.
    assert not estimator.estimate_with_floor("m", shape_of({"prompt": "abcd" * 10})).exact
    chat = shape_of({"messages": [{"role": "user", "content": ""}]})
    assert not estimator.estimate_with_floor("m", chat).exact


def test_a_load_caps_the_cost_at_what_the_request_can_hold_there() -> None:
    capped = Load(
        "a", in_flight=1, limit=8, tokens_in_flight=4096, token_limit=10_000, cost_cap=4096
    )
    assert capped.cost_of(40_100) == 4096
    assert capped.cost_of(100) == 100
    assert capped.fits(40_100)  # 4096 + 4096 <= 10,000
    assert capped.pressure(40_100) == pytest.approx(8192 / 10_000)
    uncapped = Load("a", in_flight=1, limit=8, tokens_in_flight=4096, token_limit=10_000)
    assert not uncapped.fits(40_100)


def test_the_preferred_context_holds_the_estimate_without_a_margin() -> None:
    # 95 estimated + 420 wanted: 512 does not hold it, 1000 does (before: 85 + 420 fit 512).
    fit = long_context.context_fit([512, 1000], 95, 95, 420, 1)
    assert (fit.holds(512), fit.holds(1000)) == (False, True)
    # None holds prompt and output: those that may start it, at the fewest tokens the
    # prompt can be (an estimate's floor).
    start = long_context.context_fit([512], 560, 4, 420, 1)
    assert start.holds(512)  # 4 + 1 <= 512: the engine decides
    assert not long_context.context_fit([512], 560, 560, 420, 1).holds(512)
    # An embedding needs no room beyond its input.
    assert long_context.context_fit([512], 512, 512, 0, 0).holds(512)
    assert long_context.exceeds_every_context([512], 513, 0)
    assert not long_context.exceeds_every_context([512], 512, 0)
