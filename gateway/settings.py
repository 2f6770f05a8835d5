"""Configuration: one YAML file, every field overridable by ``KNEECAP_*`` env.

Validated once into frozen models. Env wins over the file so that a container
can override a mounted config (``KNEECAP_LISTEN__PORT=9000``; lists and
mappings as JSON, e.g. ``KNEECAP_AUTH__API_KEYS='["k1"]'``).
"""

from __future__ import annotations

import itertools
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from backends.sim.base import (
    DEFAULT_ITL_MS,
    DEFAULT_TTFT_MS,
    MAX_DELAY_MS,
    MAX_SPEED,
    MIN_SPEED,
)
from gateway.config_file import ConfigError, format_validation_error, read_config_file
from policies.base import refuse_yes_or_no_for_numbers
from policies.knee import KneeLimitConfig
from policies.registry import LimitConfig

ENV_PREFIX = "KNEECAP_"
CONFIG_ENV = "KNEECAP_CONFIG"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_yes_or_no_for_a_number(cls, data: Any) -> Any:
        # `port: false` bound a random port, `max_queue_depth: false` shed every queued request.
        return refuse_yes_or_no_for_numbers(cls, data)


class ListenConfig(Frozen):
    # Not blank: asyncio reads "" as every interface (`host: "$HOST"` with HOST unset).
    host: str = Field("127.0.0.1", pattern=r"\S")
    port: int = Field(8000, ge=0, le=65535)
    # On SIGTERM/Ctrl-C, how long requests in flight and in the queues may take to
    # finish; then the queued ones are answered 503 and the rest cut. Read at startup.
    drain_timeout_s: float = Field(120.0, ge=0)
    # How long a client may leave a response unread (the socket's buffers full) before its
    # connection is cut, like nginx's send_timeout: else a client that stops reading a stream
    # holds its backend's permit for good. Each stall is timed afresh.
    send_timeout_s: float = Field(60.0, gt=0)
    # How long a request line and headers may take to arrive once begun: a head that trickles
    # in would hold its connection (a file descriptor) for good.
    head_timeout_s: float = Field(30.0, gt=0)
    # How long a request body may pause between reads once its head is in, like nginx's
    # client_body_timeout: a body that never finishes would hold its connection for good.
    body_timeout_s: float = Field(60.0, gt=0)


class SimConfig(Frozen):
    """An in-process simulated backend that ``kneecap serve`` starts itself."""

    profile: str | None = None  # a calibrated engine profile; None → fixed latencies
    ttft_ms: float = Field(DEFAULT_TTFT_MS, ge=0, le=MAX_DELAY_MS)
    itl_ms: float = Field(DEFAULT_ITL_MS, ge=0, le=MAX_DELAY_MS)
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    seed: int = 0

    @model_validator(mode="after")
    def _known_profile(self) -> SimConfig:
        fixed = sorted({"ttft_ms", "itl_ms"} & self.model_fields_set)
        if self.profile is not None and fixed:
            # A profile's latencies come from its cost model: taken quietly, these would
            # be ignored, and another engine run than the one described.
            raise ValueError(
                f"{' and '.join(fixed)} set a fixed-latency engine; `profile` has its own "
                "latencies (give one or the other)"
            )
        if self.profile is not None:
            from backends.sim.profiles import get_profile  # the simulator, only when named

            try:
                get_profile(self.profile)
            except KeyError:
                raise ValueError(
                    f"unknown simulator profile {self.profile!r} "
                    "(`kneecap sim --list-profiles` lists them)"
                ) from None
        return self


def _sim_profile(sim: Any) -> Any:
    """The named simulator profile of a ``sim`` block (mapping or model), if it names a
    known one; unknown names are SimConfig's to refuse."""
    name = sim.get("profile") if isinstance(sim, dict) else getattr(sim, "profile", None)
    if not isinstance(name, str):
        return None
    from backends.sim.profiles import get_profile  # the simulator, only when named

    try:
        return get_profile(name)
    except KeyError:
        return None


class BackendConfig(Frozen):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str | None = None  # filled in for `sim` backends once they listen
    pool: str = "short"
    engine: Literal["vllm", "sglang", "openai"] = "vllm"
    models: tuple[Annotated[str, Field(min_length=1)], ...] = ()  # empty → from /v1/models
    api_key: SecretStr | None = None
    api_key_env: str | None = None
    sim: SimConfig | None = None
    limit: LimitConfig | None = None  # overrides admission.limit for this backend
    # Context length; None → learned from the backend's /v1/models (`max_model_len`).
    max_model_len: int | None = Field(None, gt=0)
    # Prompt + max output tokens admitted at once; None → from the KV capacity when
    # known (simulated profiles), else routing.token_budget.default_max_tokens_in_flight.
    max_tokens_in_flight: int | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _engine_of_the_profile(cls, data: Any) -> Any:
        """A simulated profile names its engine (``…/vllm``, ``…/sglang``): unless said
        otherwise, the backend is that engine, so its /metrics names are the ones read."""
        if isinstance(data, dict) and "engine" not in data:
            profile = _sim_profile(data.get("sim"))
            if profile is not None:
                return {**data, "engine": profile.flavor}
        return data

    @model_validator(mode="after")
    def _engine_matches_the_profile(self) -> BackendConfig:
        profile = _sim_profile(self.sim)
        if profile is not None and profile.flavor != self.engine:
            raise ValueError(
                f"engine {self.engine!r} contradicts sim profile {self.sim.profile!r} "  # type: ignore[union-attr]
                f"(a {profile.flavor} engine): its /metrics would not be read; "
                f"set `engine: {profile.flavor}` or leave `engine` out"
            )
        return self

    @field_validator("url")
    @classmethod
    def _valid_url(cls, url: str | None) -> str | None:
        if url is not None:
            _check_url(url)
        return url

    @model_validator(mode="after")
    def _url_or_sim(self) -> BackendConfig:
        if self.url is None and self.sim is None:
            raise ValueError("a backend needs `url` (or `sim` for a simulated one)")
        # Either would silently win over the other; say which one is meant.
        if self.url is not None and self.sim is not None:
            raise ValueError("a backend has `url` or `sim` (a simulator kneecap starts), not both")
        if self.api_key is not None and self.api_key_env:
            raise ValueError("a backend has `api_key` or `api_key_env`, not both")
        if self.api_key_env and not os.environ.get(self.api_key_env, "").strip():
            raise ValueError(
                f"api_key_env names {self.api_key_env}, which is unset or empty "
                "(the backend would be called without its key)"
            )
        return self

    def resolved_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env:
            return os.environ.get(self.api_key_env)
        return None


def _check_url(url: str) -> None:
    """Refused here, with the key's path, rather than found by whatever reads the URL
    first (a reload's checks, a connection) after the config was taken."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    if any(char.isspace() for char in url):
        raise ValueError(f"url {url!r} holds a space")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port out of range or not a number
    except ValueError as exc:
        raise ValueError(f"url {url!r} is not a valid URL: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"url {url!r} names no host")
    if port == 0:  # a connection would go to the scheme's port instead
        raise ValueError(f"url {url!r}: port 0 is no port to connect to")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        # Request paths are appended to the URL: a query or fragment would swallow them.
        raise ValueError(f"url {url!r}: a backend URL has no query or fragment")


class PoolConfig(Frozen):
    """A set of replicas for a range of prompt lengths: ``[min, max)`` tokens."""

    min_prompt_tokens: int = Field(0, ge=0)
    max_prompt_tokens: int | None = Field(None, gt=0)
    max_queue_depth: int = Field(256, ge=0)
    max_queue_wait_s: float = Field(30.0, ge=0)
    # X-Kneecap-Max-Queue-Wait may ask for a different wait, up to this ceiling.
    max_queue_wait_ceiling_s: float = Field(120.0, ge=0)
    # While both classes wait, at least this share of the freed permits goes to `batch`.
    batch_share: float = Field(0.1, ge=0, le=1)

    @model_validator(mode="after")
    def _ranges_ordered(self) -> PoolConfig:
        # A lower ceiling would shed the clients that ask to wait longer sooner than
        # those that ask nothing.
        if self.max_queue_wait_ceiling_s < self.max_queue_wait_s:
            raise ValueError(
                f"max_queue_wait_ceiling_s ({self.max_queue_wait_ceiling_s:g}) must be at least "
                f"max_queue_wait_s ({self.max_queue_wait_s:g})"
            )
        # An empty range routes nothing to the pool: every prompt meant for it would
        # be refused or sent elsewhere, with nothing to say the range was mistyped.
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= self.min_prompt_tokens:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) must be above "
                f"min_prompt_tokens ({self.min_prompt_tokens}): the range is [min, max)"
            )
        return self

    def accepts(self, prompt_tokens: int) -> bool:
        upper = self.max_prompt_tokens
        return prompt_tokens >= self.min_prompt_tokens and (upper is None or prompt_tokens < upper)


class HealthConfig(Frozen):
    interval_s: float = Field(2.0, gt=0, allow_inf_nan=False)  # inf would never probe
    # An engine busy at full batch can take seconds to answer; too short flaps it.
    timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    path: str = Field("/health", pattern=r"^/")  # appended to each backend's URL
    # Passive ejection (Envoy's outlier detection): this many consecutive failed requests
    # take a backend out for ejection_s times its ejections in a row, at most max_ejection_s;
    # a successful probe readmits it only after that (before, the next one did, and a
    # backend up by its /health but failing every request was back within interval_s).
    failure_threshold: int = Field(3, ge=1)
    ejection_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    max_ejection_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    # At most this share of a pool's backends is held out by passive ejection at once
    # (rounded down), and never the last one in rotation for a model of the pool: a few
    # requests that fail everywhere must not empty it.
    max_ejection_percent: int = Field(50, ge=0, le=100)

    @model_validator(mode="after")
    def _ejection_bounded(self) -> HealthConfig:
        if self.max_ejection_s < self.ejection_s:
            raise ValueError(
                f"max_ejection_s ({self.max_ejection_s}) must be at least "
                f"ejection_s ({self.ejection_s}): it caps the ejections that grow from it"
            )
        return self


class UpstreamConfig(Frozen):
    connect_timeout_s: float = Field(5.0, gt=0)
    # Longest wait for the next chunk: a stalled engine fails instead of hanging.
    read_timeout_s: float = Field(120.0, gt=0)
    max_attempts: int = Field(3, ge=1)
    # None → the sum of the backends' largest limits, at least 1024 (a fixed 1024 refused
    # five backends of default limits).
    max_connections: int | None = Field(None, ge=1)


class AdmissionConfig(Frozen):
    limit: LimitConfig = KneeLimitConfig()  # every backend's, unless it sets its own
    control_interval_s: float = Field(1.0, gt=0, allow_inf_nan=False)


class EstimatorConfig(Frozen):
    """How prompt tokens are counted before routing (see docs/routing.md)."""

    # chars: characters per token, calibrated per model from the backends' usage;
    # tokenizer: exact, from the local tokenizer.json of `tokenizers` (others: chars);
    # backend: asked of a backend's /tokenize (chars when it does not answer in time).
    mode: Literal["chars", "tokenizer", "backend"] = "chars"
    chars_per_token: float = Field(4.0, gt=0)  # before any usage was observed
    calibration_alpha: float = Field(0.05, gt=0, le=1)  # EWMA weight of one observation
    tokenizers: dict[str, str] = Field(default_factory=dict)  # model → tokenizer.json path
    tokens_per_message: int = Field(4, ge=0)  # chat template overhead per message
    tokens_per_reply: int = Field(3, ge=0)  # and once per prompt (the reply's header)
    tokenize_timeout_s: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _tokenizers_usable(self) -> EstimatorConfig:
        for model, path in self.tokenizers.items():
            if not Path(path).is_file():
                raise ValueError(f"tokenizer for {model!r}: no such file {path!r}")
        if self.tokenizers:
            import importlib.util

            if importlib.util.find_spec("tokenizers") is None:
                raise ValueError(
                    "estimator.tokenizers needs the `tokenizers` package: "
                    "pip install 'kneecap[tokenizers]'"
                )
            from tokenizers import Tokenizer  # only when configured: not a core dependency

            # Read once here, so a file that is no tokenizer.json is refused at load, not
            # answered 500 on every request for its model.
            for model, path in self.tokenizers.items():
                try:
                    Tokenizer.from_file(path)
                except Exception as exc:  # the library raises its own untyped errors
                    raise ValueError(
                        f"tokenizer for {model!r}: {path!r} is not a tokenizer.json ({exc})"
                    ) from None
        return self


class SpillConfig(Frozen):
    # Short prompts may borrow a longer-range pool's idle headroom when their own
    # pool is saturated and the lender is not.
    to_longer: bool = True
    # Long prompts may borrow a shorter-range pool's idle headroom (off: they wait).
    to_shorter: bool = False
    # A lender's backend counts as idle while its load with the request stays <= this.
    max_load: float = Field(0.5, gt=0, le=1)


class AffinityConfig(Frozen):
    """Return a conversation to the replica that holds its prefix cache."""

    enabled: bool = False
    header: str = "x-kneecap-session"  # the session key; else the body's `user` field
    use_user_field: bool = True
    max_load: float = Field(0.9, gt=0)  # this full (or fuller), the replica is saturated
    max_sessions: int = Field(100_000, ge=1)  # least recently used sessions are forgotten


class TokenBudgetConfig(Frozen):
    """Admission in tokens: prompt + max output tokens in flight per backend."""

    enabled: bool = True
    kv_fraction: float = Field(0.95, gt=0, le=1)  # of the KV capacity, when it is known
    default_max_tokens_in_flight: int | None = Field(None, gt=0)  # when it is not
    default_output_tokens: int = Field(256, ge=1)  # a request without max_tokens


class RoutingConfig(Frozen):
    policy: Literal["headroom", "least_loaded", "round_robin"] = "headroom"
    # Backends whose load is within this of the best are near-equals: two of them
    # are drawn at random and the less loaded one wins (power of two choices).
    near_equal: float = Field(0.1, ge=0)
    estimator: EstimatorConfig = EstimatorConfig()
    spill: SpillConfig = SpillConfig()
    affinity: AffinityConfig = AffinityConfig()
    token_budget: TokenBudgetConfig = TokenBudgetConfig()


class ClientKey(Frozen):
    key: SecretStr
    priority: Literal["interactive", "batch"] = "interactive"


class MeasurementConfig(Frozen):
    # Rolling window of TTFT/ITL/tokens per backend; keep it <= the knee controller's
    # settle_s so that each judgement sees the level it judges.
    window_s: float = Field(5.0, gt=0)
    scrape_interval_s: float = Field(1.0, gt=0, allow_inf_nan=False)  # engines' own /metrics
    scrape_staleness_s: float = Field(5.0, gt=0)  # older engine figures count as absent


class AuthConfig(Frozen):
    # A key alone, or {key, priority} to give its requests a priority class.
    api_keys: tuple[SecretStr | ClientKey, ...] = ()
    api_keys_env: str | None = None  # comma-separated keys in this env variable
    admin_token: SecretStr | None = None
    forward_client_key: bool = False

    @model_validator(mode="after")
    def _no_empty_secret(self) -> AuthConfig:
        # An empty key would let in every client that sends none; an empty admin token
        # would read as no token at all, leaving the admin API open.
        keys = [k.key if isinstance(k, ClientKey) else k for k in self.api_keys]
        if any(not k.get_secret_value().strip() for k in keys):
            raise ValueError("api_keys: a client key must not be empty")
        if self.admin_token is not None and not self.admin_token.get_secret_value().strip():
            raise ValueError("admin_token must not be empty (leave it out for no token)")
        # An unmounted secret must not turn into "no keys": that is a gateway open to all.
        if self.api_keys_env and not os.environ.get(self.api_keys_env, "").strip(" ,"):
            raise ValueError(
                f"api_keys_env names {self.api_keys_env}, which is unset or holds no key "
                "(with no keys the gateway would admit every client)"
            )
        seen: dict[str, str] = {}
        for key, priority in self.client_keys():
            if seen.setdefault(key, priority) != priority:
                raise ValueError("api_keys: a client key is listed as both interactive and batch")
        return self

    def client_keys(self) -> tuple[tuple[str, str], ...]:
        """(key, priority class) pairs."""
        keys = [
            (k.key.get_secret_value(), k.priority)
            if isinstance(k, ClientKey)
            else (k.get_secret_value(), "interactive")
            for k in self.api_keys
        ]
        if self.api_keys_env:
            extra = os.environ.get(self.api_keys_env, "").split(",")
            keys += [(k.strip(), "interactive") for k in extra if k.strip()]
        return tuple(keys)


class CorsConfig(Frozen):
    """Cross-origin access for browser clients, with vLLM's defaults (its
    ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` and
    ``--allow-credentials``), so a browser app that worked against the engine works here.
    The keys are bearer tokens, not cookies, so any origin is no wider than the keys."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Response headers a browser script may read. vLLM exposes none; these let a browser
    # SDK honour a 429's Retry-After and report the request id.
    expose_headers: tuple[str, ...] = ("retry-after", "x-request-id")


DEFAULT_MAX_CONNECTIONS = 1024

DEFAULT_POOLS: dict[str, dict[str, int]] = {
    "short": {"max_prompt_tokens": 8192},
    "long": {"min_prompt_tokens": 8192},
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        frozen=True, extra="forbid", env_prefix=ENV_PREFIX, env_nested_delimiter="__"
    )

    listen: ListenConfig = ListenConfig()
    pools: dict[str, PoolConfig] = Field(
        default_factory=lambda: {name: PoolConfig(**pool) for name, pool in DEFAULT_POOLS.items()}
    )
    backends: tuple[BackendConfig, ...] = ()
    health: HealthConfig = HealthConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    auth: AuthConfig = AuthConfig()
    admission: AdmissionConfig = AdmissionConfig()
    measurement: MeasurementConfig = MeasurementConfig()
    routing: RoutingConfig = RoutingConfig()
    cors: CorsConfig = CorsConfig()
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    watch_config: bool = False

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file arrives as init kwargs; env must override it.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        names = [b.name for b in self.backends]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"backend names must be unique, repeated: {', '.join(duplicates)}")
        # One pool serves every backend, and each may be at its largest limit at once.
        needed = self._connections_needed()
        if self.upstream.max_connections is not None and self.upstream.max_connections < needed:
            raise ValueError(
                f"upstream.max_connections ({self.upstream.max_connections}) must be at least the "
                f"sum of the backends' largest concurrency limits ({needed}): the pool is "
                "shared, and it must not limit before admission does"
            )
        for backend in self.backends:
            if backend.pool not in self.pools:
                known = ", ".join(sorted(self.pools))
                raise ValueError(
                    f"backend {backend.name!r} is in pool {backend.pool!r}, "
                    f"which is not defined (pools: {known})"
                )
        return self

    def _connections_needed(self) -> int:
        return sum(self.limit_of(b).max for b in self.backends)

    @property
    def upstream_connections(self) -> int:
        """The traffic pool's bound: ``upstream.max_connections`` or its default."""
        if self.upstream.max_connections is not None:
            return self.upstream.max_connections
        return max(DEFAULT_MAX_CONNECTIONS, self._connections_needed())

    def limit_of(self, backend: BackendConfig) -> LimitConfig:
        return backend.limit if backend.limit is not None else self.admission.limit


def _no_list_items_by_index(environ: Mapping[str, str]) -> None:
    """``KNEECAP_BACKENDS__0__NAME``: pydantic-settings reads it as a mapping where a list is
    due and says only that a tuple was expected, naming no variable."""
    for name in environ:
        if name.startswith(ENV_PREFIX) and _indexes_a_list(name[len(ENV_PREFIX) :].split("__")):
            raise ConfigError(
                f"{name}: a list is overridden whole, as JSON (e.g. "
                f"KNEECAP_BACKENDS='[{{\"name\": ...}}]'), not item by item"
            )


def _indexes_a_list(path: list[str]) -> bool:
    model: Any = Settings
    for part, after in itertools.pairwise(path):
        field = model.model_fields.get(part.lower()) if isinstance(model, type) else None
        if field is None:
            return False
        if typing.get_origin(field.annotation) in (tuple, list):
            return after.isdigit()
        model = field.annotation if isinstance(field.annotation, type) else None
        if model is None or not issubclass(model, BaseModel):
            return False
    return False


def build_settings(data: dict[str, Any]) -> Settings:
    # YAML allows any scalar as a key; keyword arguments must be strings.
    odd = [repr(key) for key in data if not isinstance(key, str)]
    if odd:
        raise ConfigError(f"(top level): keys must be strings, got {', '.join(odd)}")
    if "pools" not in data:
        # Spelt out, so that an environment override of one pool's knob merges into the
        # default pools rather than replacing them all with that one.
        data = {**data, "pools": {name: dict(pool) for name, pool in DEFAULT_POOLS.items()}}
    _no_list_items_by_index(os.environ)
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc
    except SettingsError as exc:  # an environment override that is no JSON where JSON is due
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise ConfigError(
            f"{exc}{cause} (lists and mappings from the environment are JSON)"
        ) from exc


def load_settings(path: str | Path | None) -> Settings:
    """From a file (or ``$KNEECAP_CONFIG``), else the embedded default."""
    if path is None:
        path = os.environ.get(CONFIG_ENV)
    if path is not None and not str(path).strip():
        # `--config "$CFG"` with CFG unset: not a request for the simulated default.
        raise ConfigError(f"the config path is empty (--config or ${CONFIG_ENV})")
    if path is None:
        from gateway.embedded import default_config

        return build_settings(default_config())
    return build_settings(read_config_file(path))
