"""The HTTP load generator: closed and open loop against an OpenAI base URL.

One shared :class:`~gateway.bench.h1.Client` carries every request; its
connection bound sits above the largest number of requests in flight so it
never becomes a second, hidden concurrency limit. The stall timeout is the
longest wait for the next chunk, a guard for token streams.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from gateway.bench.client import ApiUrl, TargetError, error_message, stream_request
from gateway.bench.h1 import Client, TransportError
from gateway.bench.phase import LoadPoint, Phase, Ticket, arrival_gaps, client_starts
from gateway.bench.prompts import BodyOptions, Endpoint, PromptText, build_body, fit_prompts
from gateway.bench.stats import RequestRecord
from gateway.bench.target import Progress
from gateway.bench.workload import RequestSpec, Workload

PROBE_PROMPT_TOKENS = 16
ERROR_PAUSE_S = 0.05  # a client's pause after a failed request
# A staggered client start is polled for over its last wall seconds (timers are coarser).
START_POLL_S = 0.002


class HttpTarget:
    def __init__(
        self,
        url: str,
        *,
        endpoint: Endpoint,
        model: str | None = None,
        ignore_eos: bool = True,
        api_key: str | None = None,
        max_in_flight: int = 256,
        stall_timeout_s: float = 120.0,
        speed: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.label = url
        self._url = ApiUrl.parse(url)
        self._endpoint = endpoint
        self._model = model
        self._ignore_eos = ignore_eos
        # A simulator running ``speed`` times faster than real time is measured on
        # its own time scale: every figure then compares with a virtual-clock run.
        self._speed = speed
        self._clock: Callable[[], float] = (lambda: clock() * speed) if speed != 1.0 else clock
        self._prompts = PromptText(endpoint)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = Client(
            self._url.origin,
            headers=headers,
            stall_timeout_s=stall_timeout_s,
            max_connections=max_in_flight + 16,  # fillers and the probe never exceed this
        )

    @property
    def model(self) -> str | None:
        return self._model

    async def aclose(self) -> None:
        await self._client.aclose()

    async def prepare(self, workloads: Sequence[Workload]) -> list[str]:
        self._model = await self._resolve_model()
        # A few tokens: a single one may be part of a character and stream no text.
        probe = RequestSpec(0, PROBE_PROMPT_TOKENS, 4, None, 0)
        record = await self._request(probe, Ticket(0, counted=False))
        if record.error is not None:
            hint = ""
            if "ignore_eos" in record.error:
                hint = " (try --no-ignore-eos)"
            raise TargetError(f"{self.label}: probe request failed: {record.error}{hint}")
        targets = [n for w in workloads for n in w.prompt_classes]
        notes = await fit_prompts(self._prompts, targets, self._count_tokens)
        return [f"model {self._model}", *notes]

    async def _resolve_model(self) -> str:
        try:
            reply = await self._client.request("GET", f"{self._url.api_path}/models")
        except TransportError as exc:
            raise TargetError(f"cannot reach {self.label}: {exc}") from None
        if reply.status >= 400:
            if self._model is not None and reply.status == 404:
                return self._model  # no model list; trust the user
            message = error_message(reply.status, reply.body)
            raise TargetError(f"{self._url.api}/models answered {message}")
        try:
            served = [m["id"] for m in json.loads(reply.body)["data"]]
        except (ValueError, KeyError, TypeError):
            raise TargetError(f"{self._url.api}/models did not return a model list") from None
        if self._model is None:
            if not served:
                raise TargetError(f"{self.label} serves no models")
            return str(served[0])
        if self._model not in served:
            raise TargetError(
                f"model {self._model!r} is not served by {self.label} (it serves: "
                f"{', '.join(served) or 'nothing'})"
            )
        return self._model

    async def _count_tokens(self, prompt_part: dict[str, Any]) -> int | None:
        body = json.dumps({"model": self._model, **prompt_part}).encode()
        try:
            reply = await self._client.request("POST", f"{self._url.root_path}/tokenize", body)
            count = json.loads(reply.body).get("count") if reply.status == 200 else None
        except (TransportError, ValueError, AttributeError):
            return None
        return int(count) if isinstance(count, int) else None

    async def _request(
        self, spec: RequestSpec, ticket: Ticket, phase: Phase | None = None
    ) -> RequestRecord:
        assert self._model is not None, "prepare() first"
        path, body = build_body(
            spec, self._prompts, BodyOptions(self._model, self._endpoint, self._ignore_eos)
        )
        on_tokens = phase.delivered if phase is not None else (lambda n: None)
        return await stream_request(
            self._client,
            self._url.api_path + path,
            body,
            prompt_tokens=spec.prompt_tokens,
            prompt_class=spec.prompt_class,
            on_tokens=on_tokens,
            clock=self._clock,
        )

    async def run_point(self, point: LoadPoint, workload: Workload, progress: Progress) -> Phase:
        if point.kind == "concurrency":  # the first wave then leaves at once
            await self._client.preconnect(int(point.load))
        phase = Phase(point)
        done = anyio.Event()

        async def one(ticket: Ticket) -> None:
            record = await self._request(workload.spec(ticket.index), ticket, phase)
            now = self._clock()
            phase.finish(ticket, record, now)
            progress.tick(phase, now)
            if phase.done:
                done.set()
            elif record.error is not None:
                # A closed-loop client would resend at once: against a dead target, tens of
                # thousands of errors a second. A real client backs off too.
                await anyio.sleep(ERROR_PAUSE_S)

        async def worker(start: float) -> None:
            await self._until(start)
            opening = True
            while not phase.done:
                await one(phase.issue(self._clock(), opening=opening))
                opening = False
            done.set()  # issue() itself can close a point that ran by duration

        async with anyio.create_task_group() as tg:
            if point.kind == "concurrency":
                origin = self._clock()
                for offset in client_starts(point):
                    tg.start_soon(worker, origin + offset)
            else:
                tg.start_soon(self._arrivals, point, phase, one, done)
            await done.wait()
            tg.cancel_scope.cancel()  # fillers still in flight are not counted
        return phase

    async def _until(self, t: float) -> None:
        """Wait until ``t`` on the target's clock: the loop's timer to within a
        millisecond of it (its precision, K times coarser on a sim's time), then
        polled, so a staggered start lands where it does on the virtual clock."""
        wait = (t - self._clock()) / self._speed - START_POLL_S
        if wait > 0:
            await anyio.sleep(wait)
        while self._clock() < t:
            await anyio.lowlevel.checkpoint()

    async def _arrivals(self, point: LoadPoint, phase: Phase, one: Any, done: anyio.Event) -> None:
        async with anyio.create_task_group() as tg:
            due = self._clock()
            for gap in arrival_gaps(point):
                ticket = phase.issue(self._clock())
                if phase.done:
                    done.set()
                    return
                tg.start_soon(one, ticket)
                due += gap
                with anyio.move_on_after(max(0.0, due - self._clock()) / self._speed):
                    await done.wait()
                if done.is_set():
                    return
