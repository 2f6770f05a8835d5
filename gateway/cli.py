"""``kneecap``: serve | sim | check-config | bench."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence

import uvicorn
from uvicorn.config import LOG_LEVELS

from backends.sim.base import (
    DEFAULT_ITL_MS,
    DEFAULT_TTFT_MS,
    MAX_DELAY_MS,
    MAX_SPEED,
    MIN_SPEED,
)
from gateway.config_file import read_config_file
from gateway.config_warnings import config_warnings, ignored_environment
from gateway.embedded import DEFAULT_MODEL
from gateway.settings import (
    CONFIG_ENV,
    ConfigError,
    Settings,
    build_settings,
    load_settings,
)


def _serve(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.drain import Drain
    from gateway.serving import build_embedded_sims, gateway_server, run_servers

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"kneecap: invalid config:\n{exc}", file=sys.stderr)
        return 1
    _warn_of_likely_slips(settings)
    host = args.host if args.host is not None else settings.listen.host
    port = args.port if args.port is not None else settings.listen.port
    sims = build_embedded_sims(settings.backends)
    drain = Drain(settings.listen.drain_timeout_s)
    app = create_app(
        settings,
        # the file load_settings read
        config_path=args.config if args.config is not None else os.environ.get(CONFIG_ENV),
        sim_urls={s.name: s.url for s in sims},
        drain=drain,
    )
    gateway = gateway_server(app, host, port, drain, log_level=args.log_level)
    run_servers(gateway, sims, drain, lambda bound: _print_banner(settings, host, bound, sims))
    return 0


def _warn_of_likely_slips(settings: Settings) -> None:
    for name in ignored_environment(settings):
        print(f"kneecap: warning: {name} names no setting; ignored", file=sys.stderr)
    for warning in config_warnings(settings):
        print(f"kneecap: warning: {warning}", file=sys.stderr)


def _print_banner(settings: Settings, host: str, port: int, sims: Sequence[object]) -> None:
    from gateway.serving import http_url

    base = f"{http_url(host, port)}/v1"
    print(f"kneecap gateway on {http_url(host, port)}  ({len(settings.backends)} backends)")
    for backend in settings.backends:
        where = backend.url or next(s.url for s in sims if s.name == backend.name)  # type: ignore[attr-defined]
        kind = "simulated " if backend.url is None else ""
        print(f"  {backend.name:<14} pool={backend.pool:<6} {kind}{backend.engine} at {where}")
    model = next((m for b in settings.backends for m in b.models), DEFAULT_MODEL)
    print(
        "\nPoint the OpenAI SDK at it:\n"
        "  from openai import OpenAI\n"
        f'  client = OpenAI(base_url="{base}", api_key="x")\n'
        f'  client.chat.completions.create(model="{model}", '
        'messages=[{"role": "user", "content": "hi"}], stream=True)\n'
        "Ctrl-C stops it.",
        flush=True,
    )


def _port(text: str) -> int:
    port = int(text) if text.isascii() and text.isdigit() else -1  # isdigit() alone takes "²"
    if not 0 <= port <= 65535:  # the kernel would take it modulo 65536 and listen elsewhere
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return port


def _number(text: str) -> float:
    """``float(text)``, or NaN for what is no number: NaN then fails every range check."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _positive(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _non_negative(text: str) -> float:
    value = _number(text)
    if not 0 <= value < math.inf:  # a negative or NaN delay fails anyio.sleep on every token
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number")
    return value


def _delay_ms(text: str) -> float:
    value = _non_negative(text)
    if value > MAX_DELAY_MS:
        raise argparse.ArgumentTypeError(f"{text!r} is more than an hour ({MAX_DELAY_MS:.0f} ms)")
    return value


def _speed(text: str) -> float:
    value = _positive(text)
    if not MIN_SPEED <= value <= MAX_SPEED:
        raise argparse.ArgumentTypeError(
            f"{text!r} is outside {MIN_SPEED:g}-{MAX_SPEED:g} times real time"
        )
    return value


def _host(text: str) -> str:
    if not text.strip():  # asyncio reads "" as every interface: `--host "$HOST"` with HOST unset
        raise argparse.ArgumentTypeError(
            "the address is empty (0.0.0.0 or :: listens on every interface)"
        )
    return text


def _model(text: str) -> str:
    if not text.strip():  # `--model "$MODEL"` with MODEL unset: no client could name it
        raise argparse.ArgumentTypeError("the model name is empty")
    return text


def _config_path(text: str) -> str:
    if not text.strip():  # `--config "$CFG"` with CFG unset: not a request for the embedded sims
        raise argparse.ArgumentTypeError("the config path is empty")
    return text


def _sim(args: argparse.Namespace) -> int:
    from backends.sim.arrival import HTTP_PROTOCOL
    from backends.sim.factory import make_engine
    from backends.sim.server import create_sim_app
    from gateway.serving import http_url, run_server, server_config

    if args.list_profiles:
        from backends.sim.profiles import format_profiles

        print(format_profiles())
        return 0
    if args.calibrate:
        from backends.sim.calibration import calibration_table

        print(calibration_table())
        return 0
    if args.profile and any(getattr(args, n) is not None for n in ("ttft_ms", "itl_ms")):
        # A profile's latencies come from its cost model: taking the flag silently would
        # run another engine than the one asked for.
        flags = (("--ttft-ms", args.ttft_ms), ("--itl-ms", args.itl_ms))
        given = [flag for flag, value in flags if value is not None]
        print(
            f"kneecap sim: {' and '.join(given)} set a fixed-latency engine; a --profile "
            "has its own latencies (use one or the other)",
            file=sys.stderr,
        )
        return 2
    if args.ttft_ms is None:
        args.ttft_ms = DEFAULT_TTFT_MS
    if args.itl_ms is None:
        args.itl_ms = DEFAULT_ITL_MS
    try:
        if args.profile and args.engine is not None:
            from backends.sim.profiles import engine_conflict

            if why := engine_conflict(args.profile, args.engine):
                print(f"kneecap sim: {why}", file=sys.stderr)
                return 2
        engine = make_engine(
            model=args.model,
            profile=args.profile,
            ttft_ms=args.ttft_ms,
            itl_ms=args.itl_ms,
            speed=args.speed,
            seed=args.seed,
            flavor=args.engine or "vllm",
        )
    except (KeyError, ValueError) as exc:  # an unknown profile, a profile's bad knob
        print(f"kneecap sim: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    what = args.profile or f"fixed ttft={args.ttft_ms}ms itl={args.itl_ms}ms"

    def announce(port: int) -> None:
        where = http_url(args.host, port)
        print(f"kneecap sim: {args.model} ({what}, speed {args.speed}x) on {where}", flush=True)

    app = create_sim_app(engine, args.model)
    server = uvicorn.Server(server_config(app, args.host, args.port, http=HTTP_PROTOCOL))
    try:
        run_server(server, announce)
    except KeyboardInterrupt:
        pass
    return 0


def _check_config(args: argparse.Namespace) -> int:
    try:
        data = read_config_file(args.file)
    except ConfigError as exc:  # about the file as a whole: the message names it
        print(exc, file=sys.stderr)
        return 1
    try:
        settings = build_settings(data)
    except ConfigError as exc:  # about its keys, which name no file
        print(f"{args.file}: invalid config:\n{exc}", file=sys.stderr)
        return 1
    _warn_of_likely_slips(settings)
    print(f"{args.file}: ok")
    print(f"  listen {settings.listen.host}:{settings.listen.port}")
    for name, pool in settings.pools.items():
        upper = pool.max_prompt_tokens if pool.max_prompt_tokens is not None else "∞"
        members = ", ".join(b.name for b in settings.backends if b.pool == name) or "-"
        print(
            f"  pool {name}: prompts [{pool.min_prompt_tokens}, {upper}) tokens,"
            f" backends: {members}"
        )
    auth = settings.auth
    admin = "set" if auth.admin_token else "none"
    print(f"  client keys: {len(auth.client_keys())}, admin token: {admin}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from gateway.bench.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kneecap", description="Adaptive OpenAI-compatible LLM gateway"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run the gateway (embedded simulated backends without a config)"
    )
    serve.add_argument(
        "--config",
        type=_config_path,
        help="YAML config file (default: $KNEECAP_CONFIG, else embedded)",
    )
    serve.add_argument("--host", type=_host, help="listen address (overrides config)")
    serve.add_argument("--port", type=_port, help="listen port (overrides config)")
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    serve.set_defaults(func=_serve)

    sim = sub.add_parser("sim", help="run a simulated vLLM/SGLang backend")
    sim.add_argument("--host", type=_host, default="127.0.0.1")
    sim.add_argument("--port", type=_port, default=8100)
    sim.add_argument("--model", type=_model, default=DEFAULT_MODEL)
    sim.add_argument("--profile", help="calibrated engine profile, e.g. qwen3-4b/l40s/bf16/vllm")
    fixed = "fixed {}, without a profile (default {:g})"
    sim.add_argument("--ttft-ms", type=_delay_ms, help=fixed.format("TTFT", DEFAULT_TTFT_MS))
    sim.add_argument("--itl-ms", type=_delay_ms, help=fixed.format("ITL", DEFAULT_ITL_MS))
    sim.add_argument(
        "--speed",
        type=_speed,
        default=1.0,
        help=f"run K times faster than real time ({MIN_SPEED:g}-{MAX_SPEED:g})",
    )
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        help="metric names (default: the profile's engine, else vllm)",
    )
    sim.add_argument("--list-profiles", action="store_true")
    sim.add_argument("--calibrate", action="store_true", help="print simulator vs field figures")
    sim.set_defaults(func=_sim)

    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("file", type=_config_path)
    check.set_defaults(func=_check_config)

    try:
        from gateway.bench.command import add_arguments
    except ImportError:  # the bench package is optional in trimmed installs
        add_arguments = None
    if add_arguments is not None:
        bench = sub.add_parser("bench", help="find the throughput-latency knee of an endpoint")
        add_arguments(bench)
        bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(getattr(args, "log_level", "info"))
    return args.func(args)


def _configure_logging(name: str) -> None:
    """``--log-level`` governs kneecap's own loggers as well as uvicorn's (set by its
    config): both read the same names, ``trace`` being uvicorn's level below debug.

    Other libraries log their warnings and errors only: their INFO and DEBUG lines (httpx's
    line per upstream call, matplotlib's font cache on a first plot) are theirs to debug,
    noise in a gateway's or a bench's output."""
    level = LOG_LEVELS[name]
    logging.basicConfig(
        level=max(logging.WARNING, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kneecap").setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
