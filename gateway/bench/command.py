"""``kneecap bench``: arguments and the run, wired from ``gateway.cli``.

Every expected failure (bad target, bad option, missing extra) ends in one
line on stderr and exit code 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import anyio

from gateway.bench.client import ApiUrl, TargetError
from gateway.bench.compare import comparison_json, render_comparison
from gateway.bench.export import result_csv, result_json
from gateway.bench.loadgen import HttpTarget
from gateway.bench.plot import PlotError, check_plot_path, write_plot
from gateway.bench.policy import PolicyError, policy_yaml
from gateway.bench.progress import ProgressDisplay
from gateway.bench.prompts import ENDPOINTS
from gateway.bench.report import render
from gateway.bench.simtarget import SimTarget
from gateway.bench.slo import SloError, parse_slo
from gateway.bench.stats import LoadKind
from gateway.bench.sweep import DEFAULT_STAGGER_S, SweepPlan, SweepResult, run_sweep
from gateway.bench.target import Target
from gateway.bench.workload import (
    Workload,
    WorkloadError,
    load_requests_file,
    parse_prompt_tokens,
    workloads_from,
)

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,48,64,96,128"
# The field report's workload as the simulator calibrates it (backends/sim/calibration.py,
# OUTPUT_TOKENS): long outputs are what make KV capacity bound the engine, so the
# default sweep shows the knee the report describes. Pass --output-tokens for
# quicker sweeps of real endpoints.
DEFAULT_OUTPUT_TOKENS = 2816
EXIT_USAGE = 2
SIM_PREFIX = "sim:"
# uvloop (uvicorn[standard] brings it) reads and times streams a few times faster.
HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


class OptionError(ValueError):
    """A command-line value is invalid."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("target")
    one = where.add_mutually_exclusive_group(required=True)
    one.add_argument("--url", help="OpenAI-compatible base URL (with or without /v1)")
    one.add_argument("--sim", metavar="PROFILE", help="simulated engine on a virtual clock")
    where.add_argument("--compare", metavar="URL2", help="second target (URL or sim:PROFILE)")
    where.add_argument("--model", help="model name (default: the first the target serves)")
    where.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token")
    where.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    where.add_argument("--timeout", type=float, default=120.0, help="stall timeout per chunk, s")
    where.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="the target is `kneecap sim --speed K`: report figures on its simulated time",
    )
    load = parser.add_argument_group("load")
    shape = load.add_mutually_exclusive_group()
    shape.add_argument(
        "--concurrency", metavar="LIST", help=f"closed loop (default {DEFAULT_CONCURRENCY})"
    )
    shape.add_argument("--rate", metavar="LIST", help="open loop, requests/s")
    load.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    size = load.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help="counted requests per point")
    size.add_argument("--duration", type=float, help="seconds of counted load per point")
    load.add_argument("--warmup", type=int, help="uncounted requests first (default: one wave)")
    load.add_argument(
        "--stagger",
        type=float,
        default=DEFAULT_STAGGER_S,
        metavar="S",
        help="closed loop: seconds between successive clients' first requests "
        f"(default {DEFAULT_STAGGER_S:g}; 0 starts them all at once)",
    )
    load.add_argument("--seed", type=int, default=0)
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--prompt-tokens",
        default="1024",
        metavar="SPEC",
        help="1024 | 1024,8192 (series) | 1024:0.8,8192:0.2 (mix)",
    )
    work.add_argument("--output-tokens", type=int, default=DEFAULT_OUTPUT_TOKENS)
    work.add_argument(
        "--requests-file",
        type=Path,
        metavar="FILE.jsonl",
        help="replay request bodies instead of synthetic prompts",
    )
    work.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (for endpoints that reject it)",
    )
    out = parser.add_argument_group("results")
    out.add_argument("--slo", metavar="SPEC", help="e.g. ttft_p95_ms=500,itl_p95_ms=50")
    out.add_argument(
        "--knee-fraction",
        type=float,
        default=0.10,
        help="marginal-throughput knee threshold (default 0.10)",
    )
    out.add_argument("--json", type=Path, metavar="FILE")
    out.add_argument("--csv", type=Path, metavar="FILE")
    out.add_argument("--plot", type=Path, metavar="FILE.png")
    out.add_argument("--emit-policy", type=Path, metavar="FILE")
    out.add_argument("--quiet", action="store_true", help="no progress display")


def run(
    args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    try:
        plan, workloads = _plan(args)
        gc.freeze()  # start-up objects live to the end: keep full collections short
        result, labels = anyio.run(
            _sweep, args, plan, workloads, err, backend_options={"use_uvloop": HAS_UVLOOP}
        )
        failures = _write_outputs(args, result, labels, out)
    except (OptionError, SloError, WorkloadError, TargetError, PolicyError, PlotError) as exc:
        err.write(f"kneecap bench: error: {exc}\n")
        return EXIT_USAGE
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        err.write(f"kneecap bench: error: {where}{exc.strerror or exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.write("kneecap bench: interrupted\n")
        return 130
    for failure in failures:  # the outputs that could be written were
        err.write(f"kneecap bench: error: {failure}\n")
    return EXIT_USAGE if failures else 0


def _loads(text: str, kind: str) -> tuple[float, ...]:
    try:
        values = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise OptionError(f"--{kind} {text!r}: expected numbers separated by commas") from None
    if not values or not all(_positive(v) for v in values):
        raise OptionError(f"--{kind} {text!r}: give positive values (finite numbers)")
    if kind == "concurrency" and any(v != int(v) for v in values):
        raise OptionError(f"--concurrency {text!r}: concurrencies are whole numbers")
    return tuple(values)


def _positive(value: float) -> bool:
    """A positive real number: no NaN (every comparison is false) and no infinity."""
    return math.isfinite(value) and value > 0


def _plan(args: argparse.Namespace) -> tuple[SweepPlan, list[Workload]]:
    kind: LoadKind = "rate" if args.rate is not None else "concurrency"
    given = args.rate if args.rate is not None else args.concurrency
    if given is not None and not given.strip():  # an empty list is a mistake, not the default
        raise OptionError(f"--{kind} needs at least one value")
    loads = _loads(given or DEFAULT_CONCURRENCY, kind)
    for name in ("requests", "duration", "output_tokens", "timeout", "speed"):
        value = getattr(args, name)
        if value is not None and not _positive(value):
            raise OptionError(f"--{name.replace('_', '-')} must be positive and finite")
    if args.warmup is not None and args.warmup < 0:
        raise OptionError("--warmup must be >= 0")
    if not (math.isfinite(args.stagger) and args.stagger >= 0):
        raise OptionError("--stagger must be >= 0 and finite")
    if not 0 < args.knee_fraction < 1:
        raise OptionError("--knee-fraction must be between 0 and 1")
    for option in ("json", "csv", "plot", "emit_policy"):  # fail before a long sweep
        path: Path | None = getattr(args, option)
        if path is not None and not path.parent.is_dir():
            raise OptionError(f"--{option.replace('_', '-')} {path}: no such directory")
        if path is not None and path.is_dir() and option != "plot":  # a plot goes to PATH.png
            raise OptionError(f"--{option.replace('_', '-')} {path}: is a directory")
    if args.plot is not None:
        check_plot_path(args.plot)
    specs = _target_specs(args)
    if len(specs) == 2 and _same_target(*specs):  # both would report under one label
        first = "--sim" if args.sim is not None else "--url"
        raise OptionError(f"--compare {args.compare}: the same target as {first}")
    slo = parse_slo(args.slo) if args.slo else None
    if args.requests_file is not None:
        workloads: list[Workload] = [
            load_requests_file(args.requests_file, args.output_tokens, args.seed)
        ]
    else:
        workloads = workloads_from(
            parse_prompt_tokens(args.prompt_tokens), args.output_tokens, args.seed
        )
    plan = SweepPlan(
        kind=kind,
        loads=loads,
        requests=args.requests,
        duration_s=args.duration,
        warmup=args.warmup,
        arrival=args.arrival,
        seed=args.seed,
        fraction=args.knee_fraction,
        slo=slo,
        stagger=args.stagger,
    )
    for load in loads:  # a load so large its default request count overflows
        try:
            plan.point(load, 0)
        except OverflowError:
            raise OptionError(f"--{kind} {load:g}: too large") from None
    return plan, workloads


def _target_specs(args: argparse.Namespace) -> list[str]:
    """The targets as ``_target`` takes them: a URL or ``sim:PROFILE``, A then B."""
    specs = [SIM_PREFIX + args.sim if args.sim is not None else args.url]
    if args.compare is not None:  # `--compare "$URL"` with URL unset is a bad URL, not no B
        specs.append(args.compare)
    return specs


def _same_target(a: str, b: str) -> bool:
    if a.startswith(SIM_PREFIX) or b.startswith(SIM_PREFIX):
        return a == b
    return ApiUrl.parse(a).api == ApiUrl.parse(b).api  # with or without /v1, one endpoint


def _target(spec: str, args: argparse.Namespace, max_in_flight: int) -> Target:
    if spec.startswith(SIM_PREFIX):
        return SimTarget.for_profile(spec[len(SIM_PREFIX) :])
    return HttpTarget(
        spec,
        endpoint=ENDPOINTS[args.endpoint],
        model=args.model,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        max_in_flight=max_in_flight,
        stall_timeout_s=args.timeout,
        speed=args.speed,
    )


async def _sweep(
    args: argparse.Namespace, plan: SweepPlan, workloads: list[Workload], err: TextIO
) -> tuple[SweepResult, list[str]]:
    # Open loop has no bound on requests in flight; the pool must not become one.
    in_flight = int(max(plan.loads)) if plan.kind == "concurrency" else 2048
    targets: list[Target] = []
    try:
        for spec in _target_specs(args):
            targets.append(_target(spec, args, in_flight))
        progress = ProgressDisplay(None if args.quiet else err)
        result = await run_sweep(plan, workloads, targets, progress)
    finally:
        for target in targets:
            await target.aclose()
    return result, [t.label for t in targets]


def _write_outputs(
    args: argparse.Namespace, result: SweepResult, labels: list[str], out: TextIO
) -> list[str]:
    """Print the report and write every requested file; one line per file that failed.

    Each file is tried whatever became of the others: a plot or a policy that
    cannot be written after a long sweep must not cost the rest of its results.
    """
    notes = [f"{label}: {n}" for label, ns in result.notes.items() for n in ns]
    out.write(render(result, notes))
    settings: dict[str, Any] = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in ("api_key", "func", "command") and not callable(v)
    }
    document = result_json(result, settings)
    if len(labels) == 2:
        out.write("\n" + render_comparison(result, labels[0], labels[1]))
        document["comparison"] = comparison_json(result, labels[0], labels[1])
    writers: list[tuple[Path | None, Callable[[Path], object]]] = [
        (args.json, lambda path: path.write_text(json.dumps(document, indent=2) + "\n")),
        (args.csv, lambda path: path.write_text(result_csv(result))),
        (args.emit_policy, lambda path: path.write_text(policy_yaml(result, labels[0]))),
        (args.plot, lambda path: write_plot(result, path)),
    ]
    failures = []
    for path, write in writers:
        if path is None:
            continue
        try:
            write(path)
        except (PolicyError, PlotError) as exc:
            failures.append(str(exc))
        except OSError as exc:
            failures.append(f"{exc.filename or path}: {exc.strerror or exc}")
    return failures
