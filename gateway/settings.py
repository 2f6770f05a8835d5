"""Configuration: one YAML file, every field overridable by ``KNEECAP_*`` env.

Validated once into frozen models. Env wins over the file so that a container
can override a mounted config (``KNEECAP_LISTEN__PORT=9000``; lists and
mappings as JSON, e.g. ``KNEECAP_AUTH__API_KEYS='["k1"]'``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from policies.knee import KneeLimitConfig
from policies.registry import LimitConfig

ENV_PREFIX = "KNEECAP_"
CONFIG_ENV = "KNEECAP_CONFIG"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ListenConfig(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # On SIGTERM/Ctrl-C, how long requests in flight and in the queues may take to
    # finish; then the queued ones are answered 503 and the rest cut. Read at startup.
    drain_timeout_s: float = Field(120.0, ge=0)


class SimConfig(Frozen):
    """An in-process simulated backend that ``kneecap serve`` starts itself."""

    profile: str | None = None  # a calibrated engine profile; None → fixed latencies
    ttft_ms: float = Field(50.0, ge=0)
    itl_ms: float = Field(15.0, ge=0)
    speed: float = Field(1.0, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _known_profile(self) -> SimConfig:
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
    models: tuple[str, ...] = ()  # empty → discovered from the backend's /v1/models
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

    @model_validator(mode="after")
    def _url_or_sim(self) -> BackendConfig:
        if self.url is None and self.sim is None:
            raise ValueError("a backend needs `url` (or `sim` for a simulated one)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        return self

    def resolved_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env:
            return os.environ.get(self.api_key_env)
        return None


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
    interval_s: float = Field(2.0, gt=0)
    # An engine busy at full batch can take seconds to answer; too short flaps it.
    timeout_s: float = Field(5.0, gt=0)
    path: str = Field("/health", pattern=r"^/")  # appended to each backend's URL
    # Passive ejection: this many consecutive failed requests take a backend out
    # until the next successful active probe.
    failure_threshold: int = Field(3, ge=1)


class UpstreamConfig(Frozen):
    connect_timeout_s: float = Field(5.0, gt=0)
    # Longest wait for the next chunk: a stalled engine fails instead of hanging.
    read_timeout_s: float = Field(120.0, gt=0)
    max_attempts: int = Field(3, ge=1)
    max_connections: int = Field(1024, ge=1)


class AdmissionConfig(Frozen):
    limit: LimitConfig = KneeLimitConfig()  # every backend's, unless it sets its own
    control_interval_s: float = Field(1.0, gt=0)


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
    scrape_interval_s: float = Field(1.0, gt=0)  # engines' own /metrics
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
        needed = sum(self.limit_of(b).max for b in self.backends)
        if self.upstream.max_connections < needed:
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

    def limit_of(self, backend: BackendConfig) -> LimitConfig:
        return backend.limit if backend.limit is not None else self.admission.limit


class ConfigError(Exception):
    """A config that cannot be used; the message names the bad key."""


def format_validation_error(error: ValidationError) -> str:
    """One line per error: the key's path as the file spells it, and what was wrong.

    A union (a key, or ``{key, priority}``) reports each of its branches; the branch
    for a scalar says nothing useful about a mapping that was given, so it is left out,
    and pydantic's own names for a branch (``lax-or-strict[...]``, a model's class
    name) are not part of the path."""
    items = error.errors()
    kept = [i for i in items if not (_internal_parts(i["loc"]) and isinstance(i["input"], dict))]
    lines = []
    for item in kept or items:
        parts = [str(part) for part in item["loc"] if not _is_branch_name(part)]
        lines.append(f"{'.'.join(parts) or '(top level)'}: {item['msg']}")
    return "\n".join(lines)


def _is_branch_name(part: str | int) -> bool:
    return isinstance(part, str) and ("[" in part or part[:1].isupper())


def _internal_parts(loc: tuple[str | int, ...]) -> bool:
    return any(isinstance(part, str) and "[" in part for part in loc)


def read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): {exc.reason}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def build_settings(data: dict[str, Any]) -> Settings:
    # YAML allows any scalar as a key; keyword arguments must be strings.
    odd = [repr(key) for key in data if not isinstance(key, str)]
    if odd:
        raise ConfigError(f"(top level): keys must be strings, got {', '.join(odd)}")
    if "pools" not in data:
        # Spelt out, so that an environment override of one pool's knob merges into the
        # default pools rather than replacing them all with that one.
        data = {**data, "pools": {name: dict(pool) for name, pool in DEFAULT_POOLS.items()}}
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc
    except SettingsError as exc:  # an environment override that is no JSON where JSON is due
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise ConfigError(
            f"{exc}{cause} (lists and mappings from the environment are JSON)"
        ) from exc


# Kubernetes gives every pod `<SERVICE>_PORT`, `<SERVICE>_SERVICE_HOST`, ... for each
# service in its namespace, so a service named `kneecap` sets these.
_SERVICE_LINK = re.compile(r"^KNEECAP_(PORT(_\d+_(TCP|UDP|SCTP)(_\w+)?)?|SERVICE_\w+)$", re.I)


def ignored_environment(settings: Settings, environ: Mapping[str, str] = os.environ) -> list[str]:
    """``KNEECAP_*`` variables that name no setting: most likely a misspelt override.

    A misspelt nested key (``KNEECAP_HEALTH__INTERVALS``) is refused like a file's; a
    misspelt first level (``KNEECAP_HEALHT__INTERVAL_S``) is not seen by the settings at
    all, so the gateway would run on the value it was meant to replace. Not refused:
    other programs may own variables with this prefix.
    """
    own = {CONFIG_ENV.upper()}
    if settings.auth.api_keys_env:
        own.add(settings.auth.api_keys_env.upper())
    own.update(b.api_key_env.upper() for b in settings.backends if b.api_key_env)
    fields = set(Settings.model_fields)
    ignored = []
    for name in environ:
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in own or _SERVICE_LINK.match(upper):
            continue
        if upper[len(ENV_PREFIX) :].split("__", 1)[0].lower() not in fields:
            ignored.append(name)
    return sorted(ignored)


def load_settings(path: str | Path | None) -> Settings:
    """From a file (or ``$KNEECAP_CONFIG``), else the embedded default."""
    path = path or os.environ.get(CONFIG_ENV)
    if path is None:
        from gateway.embedded import default_config

        return build_settings(default_config())
    return build_settings(read_config_file(path))
