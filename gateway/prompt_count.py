"""A request's prompt tokens before routing, by ``routing.estimator.mode``: the backend's
own ``/tokenize``, a local tokenizer (in a thread), or characters (``gateway.tokens``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from backends.replica import Replica
from gateway.routing import least_busy
from gateway.runtime import Runtime
from gateway.tokens import Estimate, tokenize_on_backend
from gateway.upstream_identity import Identity
from policies.prompt_size import PromptShape


async def count_prompt(
    runtime: Runtime,
    payload: Mapping[str, Any],
    shape: PromptShape,
    serving: list[Replica],
    identity: Identity,
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
                headers=identity(target),
                timeout_s=estimator.tokenize_timeout_s,
            )
            if counted is not None:
                if counted.max_model_len is not None:
                    target.discovered_max_model_len = counted.max_model_len
                if shape.texts and shape.longest_size < shape.total_size:
                    return _whole_batch_counted(runtime, model, shape, counted.count)
                return Estimate(counted.count, exact=True)
    if estimator.mode == "tokenizer" and model in estimator.tokenizers:
        return await anyio.to_thread.run_sync(
            runtime.routing.estimate_locally, model, shape, settings.routing
        )
    # Characters, by the model's calibration: what estimate_locally reads for every mode
    # left here (chars; backend, when no backend counted; tokenizer, without one for it).
    return runtime.routing.calibration.estimate_with_floor(model, shape)


def _whole_batch_counted(runtime: Runtime, model: str, shape: PromptShape, count: int) -> Estimate:
    """A batch of texts a backend counted as a whole: exact, but how it splits between
    the sequences is not known. The longest is at least the count less what the others
    can be at most: a token per byte (byte-level BPE, byte fallback) and two special
    tokens each."""
    most = [len(text.encode("utf-8", "surrogatepass")) + 2 for text in shape.texts]
    chars = runtime.routing.calibration.estimate_with_floor(model, shape)
    longest_floor = max(count - sum(most) + max(most), shape.longest_of(chars.fewest))
    return Estimate(count, exact=False, floor=chars.floor, longest_floor=longest_floor)
