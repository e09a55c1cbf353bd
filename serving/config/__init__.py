"""The app's configuration: one pydantic model, loaded from YAML plus `KVRELAY_*` env overrides.

    model, engine (EngineConfig,  ─▶ every worker's EngineConfig (engine_config(pool)): the shared
    serving defaults) + a pool's     `engine`, then the pool's own `engine` keys over it
    own engine keys
    mode, min_remote_prefill_tokens ─▶ how the ingress routes a request
    prefill / decode / worker pools ─▶ Serve deployments (replicas, CPUs, torch threads)
    http, api_keys, kv_transfer ─▶ the proxy, the ingress, the KVTransfer actors
    api ─▶ the ingress: what one request may ask for (limits, chat template kwargs, context budget)
    degradation ─▶ the ingress, when a pool refuses a request (fallback app, shedding)

Env overrides name a field path with `__` between levels, after the `KVRELAY_` prefix:
`KVRELAY_MODE=colocated`, `KVRELAY_HTTP__PORT=8001`, `KVRELAY_DECODE__NUM_REPLICAS=2`,
`KVRELAY_API_KEYS=key1,key2`. Values are parsed as YAML scalars (so `2`, `true`, `[a, b]`).
Unknown keys, in the file or the environment, are errors that name the key and where it came from;
a key that moved (the engine's settings moved under `engine:`) names its new path.

The engine's settings are EngineConfig's (serving/engine/config.py), declared once there. Where
serving wants another default than the engine alone, it is set in SERVING_ENGINE_DEFAULTS below,
the one place.
"""

from serving.config.api_limits import APIConfig, ContextBudgetConfig
from serving.config.loading import (
    NON_CONFIG_ENV,
    ConfigError,
    apply_overrides,
    format_validation_error,
    load_config,
    parse_set_items,
)
from serving.config.sections import (
    MOVED_KEYS,
    SERVING_ENGINE_DEFAULTS,
    DegradationConfig,
    EngineOverrides,
    EngineSettings,
    FallbackConfig,
    HTTPConfig,
    IngressConfig,
    KVTransferConfig,
    PoolConfig,
    RayConfig,
    RoutingConfig,
)
from serving.config.serve_config import ENV_PREFIX, ServeConfig
from serving.engine.config_file import FieldError, read_yaml_mapping, validate_model

__all__ = [
    "ENV_PREFIX", "MOVED_KEYS", "NON_CONFIG_ENV", "SERVING_ENGINE_DEFAULTS", "APIConfig", "ConfigError", "ContextBudgetConfig", "DegradationConfig",
    "EngineOverrides", "EngineSettings", "FallbackConfig", "HTTPConfig", "IngressConfig", "KVTransferConfig", "PoolConfig",
    "RayConfig", "RoutingConfig", "ServeConfig", "apply_overrides", "format_validation_error", "load_config",
    "parse_set_items", "FieldError", "read_yaml_mapping", "validate_model",
]
