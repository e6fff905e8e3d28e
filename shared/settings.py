"""Every `GPUQ_*` environment variable of the services and the CLI, in one typed settings object (pydantic-settings).

`settings()` reads them (uncached: a test's `monkeypatch.setenv` is seen by the next call; a read costs ~0.2 ms);
`settings(env)` reads a given mapping instead. A value that is not one raises `SettingsError` (a
ValueError) whose one line names the variable, with the words each setting has always used. A variable that is
unset or empty takes its default (but an empty GPUQ_WEBHOOK_CONFIGURATIONS means none: EMPTY_IS_A_VALUE).

Pure cores never read this: their shells read it and pass the values in. shared/namespace.py reads GPUQ_NAMESPACE
itself, with the same check: a subject is built for every event, and this read costs ~0.2 ms. The CLI reads its own
(GPUQ_CONFIG, GPUQ_DEBUG, GPUQ_API_URL, GPUQ_TOKEN, GPUQ_HOME) itself too: importing this module costs ~0.2 s, more
than `gpuq --help` takes. NATS_URL, DATABASE_URL, KUBECONFIG and TRACEPARENT are not here: they are the servers' and
the tools' own names. docs/settings.md is generated from this module (`python -m shared.settings > docs/settings.md`);
a test keeps the two, and every `GPUQ_*` name in services/, shared/, cli/ and gpuq_tools/, in step with it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from shared import namespace as namespaces

PREFIX = "GPUQ_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A GPUQ_* variable's value is not one; the message names the variable."""


def _env(field: str) -> str:
    return PREFIX + field.upper()


# Parsers of one variable's raw text. Each raises ValueError with the message that variable has always given.
def _seconds(var: str, *, check: Callable[[float], bool] = lambda v: True, refusal: str = "",
             number_msg: str = "{var} must be a number of seconds, not {raw!r}") -> Callable[[Any], Any]:
    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(number_msg.format(var=var, raw=raw)) from None
        if not check(value):
            raise ValueError(refusal.format(var=var, raw=raw, value=value))
        return value
    return parse


def _flag(var: str, refusal: str) -> Callable[[Any], Any]:
    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        text = raw.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE or text == "":
            return False
        raise ValueError(refusal.format(var=var, raw=raw, text=text))
    return parse


def _choice(var: str, words: tuple[str, ...]) -> Callable[[Any], Any]:
    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        text = raw.strip().lower() or words[0]
        if text not in words:
            raise ValueError(f"{var} must be one of {', '.join(words)}, not {raw!r}")
        return text
    return parse


def _days(var: str, floor: int, why: str) -> Callable[[Any], Any]:
    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        text = raw.strip()
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{var}={text!r} is not a whole number of days (0 keeps everything)") from None
        if value != 0 and value < floor:
            raise ValueError(f"{var}={text!r} is below its floor of {floor} days: {why} (0 keeps everything)")
        return value
    return parse


def _webhook_number(var: str) -> Callable[[Any], Any]:
    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        try:
            return float(raw.strip())
        except ValueError:
            raise ValueError(f"{var}={raw.strip()!r} is not a number") from None
    return parse


def _listed(sort: bool) -> Callable[[Any], Any]:
    """A comma-separated list: items stripped, empty ones dropped (sorted and unique when `sort`)."""
    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        items = [item.strip() for item in raw.split(",") if item.strip()]
        return tuple(sorted(set(items))) if sort else tuple(items)
    return parse


def _body_bytes(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"GPUQ_API_MAX_BODY_BYTES={text!r} is not a number of bytes") from None
    if value < 1:
        raise ValueError(f"GPUQ_API_MAX_BODY_BYTES={text!r}: the body cap must be at least 1 byte")
    return value


def _replicas(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if not text.isdigit() or not 1 <= int(text) <= 5:
        raise ValueError(f"GPUQ_STREAM_REPLICAS={raw!r} must be a whole number from 1 to 5 (3 on a NATS cluster of 3 "
                         "servers or more, 1 on a single server)")
    return int(text)


def _gc_freeze(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"GPUQ_GC_FREEZE must be 1 or 0 (on or off), not {raw!r}")


def _namespace(raw: Any) -> Any:
    return namespaces.validate(raw) if isinstance(raw, str) else raw


def _port(var: str) -> Callable[[Any], Any]:
    def parse(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        try:
            return int(raw.strip())
        except ValueError:
            raise ValueError(f"{var} must be a port number, not {raw!r}") from None
    return parse


def _v(parse: Callable[[Any], Any]) -> BeforeValidator:
    return BeforeValidator(parse)


Seconds = float
Items = Annotated[tuple[str, ...], NoDecode]


class Settings(BaseModel):
    """The GPUQ_* variables. Field `lease_ttl_s` is variable `GPUQ_LEASE_TTL_S`; descriptions are the docs'."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # The platform and the process
    namespace: Annotated[str, _v(_namespace)] = Field(
        "gpuq", description="The platform's namespace: subjects, stream names, Postgres schemas and leases carry it. "
                            "1-32 characters: a lower-case letter, then lower-case letters, digits or '-'.")
    home: Path = Field(Path(".gpuq"), description="The local state directory of `gpuq up`/`gpuq demo` (embedded "
                                                  "servers' data, the laptop's secrets key).")
    instance: str = Field("0", description="This process's name in its events' source (`gpuq/<service>/<instance>`); "
                                           "`gpuq up --instance`.")
    bind: str = Field("127.0.0.1", description="Address the API, /metrics and the health endpoints listen on "
                                               "(`gpuq up --bind`); 0.0.0.0 in a container.")
    health_addr: str = Field("", description="Address of /healthz and /readyz; empty: GPUQ_BIND's.")
    health_port: Annotated[int, _v(_port("GPUQ_HEALTH_PORT"))] = Field(
        8080, ge=0, le=65535, description="Port of /healthz and /readyz; 0: none.")
    api_port: Annotated[int, _v(_port("GPUQ_API_PORT"))] = Field(
        8000, ge=0, le=65535, description="Port of the API service (HTTP).")
    admission_cohorts: Annotated[Items, _v(_listed(sort=True))] = Field(
        (), description="Comma-separated cohorts this admission instance serves ('-': queues without a cohort); "
                        "empty: all.")
    eta_range_method: Annotated[str, _v(_choice("GPUQ_ETA_RANGE_METHOD", ("replays", "calibrated")))] = Field(
        "replays", description="How the admission service's ETA makes its p10-p90 range: replays (two more replays "
                               "a refresh, durations at their p10 and p90, calibrated) or calibrated (the median "
                               "replay alone, the range from the quantiles of the start errors seen so far: a third "
                               "of the work; docs/simulator.md).")
    trace_exporter: str = Field("none", description="Where spans go: none, console or otlp.")
    gc_freeze: Annotated[bool, _v(_gc_freeze)] = Field(
        True, description="1: survivors of a collection are frozen out of later ones (shared/gcpolicy.py); 0: "
                          "CPython's default collector.")
    gc_thaw_s: Annotated[Seconds, _v(_seconds(
        "GPUQ_GC_THAW_S", check=lambda v: v >= 0,
        number_msg="{var} must be a number of seconds (0: never), not {raw!r}",
        refusal="{var} must be 0 (never) or a positive number of seconds, not {raw!r}"))] = Field(
        600.0, ge=0, description="Seconds between thaws of the frozen objects (one full collection); 0: never.")

    # Plumbing: bus, outbox/inbox, leases
    stream_max_bytes: str = Field(
        "", description="Per-stream byte limits, `JOBS=64Gi,AUDIT=8Gi` (stream suffixes; sizes with k, Ki, M, Mi, G, "
                        "Gi, T, Ti); unset streams keep their defaults (shared/bus.py).")
    stream_replicas: Annotated[int, _v(_replicas)] = Field(
        1, ge=1, le=5, description="Servers of a NATS cluster that keep each stream (3 survives the loss of one).")
    consumer_stall_s: Annotated[Seconds, _v(_seconds(
        "GPUQ_CONSUMER_STALL_S", check=lambda v: v > 0, refusal="{var}={raw!r} must be positive",
        number_msg="{var}={raw!r} is not a number of seconds"))] = Field(
        60.0, gt=0, description="Seconds without progress, messages waiting, before a consumer reports not ready.")
    plumbing_retention_s: Annotated[Seconds, _v(_seconds(
        "GPUQ_PLUMBING_RETENTION_S", check=lambda v: v >= 3600.0,
        refusal="{var}={raw!r} is below the 3600 s floor: the inbox must outlive every redelivery of an event",
        number_msg="{var}={raw!r} is not a number of seconds"))] = Field(
        7 * 86_400.0, ge=3600.0, description="Seconds published outbox rows and inbox rows are kept.")
    lease_ttl_s: Annotated[Seconds, _v(_seconds(
        "GPUQ_LEASE_TTL_S", check=lambda v: v >= 5,
        refusal="{var} must be at least 5 s (the watcher checks every 2 s), not {raw!r}"))] = Field(
        30.0, ge=5, description="Seconds a leader may stop answering before its lease lapses.")

    # Executors and liveness
    heartbeat_interval_s: Annotated[Seconds, _v(_seconds(
        "GPUQ_HEARTBEAT_INTERVAL_S", check=lambda v: v > 0, refusal="{var} must be positive, not {raw!r}"))] = Field(
        10.0, gt=0, description="Seconds between an executor's heartbeats.")
    heartbeat_timeout_s: Annotated[Seconds, _v(_seconds("GPUQ_HEARTBEAT_TIMEOUT_S"))] = Field(
        120.0, description="Seconds of the scheduler's clock without a heartbeat listing a job before it is lost.")
    runtime_grace_s: Annotated[Seconds, _v(_seconds("GPUQ_RUNTIME_GRACE_S"))] = Field(
        900.0, description="Seconds past a job's max_runtime_s before the scheduler declares it lost.")
    liveness_check_s: Annotated[Seconds, _v(_seconds("GPUQ_LIVENESS_CHECK_S"))] = Field(
        5.0, description="Seconds between the scheduler's liveness checks.")
    liveness_grace_s: Annotated[Seconds, _v(_seconds(
        "GPUQ_LIVENESS_GRACE_S", check=lambda v: v >= 0,
        refusal="{var} must not be negative, not {value}"))] = Field(
        10.0, ge=0, description="Seconds after the scheduler's (re)connection before it judges liveness.")
    sim_sample_interval_s: Annotated[Seconds, _v(_seconds(
        "GPUQ_SIM_SAMPLE_INTERVAL_S", check=lambda v: v > 0 and v != math.inf,
        refusal="{var} must be a positive number of seconds, not {raw!r}"))] = Field(
        1.0, gt=0, description="Wall seconds between the simulated executor's utilisation batches.")
    dcgm_prometheus_url: str | None = Field(
        None, description="The Prometheus that scrapes DCGM: set, real GPU samples replace the synthetic ones "
                          "(overrides cluster.yaml `dcgm.prometheus_url`).")
    dcgm_interval_s: str | None = Field(
        None, description="Seconds between DCGM queries (overrides cluster.yaml `dcgm.interval_s`; checked with it).")

    # The API
    api_max_body_bytes: Annotated[int, _v(_body_bytes)] = Field(
        8 * 1024 * 1024, ge=1, description="The largest request body the API reads, in bytes.")
    api_token_review: Annotated[bool, _v(_flag("GPUQ_API_TOKEN_REVIEW", "{var}={raw!r}: use true or false"))] = Field(
        False, description="Accept Kubernetes tokens (TokenReview) besides gpuq's own.")
    api_token_audiences: Annotated[Items, _v(_listed(sort=True))] = Field(
        (), description="Comma-separated audiences a reviewed token must be made for; empty: any.")
    api_admin_groups: Annotated[Items, _v(_listed(sort=True))] = Field(
        (), description="Comma-separated Kubernetes groups whose members are platform admins.")
    api_team_group_prefix: str = Field(
        "gpuq:team:", description="A reviewed token's user acts for team T through its group `<prefix>T`.")

    # Telemetry, metering, audit
    metrics_job_labels: Annotated[bool, _v(_flag(
        "GPUQ_METRICS_JOB_LABELS", "{var} must be true or false, not {text!r}"))] = Field(
        False, description="Export the per-job gauges (`gpuq_job_*`, labelled with job ids).")
    metering_raw_retention_days: Annotated[int, _v(_days(
        "GPUQ_METERING_RAW_RETENTION_DAYS", 3, "a raw sample must outlive the utilisation stream's two days, or a "
                                               "redelivered sample would be counted again"))] = Field(
        30, ge=0, description="Days raw GPU samples are kept (at least 3; 0: forever).")
    audit_retention_days: Annotated[int, _v(_days(
        "GPUQ_AUDIT_RETENTION_DAYS", 30, "the database keeps every audit record at least 30 days"))] = Field(
        400, ge=0, description="Days the audit trail is kept, dropped by whole months (at least 30; 0: forever).")
    secrets_key: str | None = Field(
        None, description="Fernet keys, comma-separated (the first encrypts, all decrypt) for the webhooks' signing "
                          "secrets.")
    secrets_key_file: Path | None = Field(
        None, description="A file holding GPUQ_SECRETS_KEY's value (a mounted Secret); unset: `$GPUQ_HOME/secrets.key`,"
                          " created on first use.")

    # Outgoing webhooks (telemetry)
    webhook_allow_cidrs: Annotated[Items, _v(_listed(sort=False))] = Field(
        (), description="Comma-separated networks webhook URLs may reach although private (the SSRF guard).")
    webhook_max_attempts: Annotated[float, _v(_webhook_number("GPUQ_WEBHOOK_MAX_ATTEMPTS"))] = Field(
        12, description="Attempts of a delivery before it is dead-lettered (at least 1).")
    webhook_retry_base_s: Annotated[Seconds, _v(_webhook_number("GPUQ_WEBHOOK_RETRY_BASE_S"))] = Field(
        10.0, description="Seconds after the first failed attempt (tripled after each, with jitter; above 0).")
    webhook_retry_cap_s: Annotated[Seconds, _v(_webhook_number("GPUQ_WEBHOOK_RETRY_CAP_S"))] = Field(
        6 * 3600.0, description="The longest wait between attempts, seconds (at least the base).")
    webhook_timeout_s: Annotated[Seconds, _v(_webhook_number("GPUQ_WEBHOOK_TIMEOUT_S"))] = Field(
        20.0, description="Each attempt's timeout, 15-30 s.")

    # The Kubernetes executor's admission webhook
    webhook_port: Annotated[int | None, _v(_port("GPUQ_WEBHOOK_PORT"))] = Field(
        None, ge=0, le=65535, description="Port of the admission webhook; unset: no webhook.")
    webhook_bind: str = Field("0.0.0.0", description="Address the admission webhook listens on.")
    webhook_service: str = Field("gpuq-webhook", description="The Service the webhook configurations name.")
    webhook_namespace: str = Field("gpuq-system", description="The namespace of that Service and its Secret.")
    webhook_secret: str = Field("gpuq-webhook-tls", description="The Secret holding the webhook's certificate.")
    webhook_configurations: Annotated[Items, _v(_listed(sort=False))] = Field(
        ("gpuq",), description="Comma-separated webhook configurations whose caBundle gpuq keeps current; set empty: "
                               "none (cert-manager's CA injector does it).")
    webhook_cert_dir: Path | None = Field(
        None, description="cert-manager's mounted tls.crt and tls.key; set, gpuq makes no certificate.")
    webhook_hosts: Annotated[Items, _v(_listed(sort=False))] = Field(
        (), description="Comma-separated extra names or addresses for the certificate.")
    webhook_trusted_users: Annotated[Items, _v(_listed(sort=False))] = Field(
        (), description="Comma-separated usernames (gpuq's own ServiceAccount) whose requests pass as they are.")
    webhook_renew_before_days: Annotated[float, _v(_webhook_number("GPUQ_WEBHOOK_RENEW_BEFORE_DAYS"))] = Field(
        30.0, description="Days before expiry the webhook's certificate is renewed.")

    # The CLI
    config: Path | None = Field(
        None, description="The CLI's config file; unset: `$XDG_CONFIG_HOME/gpuq/config.yaml`.")
    api_url: str | None = Field(None, description="The CLI works through this API (with GPUQ_TOKEN) instead of "
                                                  "the database.")
    token: str | None = Field(None, description="The CLI's API token (`gpuq_<id>.<secret>` or a Kubernetes token).")
    debug: Annotated[bool, _v(_flag("GPUQ_DEBUG", "{var} must be true or false, not {raw!r}"))] = Field(
        False, description="On an error, the CLI shows the traceback.")


class EnvSettings(BaseSettings, Settings):
    """The same settings as pydantic-settings reads them from the process's environment. `settings()` reads the
    same variables itself: pydantic-settings' sources take ~4 ms a read, where the model's validation alone takes
    ~0.1 ms, and the namespace is read on every subject built."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_unset(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v != "" or k in EMPTY_IS_A_VALUE} if isinstance(data, dict) else data

    @classmethod
    def settings_customise_sources(
            cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings  # the environment only: no .env file, no secrets directory


# Names in the source that are not settings: gpuq sets GPUQ_RESUME_FROM in a job's pods (its SDK reads it there);
# the others are identifiers, not variables (a stream name, constants, prefixes in documentation).
NOT_SETTINGS = frozenset({"GPUQ_RESUME_FROM", "GPUQ_JOBS", "GPUQ_COLUMNS", "GPUQ_PREFIX", "GPUQ_DCGM_",
                          "GPUQ_WEBHOOK_"})


def variables() -> dict[str, str]:
    """Variable name -> field name, for every setting."""
    return {_env(name): name for name in Settings.model_fields}


_VARIABLES = variables()
# Set but empty is unset (the default) but for these, where it means an empty list: the chart sets
# GPUQ_WEBHOOK_CONFIGURATIONS="" when cert-manager keeps the caBundles.
EMPTY_IS_A_VALUE = frozenset({"webhook_configurations"})


def settings(env: Mapping[str, str] | None = None) -> Settings:
    """The settings from the environment (or `env`), read now. Raises SettingsError naming the variable."""
    env = os.environ if env is None else env
    given = {name: env[var] for var, name in _VARIABLES.items()
             if var in env and (env[var] != "" or name in EMPTY_IS_A_VALUE)}
    try:
        return Settings.model_validate(given)
    except ValidationError as exc:
        raise _one_error(exc, given) from None


def _one_error(exc: ValidationError, given: Mapping[str, str]) -> ValueError:
    error = exc.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ValueError):  # our parsers' own words, which name the variable already
        return cause if type(cause) is not ValueError else SettingsError(str(cause))
    name = str(error["loc"][0]) if error["loc"] else ""
    return SettingsError(f"{_env(name)}={given.get(name, error.get('input'))!r}: {error['msg']}")


def table() -> str:
    """The Markdown table of docs/settings.md."""
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for var, name in variables().items():
        field = Settings.model_fields[name]
        default = field.default
        if isinstance(default, tuple):
            default = ",".join(default)
        shown = "(unset)" if default is None or default == "" else f"`{default}`"
        kind = _type_name(field.annotation) + _bounds(field.metadata)
        rows.append(f"| `{var}` | {kind} | {shown} | {field.description} |")
    return "\n".join(rows) + "\n"


def _bounds(metadata: list[Any]) -> str:
    """`Field(ge=5, le=65535)` -> ", >= 5, <= 65535"."""
    marks = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return "".join(f", {sign} {getattr(m, key):g}" for m in metadata for key, sign in marks.items()
                   if getattr(m, key, None) is not None)


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("pathlib.", "")
    if "tuple" in text:
        return "list (comma-separated)"
    for name in ("bool", "int", "float", "Path", "str"):
        if name in text:
            return ("path" if name == "Path" else name) + (" (optional)" if "None" in text else "")
    return text


DOC_HEAD = """# Settings

Every `GPUQ_*` environment variable of the services and the CLI, as `shared/settings.py` declares it. Generated
by `python -m shared.settings > docs/settings.md`; `tests/unit/contracts/test_settings.py` checks this page against
the module. Unset or empty means the default (but an empty `GPUQ_WEBHOOK_CONFIGURATIONS` is none). A value that is
not one stops the service with one line naming the variable. The connection URLs keep their usual names:
`NATS_URL`, `DATABASE_URL` (and `KUBECONFIG` for the Kubernetes executor). The CLI reads its own variables
(`GPUQ_CONFIG`, `GPUQ_DEBUG`, `GPUQ_API_URL`, `GPUQ_TOKEN`, `GPUQ_HOME`) itself, declared here all the same: its
start-up does not load pydantic-settings. `gpuq up`'s options read `GPUQ_BIND`, `GPUQ_HEALTH_ADDR`, `GPUQ_HEALTH_PORT`,
`GPUQ_INSTANCE`, `GPUQ_API_PORT`, `GPUQ_ADMISSION_COHORTS` and `GPUQ_METRICS_JOB_LABELS` as their defaults.

"""


def document() -> str:
    return DOC_HEAD + table()


if __name__ == "__main__":
    print(document(), end="")
