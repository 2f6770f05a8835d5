"""Start a request's task in the loop turn that read it, as Python 3.12's eager tasks do.

A task made by ``loop.create_task`` runs its first step only once the loop comes round
to it, behind every callback already due: on a gateway relaying many streams, those are
other streams' chunks. A request that arrived whole has nothing to wait for before its
upstream write, yet it waited for them. ``gateway/protocol.py`` starts the first request
of a loop turn this way (the rest of a burst as before: see ``_start_deferred``).

Python 3.12 has this as ``Task(..., eager_start=True)``. For 3.11: the task is created
around a primed continuation, then the coroutine's first step runs at once, as that task
(``asyncio.current_task()`` is it; ``_enter_task`` is what 3.12's eager start calls) and
in the task's context. The task's first scheduled step takes over wherever the
coroutine suspended; a cancel that comes before it cancels what the coroutine awaits,
as ``Task.cancel()`` does.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import types
from asyncio.tasks import _enter_task, _leave_task  # type: ignore[attr-defined]
from collections.abc import Coroutine, Generator
from typing import Any


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]
) -> asyncio.Task[Any]:
    """A task running ``coro``, whose first step has run by the time this returns. Call it
    only where no task is running (a protocol's ``data_received``)."""
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
    step = _FirstStep(coro)
    rest = _rest(step)
    rest.send(None)  # primed: see _rest
    context = contextvars.copy_context()
    task = loop.create_task(rest, context=context)
    _enter_task(loop, task)
    try:
        step.yielded = context.run(coro.send, None)
    except StopIteration as stop:
        step.finished, step.result = True, stop.value
    except (KeyboardInterrupt, SystemExit) as exc:
        step.finished, step.error = True, exc
        raise  # as a task's step does: the loop hears of it now, the task later
    except BaseException as exc:  # the task's first step raises it, as it would have
        step.finished, step.error = True, exc
    finally:
        _leave_task(loop, task)
    return task


class _FirstStep:
    __slots__ = ("coro", "error", "finished", "result", "yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.yielded: Any = None  # what the coroutine suspended on: the task awaits it
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None


@types.coroutine
def _rest(step: _FirstStep) -> Generator[Any, Any, Any]:
    """The coroutine from where its first step left it. Primed (started up to its first
    ``yield``) before the task exists: a generator that never started cannot catch what
    is thrown into it, so a cancel before the task's first step would miss the coroutine.
    Once the task has waited for what the first step suspended on, ``yield from`` hands
    every later step straight to the coroutine (a delegation the interpreter does in C:
    a loop of ``send`` and ``throw`` here cost ~3 µs a step, every chunk of a stream)."""
    coro = step.coro
    try:
        yield None  # the priming stop; the task's first step resumes here
    except GeneratorExit:  # never run (its loop closed first)
        coro.close()
        raise
    except BaseException as exc:  # cancelled before its first scheduled step
        if step.finished:
            raise
        waited = _took(step.yielded)
        if (
            isinstance(exc, asyncio.CancelledError)
            and waited is not None
            and waited.cancel(*exc.args)
        ):
            # What Task.cancel() does to the future its task waits on: cancel that, and the
            # coroutine hears of it from its await (a helper task awaited is cancelled too).
            waited._asyncio_future_blocking = True
            value = waited
        else:
            try:
                value = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
    else:
        if step.finished:
            if step.error is not None:
                raise step.error
            return step.result
        value = step.yielded
    while True:  # until the task resumes the coroutine from its wait without an exception
        try:
            yield value
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:
            try:
                value = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            break
    return (yield from coro)


def _took(yielded: Any) -> asyncio.Future[Any] | None:
    """The future the first step suspended on, taken as the task's step takes one: its
    "being awaited" mark cleared, else any later ``await`` of it raises RuntimeError. (On
    uvloop a timer armed in the first step can fire before the task's first step does.)"""
    if not getattr(yielded, "_asyncio_future_blocking", False):
        return None
    yielded._asyncio_future_blocking = False
    return yielded  # type: ignore[no-any-return]
