"""Server configuration: defaults < config file < environment < command-line flags.

One flat key space: the server's own keys (SERVER_FIELDS), every EngineConfig field (so a new
engine option is configurable everywhere without touching this file) and `method_options`.
Deployment guides use other words for some of them; ALIASES maps those onto ours. Unknown
keys are errors; every error names the key, the value and where it came from.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from leapfrog.config import DEFAULT_MODEL, EngineConfig, packaged_gguf
from leapfrog.sampling_params import BOUNDS as SAMPLING_BOUNDS
from leapfrog.sampling_params import DEFAULT_MAX_TOKENS

# Deployment-guide vocabulary -> our keys. CACHE_SIZE is a token count ("4096"), or a byte
# size with a unit ("512MiB", "2GB"), which then sets kv_cache_bytes instead.
ALIASES = {
    "max_seq_len": "max_model_len",
    "batch_size": "max_batch_size",
    "cache_size": "kv_cache_tokens",
    "max_tokens": "default_max_tokens",
    "temperature": "default_temperature",
    # DeepSpeed-style keys (the couplet guide's hybrid-parallel configuration), nested in a file
    # as {"tensor_parallel": {"tp_size": 2}, "pipeline": {"pipeline_parallel_size": 2}}. The
    # per-GPU micro-batch is what one engine step holds.
    "tensor_parallel.tp_size": "tensor_parallel_size",
    "pipeline.pipeline_parallel_size": "pipeline_parallel_size",
    "train_micro_batch_size_per_gpu": "max_batch_size",
}
BARE_ENV = ("CACHE_SIZE", "MAX_TOKENS", "BATCH_SIZE", "TEMPERATURE")   # read without a prefix
ENV_PREFIX = "LEAPFROG_"
# What `leapfrog serve` serves when no model is named: the stories model (the default of every
# request that names none), the couplet model behind the couplet page, and SmolLM2, the real
# chat model (when its package is installed).
DEFAULT_SERVED = (DEFAULT_MODEL, "couplets", "smollm2")


def default_served() -> list[str]:
    """DEFAULT_SERVED, less a packaged model whose package is not installed."""
    served = []
    for name in DEFAULT_SERVED:
        try:
            packaged_gguf(name)
        except FileNotFoundError:
            continue
        served.append(name)
    return served


@dataclass(slots=True)
class ServerConfig:
    # model
    model: str = DEFAULT_MODEL                 # the first served model: requests naming none get it
    models: list = field(default_factory=list)  # every served model (--model repeated); [] = [model]
    method: str | None = None                  # default: the model's best lossless method
    draft_model: str | None = None
    served_model_name: str | None = None       # the `model` clients send; default: `model`
    method_options: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)  # EngineConfig fields that were set
    # HTTP
    host: str = "0.0.0.0"                      # all interfaces: the server is meant for containers
    port: int = 8080
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    log_level: str = "info"
    # request defaults
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    default_temperature: float | None = None   # None: the model's generation_config.json, else 1.0
    max_n: int = 16                            # most choices one request may ask for
    # protection
    max_queue_size: int = 256                  # requests beyond the batch before 429
    max_queue_wait_s: float = 10.0             # expected queue wait past which a request gets 429
    max_couplets_in_flight: int = 24           # couplets written at once per model; the rest wait in line
    max_couplet_wait_s: float = 10.0           # expected wait in the couplet line past which a couplet gets 429
    header_timeout: float = 10.0               # seconds a connection may take to send a request's headers
    max_body_bytes: int = 4 << 20              # larger request bodies get 413 before being read
    request_timeout: float = 600.0             # seconds; 0 = none
    rate_limit: float = 0.0                    # requests/s per client (API key or address); 0 = off
    rate_limit_burst: int = 0                  # bucket size; 0 = max(1, 2 x rate_limit)
    api_key: list = field(default_factory=list)
    api_key_file: str | None = None
    jwt_secret: str | None = None              # HS256 bearer tokens
    cors_allow_origins: list = field(default_factory=list)   # [] = no CORS headers (browsers: same origin only)
    fault_injection: bool = False              # POST /admin/fault: crash an engine on purpose (chaos tests)
    # batch jobs (serve/batches.py): files and batches in SQLite under batch_dir (not "data_dir":
    # LEAPFROG_DATA_DIR already names the training data's folder)
    batch_dir: str | None = None               # None: $XDG_CACHE_HOME/leapfrog/batches (~/.cache/...)
    max_file_bytes: int = 64 << 20             # largest batch input file; larger gets 413
    max_files: int = 100                       # files one API key may keep
    max_batch_lines: int = 50_000              # lines in one batch input file
    # lifecycle
    warmup_requests: int = 3
    shutdown_timeout: float = 30.0             # seconds to finish in-flight requests

    def engine_kwargs(self) -> dict:
        # deferred: methods loads only when engine options are built
        from leapfrog.methods import default_method
        return dict(method=self.method or default_method(self.model), draft_model=self.draft_model,
                    **self.engine, **self.method_options)

    @property
    def model_id(self) -> str:
        return self.served_model_name or Path(self.model).name or str(self.model)

    def views(self) -> list["ServerConfig"]:
        """One single-model configuration per served model. The first model takes `method`,
        `draft_model`, `method_options` and `served_model_name`; the others decode with their
        own defaults (leapfrog.json) under their own names. Engine and server keys apply to all."""
        served = self.models or [self.model]
        return [replace(self, model=m, models=[m]) if i == 0 else
                replace(self, model=m, models=[m], method=None, draft_model=None, method_options={},
                        served_model_name=None)
                for i, m in enumerate(served)]


HELP = {
    "model": f"checkpoint folder or built-in model name; repeat to serve several, each with its own "
             f"engine, routed by the requests' `model` (default: {', '.join(DEFAULT_SERVED)}, the last when its "
             "package is installed)",
    "models": "the served models (a list; the command line repeats --model instead)",
    "method": "decoding method: ar, dflash, dspark, draft, diffusion (default: the model's best lossless one)",
    "draft_model": ("drafter checkpoint folder for speculative methods; for method draft, a small AR model "
                    "sharing the tokenizer (e.g. stories)"),
    "served_model_name": "model id clients send and /v1/models lists (default: --model)",
    "chat_template": "chat template instead of the model's, for every served model: a file, or the Jinja text",
    "host": "address to bind (default 0.0.0.0: all interfaces; use 127.0.0.1 for local only)",
    "port": "port (default 8080)",
    "ssl_certfile": "TLS certificate (PEM); with --ssl-keyfile serves HTTPS",
    "ssl_keyfile": "TLS private key (PEM)",
    "log_level": "critical, error, warning, info (default), debug, trace",
    "default_max_tokens": "max_tokens for requests that give none (default 256; guide name MAX_TOKENS)",
    "default_temperature": "temperature for requests that give none (default: the model's generation_config.json, else 1.0; guide name TEMPERATURE)",
    "max_n": "most choices (n) one request may ask for (default 16)",
    "max_body_bytes": "largest request body accepted, in bytes (default 4 MiB; larger gets 413)",
    "max_queue_size": "requests allowed to wait beyond the running batch before 429 (default 256)",
    "max_queue_wait_s": "a request whose expected wait in the queue (its place over the measured rate at which "
                        "the full batch finishes requests) is longer gets 429 with that wait as Retry-After "
                        "(default 10)",
    "max_couplets_in_flight": "couplets (POST /couplet) written at once per model; the others wait in a "
                              "first-come line (default 24)",
    "max_couplet_wait_s": "a couplet whose expected wait in line (its place over the measured couplets a "
                          "second) is longer gets 429 with that wait as Retry-After (default 10)",
    "header_timeout": "seconds a connection may take to send a request's headers before it is closed "
                      "(slow clients holding connections open; default 10; 0 = no limit)",
    "request_timeout": "seconds before a request is aborted with 504; 0 = never (default 600)",
    "rate_limit": "requests/s per client (API key, token subject or address); 0 = off (default)",
    "rate_limit_burst": "token-bucket size per client (default 2 x rate_limit)",
    "api_key": "accepted API key (repeatable; env: comma-separated)",
    "api_key_file": "file of accepted API keys, one per line",
    "jwt_secret": "accept HS256 JWT bearer tokens signed with this secret",
    "cors_allow_origins": "origins a browser page may call the API from (repeatable; '*' for any); "
                          "default none: no CORS headers",
    "fault_injection": "add POST /admin/fault, which crashes an engine on purpose so that recovery can be "
                       "measured (leapfrog bench --suite reliability); never in production (default off)",
    "batch_dir": "folder of the batch jobs' SQLite store (files, batches and each line's result); default "
                "~/.cache/leapfrog/batches",
    "max_file_bytes": "largest file POST /v1/files accepts, in bytes (default 64 MiB; larger gets 413)",
    "max_files": "files one API key may keep on the server (default 100)",
    "max_batch_lines": "most lines in one batch's input file (default 50000)",
    "warmup_requests": "warm-up requests (different lengths) before /ready turns true (default 3)",
    "shutdown_timeout": "seconds to finish in-flight requests on SIGTERM (default 30)",
    "max_batch_size": "most sequences in one step (guide names BATCH_SIZE, batch_size)",
    "max_model_len": "context length (guide name max_seq_len; default: the model's)",
    "kv_cache_tokens": "KV-cache size in tokens (guide name CACHE_SIZE; '2GiB' sets bytes instead)",
    "tensor_parallel_size": "split each layer over this many ranks, started here (torchrun for several nodes; "
                            "config-file name tensor_parallel.tp_size)",
    "pipeline_parallel_size": "cut the layers into this many stages, one rank group each, started here "
                              "(config-file name pipeline.pipeline_parallel_size)",
}

_SERVER_TYPES = {f.name: f.type for f in fields(ServerConfig) if f.name != "engine"}
_ENGINE_TYPES = {f.name: f.type for f in fields(EngineConfig)}
KEYS = {**_ENGINE_TYPES, **_SERVER_TYPES}


class ConfigError(ValueError):
    pass


# --- parsing one value ---------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _as_bool(value: Any, from_text: bool) -> bool:
    if from_text and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, bool):
        return value
    raise ValueError("expected true or false")


def _as_int(value: Any, from_text: bool) -> int:
    if from_text and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError("expected an integer")


def _as_float(value: Any, from_text: bool) -> float:
    if from_text:
        try:
            return float(value)
        except ValueError:
            raise ValueError("expected a number") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError("expected a number")


def _as_list(value: Any, from_text: bool) -> list:
    if isinstance(value, str):             # env, or a single key in a file
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ValueError("expected a list of strings")


def _as_dict(value: Any, from_text: bool) -> dict:
    if from_text:
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError("expected a JSON object") from None
    if isinstance(value, dict):
        return value
    raise ValueError("expected a mapping")


def _as_str(value: Any, from_text: bool) -> str:
    if isinstance(value, str):
        return value
    raise ValueError("expected a string")


_PARSERS = {"bool": _as_bool, "int": _as_int, "float": _as_float, "list": _as_list, "dict": _as_dict}


def _coerce(key: str, value: Any, source: str) -> Any:
    """Check (file/JSON values) or parse (environment strings) one value by its key's type."""
    kind = KEYS[key]
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{source}: {key}=None: must not be empty")
    from_text = isinstance(value, str) and source.startswith("env")
    parse = _PARSERS.get(kind.replace(" | None", ""), _as_str)
    try:
        return parse(value, from_text)
    except ValueError as exc:
        raise ConfigError(f"{source}: {key}={value!r}: {exc}") from None


def _canonical(key: str, value: Any, source: str) -> tuple[str, Any]:
    name = key.lower() if key.isupper() else key
    name = name.replace("-", "_")
    name = ALIASES.get(name, name)
    if name not in KEYS:
        close = difflib.get_close_matches(name, list(KEYS) + list(ALIASES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{source}: unknown key {key!r}{hint}")
    if name == "kv_cache_tokens" and isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2):
            if m.group(2).lower() not in _UNITS:
                raise ConfigError(f"{source}: {key}={value!r}: unknown size unit {m.group(2)!r}")
            return "kv_cache_bytes", int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if m and "." not in m.group(1):     # a count of tokens, typed (the flag takes text for the units)
            return name, _coerce(name, int(m.group(1)), source)
    return name, _coerce(name, value, source)


def _flatten(layer: dict) -> dict:
    """Sections of nested keys ({"pipeline": {"pipeline_parallel_size": 2}}) as dotted keys
    ("pipeline.pipeline_parallel_size"); a key whose value is a mapping by type (method_options)
    stays as it is."""
    out = {}
    for key, value in layer.items():
        if isinstance(value, dict) and str(key) not in KEYS:
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _merge_layer(layer: dict, out: dict, source: str) -> None:
    seen: dict[str, str] = {}
    for key, value in _flatten(layer).items():
        name, parsed = _canonical(str(key), value, source)
        if name in seen and out[name] != parsed:
            raise ConfigError(f"{source}: {key!r} and {seen[name]!r} both set {name} to different values")
        seen[name] = str(key)
        out[name] = parsed


# --- the three sources -----------------------------------------------------------------------
def read_file(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r}: cannot read it as UTF-8 text ({exc})") from None
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            # deferred: yaml loads only for a YAML config file
            import yaml
            data = yaml.safe_load(text) or {}
    except Exception as exc:
        raise ConfigError(f"config file {str(p)!r}: cannot parse: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping of keys to values")
    return data


def read_env(environ: dict[str, str]) -> dict:
    """LEAPFROG_<KEY> for every key and alias, plus the guides' bare names (BARE_ENV).
    Other LEAPFROG_* variables belong to other parts of leapfrog and are left alone."""
    names = set(KEYS) | set(ALIASES)
    out = {}
    for var, value in environ.items():
        if var.startswith(ENV_PREFIX) and var[len(ENV_PREFIX):].lower() in names:
            out[var[len(ENV_PREFIX):].lower()] = value
    for var in BARE_ENV:
        if var in environ and var.lower() not in out:
            out[var.lower()] = environ[var]
    return out


def build_config(flags: dict, environ: dict[str, str] | None = None) -> ServerConfig:
    """Merge defaults < file (--config or LEAPFROG_CONFIG) < environment < flags, and validate."""
    environ = dict(os.environ if environ is None else environ)
    flags = {k: v for k, v in flags.items() if v is not None}
    path = flags.pop("config", None) or environ.get(ENV_PREFIX + "CONFIG")
    merged: dict = {}
    if path:
        _merge_layer(read_file(path), merged, f"config file {path}")
    env_layer: dict = {}
    _merge_layer(read_env(environ), env_layer, "environment")
    _over(merged, env_layer)
    flag_layer: dict = {}
    _merge_layer(flags, flag_layer, "command line")
    if "method_options" in flag_layer:      # --option adds to the file's options
        flag_layer["method_options"] = {**merged.get("method_options", {}), **flag_layer["method_options"]}
    _over(merged, flag_layer)
    return _finish(merged)


# Keys that say the same thing two ways: a layer that sets one replaces the other below it.
SAME_SETTING = (("kv_cache_tokens", "kv_cache_bytes"),)


def _over(merged: dict, layer: dict) -> None:
    for pair in SAME_SETTING:
        if any(k in layer for k in pair):
            for k in pair:
                merged.pop(k, None)
    merged.update(layer)


def _served(merged: dict) -> None:
    """`models` and `model` made consistent: neither set serves DEFAULT_SERVED; `model` alone
    serves it alone; `models` alone serves those, the first as `model`."""
    models = merged.get("models")
    if models:
        if len(set(models)) != len(models):
            raise ConfigError(f"models={models!r}: a model is named twice")
        ids = [Path(str(m)).name or str(m) for m in models]     # each is served under its folder's name
        twice = next((i for i in ids if ids.count(i) > 1), None)
        if twice is not None:
            raise ConfigError(f"models={models!r}: two of them would be served as {twice!r}")
        if "model" in merged and merged["model"] != models[0]:
            raise ConfigError(f"model={merged['model']!r} and models={models!r} disagree: name the models once")
        merged["model"] = models[0]
    elif "model" in merged:
        merged["models"] = [merged["model"]]
    else:
        served = default_served()
        merged["model"], merged["models"] = served[0], served
    if len(merged["models"]) > 1 and merged.get("served_model_name"):
        raise ConfigError(f"served_model_name={merged['served_model_name']!r}: names one model, but "
                          f"{len(merged['models'])} are served (each is served under its own name)")


def _finish(merged: dict) -> ServerConfig:
    _served(merged)
    engine = {k: merged.pop(k) for k in list(merged) if k in _ENGINE_TYPES}
    # Engine options that are also EngineConfig fields may be passed in method_options by
    # mistake; hand them to the engine where they belong.
    cfg = ServerConfig(**merged, engine=engine)
    try:
        EngineConfig(**engine).validate()
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    _validate(cfg)
    return cfg


def _validate(cfg: ServerConfig) -> None:
    def check(key: str, ok: bool, why: str) -> None:
        if not ok:
            raise ConfigError(f"{key}={getattr(cfg, key)!r}: {why}")
    check("port", 0 <= cfg.port <= 65535, "must be in [0, 65535]")
    if cfg.method is not None:
        # deferred: the method table, without the methods' own modules
        from leapfrog.methods import METHODS
        hint = difflib.get_close_matches(str(cfg.method), list(METHODS), n=1)
        check("method", cfg.method in METHODS, f"expected one of {', '.join(sorted(METHODS))}"
              + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    check("log_level", cfg.log_level in ("critical", "error", "warning", "info", "debug", "trace"),
          "expected critical, error, warning, info, debug or trace")
    check("default_max_tokens", SAMPLING_BOUNDS["max_tokens"].holds(cfg.default_max_tokens),
          SAMPLING_BOUNDS["max_tokens"].text)
    for key in ("max_n", "max_body_bytes", "max_couplets_in_flight", "max_file_bytes", "max_files", "max_batch_lines"):
        check(key, getattr(cfg, key) >= 1, "must be >= 1")
    for key in ("max_queue_size", "rate_limit_burst", "warmup_requests"):
        check(key, getattr(cfg, key) >= 0, "must be >= 0")
    for key in ("request_timeout", "rate_limit", "shutdown_timeout", "max_queue_wait_s", "max_couplet_wait_s",
                "header_timeout"):
        check(key, getattr(cfg, key) >= 0, "must be >= 0")
    check("default_temperature", cfg.default_temperature is None or SAMPLING_BOUNDS["temperature"].holds(cfg.default_temperature),
          SAMPLING_BOUNDS["temperature"].text)
    check("ssl_keyfile", bool(cfg.ssl_keyfile) == bool(cfg.ssl_certfile),
          "ssl_certfile and ssl_keyfile must be given together")
    for key in ("ssl_certfile", "ssl_keyfile", "api_key_file"):
        check(key, getattr(cfg, key) is None or Path(getattr(cfg, key)).is_file(), "file not found")
    if cfg.ssl_certfile and cfg.ssl_keyfile:      # loaded once here, so a file that is not one fails now
        # deferred: ssl loads only for a server configured with TLS
        import ssl
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise ConfigError(f"ssl_certfile={cfg.ssl_certfile!r}, ssl_keyfile={cfg.ssl_keyfile!r}: not a "
                              f"certificate and its private key in PEM ({exc})") from None


# --- command line ----------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per key, all defaulting to None so that build_config sees only what was typed."""
    p.add_argument("--config", help="YAML or JSON config file (env LEAPFROG_CONFIG)")
    p.add_argument("--option", action="append", default=None, metavar="KEY=VALUE",
                   help="decoding-method option KEY=VALUE, value parsed as JSON when it can be (repeatable)")
    for key, kind in KEYS.items():
        if key in ("method_options", "models"):
            continue                        # --option; --model repeated
        if key == "model":
            p.add_argument("--model", action="append", default=None, help=f"{HELP['model']} (env "
                           f"{ENV_PREFIX}MODEL; several: {ENV_PREFIX}MODELS=a,b)")
            continue
        flag = "--" + key.replace("_", "-")
        base = kind.replace(" | None", "")
        help_text = f"{HELP.get(key, 'engine option')} (env {ENV_PREFIX}{key.upper()})"
        if base == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif base == "list":
            p.add_argument(flag, action="append", default=None, help=help_text + " (repeatable)")
        else:
            typ = {"int": int, "float": float}.get(base, str)
            if key == "kv_cache_tokens":     # a count, or a size with its unit ("2GiB")
                typ = str
            p.add_argument(flag, type=typ, default=None, help=help_text)


def flags_from_args(args: argparse.Namespace) -> dict:
    # deferred: options loads only when flags are read
    from leapfrog.options import parse_options
    flags = {k: v for k, v in vars(args).items() if k in KEYS or k == "config"}
    models = flags.pop("model", None)
    if models:
        flags["model" if len(models) == 1 else "models"] = models[0] if len(models) == 1 else models
    if args.option:
        try:
            flags["method_options"] = parse_options(args.option)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return flags
