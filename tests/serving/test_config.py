"""ServeConfig loading: file < overrides < env, and errors that name the source, field and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serving.config import SERVING_ENGINE_DEFAULTS, ConfigError, ServeConfig, load_config
from serving.engine.config import EngineConfig
from tests.helpers import REPO


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvrelay.yaml"
    path.write_text(text)
    return path


def test_defaults_without_file():
    config = load_config(env={})
    assert config == ServeConfig()
    assert config.mode == "disaggregated"
    assert config.model_name == "smollm2-135m-instruct"
    assert config.kv_transfer.lease_s == 30.0


def test_file_then_overrides_then_env(tmp_path):
    path = write(tmp_path, "mode: colocated\nhttp:\n  port: 9000\ndecode:\n  num_replicas: 2\n")
    config = load_config(path, overrides={"http.port": 9001}, env={"KVRELAY_DECODE__NUM_REPLICAS": "3"})
    assert config.mode == "colocated"
    assert config.http.port == 9001
    assert config.decode.num_replicas == 3
    assert config.prefill.num_replicas == 1


def test_env_api_keys_comma_list_and_non_config_vars_ignored():
    config = load_config(env={"KVRELAY_API_KEYS": "k1, k2", "KVRELAY_CACHE_DIR": "/tmp/x", "OTHER": "1"})
    assert [(k.hint, k.is_admin, k.tier) for k in config.api_keys] == [("...", False, "default"), ("...", False, "default")]
    assert config.admin_api_keys == []


def test_unknown_key_in_file_is_named_with_the_file(tmp_path):
    path = write(tmp_path, "mode: colocated\ndecode:\n  num_replica: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert message.startswith(f"{path}: invalid configuration")
    assert "decode.num_replica = 2: unknown key; remove it or fix its spelling" in message


def test_unknown_env_key_is_named_with_the_variable():
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVRELAY_MODEL_NAME": "x"})
    assert "(with env KVRELAY_MODEL_NAME)" in str(info.value)
    assert "model_name = 'x': unknown key" in str(info.value)


def test_bad_value_names_field_value_and_range(tmp_path):
    path = write(tmp_path, "kv_transfer:\n  lease_s: -1\nprefill:\n  engine: {num_threads: 0}\nengine:\n  max_num_seqs: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "kv_transfer.lease_s = -1: Input should be greater than 0" in message
    assert "prefill.engine.num_threads = 0: Input should be greater than or equal to 1" in message
    assert "engine.max_num_seqs = 0: Input should be greater than or equal to 1" in message


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "mode: [unclosed\n"), env={})
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), env={})
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "missing.yaml", env={})


def test_engine_config_per_pool():
    config = ServeConfig.model_validate({
        "model": "m", "engine": {"kv_cache_bytes": 2**26, "dtype": "float32"}, "decode": {"engine": {"num_threads": 2}},
    })
    engine = config.engine_config(config.decode)
    assert (engine.model, engine.kv_cache_bytes, engine.dtype, engine.num_threads) == ("m", 2**26, "float32", 2)
    assert config.engine_config(config.prefill).num_threads == 1
    # Serving's defaults where they differ from the engine's, and the engine's elsewhere.
    assert config.engine.kv_cache_memory_fraction == SERVING_ENGINE_DEFAULTS["kv_cache_memory_fraction"] == 0.05
    assert EngineConfig().kv_cache_memory_fraction == 0.1
    assert config.engine.max_num_seqs == EngineConfig().max_num_seqs == 128
    # A dumped config (the dashboard's copy, Helm's args) loads back to the same config: a pool's
    # engine keys left unset are not written.
    dumped = config.model_dump(mode="json")
    assert dumped["decode"]["engine"] == {"num_threads": 2} and dumped["prefill"]["engine"] == {}
    assert ServeConfig.model_validate(dumped) == config


@pytest.mark.parametrize(("source", "given", "moved", "new", "variable"), [
    ("file", "dtype: float32\n", "dtype", "engine.dtype", "KVRELAY_ENGINE__DTYPE"),
    ("file", "decode:\n  num_threads: 2\n", "decode.num_threads", "decode.engine.num_threads", "KVRELAY_DECODE__ENGINE__NUM_THREADS"),
    ("env", "KVRELAY_KV_CACHE_BYTES", "kv_cache_bytes", "engine.kv_cache_bytes", "KVRELAY_ENGINE__KV_CACHE_BYTES"),
    ("overrides", "max_model_len", "max_model_len", "engine.max_model_len", "KVRELAY_ENGINE__MAX_MODEL_LEN"),
])
def test_a_moved_key_names_its_new_path(tmp_path, source, given, moved, new, variable):
    with pytest.raises(ConfigError) as info:
        if source == "file":
            load_config(write(tmp_path, given), env={})
        elif source == "env":
            load_config(env={given: "1024"})
        else:
            load_config(overrides={given: 1024}, env={})
    assert f"`{moved}` moved to `{new}` (env {variable})" in str(info.value)


def test_served_engines_keep_their_tighter_limits(tmp_path):
    """A replica's threads are always set (torch's default is every core, and replicas share the
    machine), and its context window holds a chat template."""
    path = write(tmp_path, "engine:\n  num_threads: null\n  max_model_len: 8\ndecode:\n  engine: {num_threads: 513}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "engine.num_threads = None: Input should be a valid integer" in message
    assert "engine.max_model_len = 8: Input should be greater than or equal to 16" in message
    assert "decode.engine.num_threads = 513: Input should be less than or equal to 512" in message
    # An engine alone may take torch's default and any window.
    assert EngineConfig(num_threads=None, max_model_len=8).num_threads is None


@pytest.mark.parametrize(("key", "value"), [("block_size", 32), ("dtype", "float32"), ("max_model_len", 512)])
def test_the_pools_that_hand_kv_over_agree_on_its_layout_and_the_context_window(key, value):
    with pytest.raises(ConfigError) as info:
        load_config(overrides={f"prefill.engine.{key}": value}, env={})
    decode = getattr(ServeConfig().engine_config(ServeConfig().decode), key)
    assert (f"prefill.engine.{key} = {value!r} but decode.engine.{key} = {decode!r}: the pools hand KV over, "
            "so they must agree; set it in `engine` for both") in str(info.value)
    config = load_config(overrides={f"engine.{key}": value}, env={})
    assert getattr(config.engine_config(config.prefill), key) == getattr(config.engine_config(config.decode), key) == value


def test_the_model_is_the_apps_not_the_engines():
    with pytest.raises(ConfigError, match="engine.model = 'x': the model is the app's; set the top-level `model`"):
        load_config(overrides={"engine.model": "x"}, env={})
    with pytest.raises(ConfigError, match="decode.engine.model = 'x': unknown key"):
        load_config(overrides={"decode.engine.model": "x"}, env={})


def test_shipped_configs_load():
    from serving.config.layout import auto_mode, node_cores

    local = load_config(REPO / "deploy/local.yaml", env={})
    # mode: auto, resolved on loading from this machine's cores
    assert (local.mode, local.http.port, local.engine.kv_cache_bytes) == (auto_mode(node_cores())[0], 8000, 256 * 2**20)
    assert local.engine_config(local.worker).num_threads == 2 and local.engine_config(local.decode).num_threads == 1
    serve_file = yaml.safe_load((REPO / "deploy/serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(serve_file)
    app = schema.applications[0]
    assert app.import_path == "serving.deployments.app:build_app"
    assert load_config(REPO / app.args["config"], env={}) == local


def test_mode_auto_splits_the_pools_from_four_cores(monkeypatch):
    from serving.config import layout

    for cores, mode in ((1, "colocated"), (2, "colocated"), (3, "colocated"), (4, "disaggregated"), (64, "disaggregated")):
        monkeypatch.setattr(layout, "node_cores", lambda cores=cores: cores)
        monkeypatch.setattr("serving.config.serve_config.node_cores", lambda cores=cores: cores)
        assert ServeConfig(mode="auto").mode == mode
        assert load_config(overrides={"mode": "auto"}, env={}).mode == mode
    assert layout.auto_mode(2) == ("colocated", "mode auto: 2 cores, fewer than the 4 a split needs; one colocated "
                                                "engine (the `worker` pool) instead of two halves")
    assert ServeConfig(mode="auto").model_dump()["mode"] == "disaggregated"  # a loaded config names the mode that runs


def test_omp_wait_policy_is_passive_where_the_engine_fills_the_cores():
    from serving.config.layout import omp_wait_policy

    assert omp_wait_policy("auto", 2, [], cores=2) == "PASSIVE"  # one engine on both cores (make serve, 2 cores)
    assert omp_wait_policy("auto", 1, [[0], [1]], cores=2) is None  # one thread: no OpenMP team to wait
    assert omp_wait_policy("auto", 2, [[0, 1], [2, 3]], cores=4) == "PASSIVE"
    assert omp_wait_policy("auto", 4, [], cores=16) is None  # cores to spare for the serving processes
    assert omp_wait_policy("auto", None, [], cores=8) == "PASSIVE"  # torch's default: every core
    assert omp_wait_policy("active", 2, [], cores=2) == "ACTIVE"
    assert omp_wait_policy("passive", 1, [], cores=64) == "PASSIVE"
    # vLLM's EngineCore spin-waits for its worker: passive threads would hand it the cores
    assert omp_wait_policy("auto", 2, [], cores=2, backend="vllm") is None
    assert omp_wait_policy("passive", 2, [], cores=2, backend="vllm") == "PASSIVE"  # an operator's choice stands


def test_build_app_puts_the_wait_policy_in_the_worker_env(monkeypatch):
    from serving.deployments.app import build_app

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr("serving.deployments.app.node_cores", lambda: 2)
    app = build_app(ServeConfig(mode="colocated", worker={"engine": {"num_threads": 2}}))
    worker = app._bound_deployment.init_args[2]  # OpenAIIngress(config, prefill, decode)
    assert worker._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]["OMP_WAIT_POLICY"] == "PASSIVE"
    app = build_app(ServeConfig(mode="colocated", worker={"engine": {"num_threads": 1}}))
    worker = app._bound_deployment.init_args[2]
    assert "OMP_WAIT_POLICY" not in worker._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]
    app = build_app(ServeConfig(mode="colocated", engine={"backend": "vllm"}, worker={"engine": {"num_threads": 2}}))
    worker = app._bound_deployment.init_args[2]
    assert "OMP_WAIT_POLICY" not in worker._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]


def test_build_app_lets_replicas_take_worker_calls_larger_than_grpcs_default():
    from serving.deployments.app import build_app, replica_grpc_message_bytes

    assert replica_grpc_message_bytes(ServeConfig()) == 64 * 2**20  # 4 x the 8 MiB body is 32 MiB
    assert replica_grpc_message_bytes(ServeConfig(max_request_body_bytes=100 * 2**20)) == 400 * 2**20
    assert replica_grpc_message_bytes(ServeConfig(max_request_body_bytes=2**30)) == 2**31 - 1  # gRPC's most
    app = build_app(ServeConfig(mode="colocated", max_request_body_bytes=20 * 2**20))
    worker = app._bound_deployment.init_args[2]
    for deployment in (app._bound_deployment, worker._bound_deployment):
        env = deployment.ray_actor_options["runtime_env"]["env_vars"]
        assert env["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == str(80 * 2**20)


def test_the_ingress_reaches_the_pools_over_grpc_unless_turned_off():
    from serving.deployments.replicas import _transport

    class Handle:
        def options(self, **options):
            return options

    assert _transport(Handle(), ServeConfig()) == {"_by_reference": False}
    handle = Handle()
    assert _transport(handle, ServeConfig(ray={"grpc_transport": False})) is handle
    assert _transport(None, ServeConfig()) is None  # colocated: no prefill pool


def test_build_app_bounds_the_ingress_queue_and_the_proxy_refuses_beyond_it_with_429():
    from ray.serve.config import BackpressureConfig

    from serving.deployments.app import build_app

    ingress = build_app(ServeConfig(mode="colocated", ingress={"max_queued_requests": 7}))._bound_deployment
    assert (ingress.name, ingress.max_queued_requests) == ("OpenAIIngress", 7)
    assert ingress.backpressure_config == BackpressureConfig(status_code=429, retry_after_s=1)
    assert build_app(ServeConfig())._bound_deployment.max_queued_requests == 256


def test_build_app_from_serve_args():
    from serving.deployments.app import build_app, config_from_args

    config = config_from_args({"config": str(REPO / "deploy/local.yaml"), "mode": "colocated"})
    assert config.mode == "colocated"
    app = build_app({"config": str(REPO / "deploy/local.yaml")})
    assert type(app).__name__ == "Application"


def test_node_cores_honours_a_cgroup_cpu_quota(tmp_path):
    import os

    from serving.config.layout import node_cores

    affinity = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("max 100000\n")
    assert node_cores(str(quota)) == affinity
    quota.write_text("50000 100000\n")  # half a core: at least one
    assert node_cores(str(quota)) == 1
    quota.write_text(f"{(affinity + 8) * 100000} 100000\n")  # more than the mask: the mask
    assert node_cores(str(quota)) == affinity
    assert node_cores(str(tmp_path / "absent")) == affinity


def test_min_remote_prefill_tokens_is_a_count_or_auto():
    from pydantic import ValidationError

    assert ServeConfig(min_remote_prefill_tokens="auto").min_remote_prefill_tokens == "auto"
    assert ServeConfig(min_remote_prefill_tokens=256).min_remote_prefill_tokens == 256
    for bad in (-1, "sometimes"):
        with pytest.raises(ValidationError, match="min_remote_prefill_tokens"):
            ServeConfig(min_remote_prefill_tokens=bad)


def test_a_routing_parameter_of_the_wrong_type_names_the_section_and_the_fix(tmp_path):
    path = write(tmp_path, "routing:\n  prefill_params: {admission: 'off'}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "prefill_params: routing policy 'prefix_cost': admission must be bool, got 'off' (str)" in str(info.value)


def test_routing_params_are_typed_by_their_policy_and_dumped_as_written(tmp_path):
    path = write(tmp_path, "routing:\n  prefill_params: {max_load_ratio: null}\n  decode_policy: pow2\n"
                           "  decode_params: {seed: 3}\n")
    routing = load_config(path, env={}).routing
    assert (routing.prefill_params.max_load_ratio, routing.prefill_params.rate_spread) == (None, 2.0)
    assert (routing.decode_params.policy, routing.decode_params.seed) == ("pow2", 3)
    dumped = routing.model_dump(mode="json")
    assert (dumped["prefill_params"], dumped["decode_params"]) == ({"max_load_ratio": None}, {"seed": 3})
    assert ServeConfig().model_dump(mode="json")["routing"]["prefill_params"] == {}
    path = write(tmp_path, "routing:\n  decode_policy: round_robin\n  decode_params: {seed: 3}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "decode_params: routing policy 'round_robin': unknown parameter 'seed' (allowed: none)" in str(info.value)


def test_speculation_is_for_the_pools_that_decode():
    """`engine.speculative` reaches the decode and worker pools' engines, never the prefill pool's
    (it generates one token per request); setting it on the prefill pool is an error naming the fix."""
    config = load_config(overrides={"engine.speculative": {"num_speculative_tokens": 3}}, env={})
    assert config.engine_config(config.decode).speculative.num_speculative_tokens == 3
    assert config.engine_config("decode").speculative.num_speculative_tokens == 3
    assert config.engine_config(config.worker).speculative.num_speculative_tokens == 3
    assert config.engine_config(config.prefill).speculative is None
    assert config.engine_config("prefill").speculative is None
    decode_only = load_config(overrides={"decode.engine.speculative": {"method": "ngram"}}, env={})
    assert decode_only.engine_config("decode").speculative.num_speculative_tokens == 4
    assert decode_only.engine_config("worker").speculative is None
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"prefill.engine.speculative": {"method": "ngram"}}, env={})
    assert ("prefill.engine.speculative is set, but a prefill worker computes a prompt and its first token and "
            "never decodes, so it has nothing to speculate on; set `decode.engine.speculative` (disaggregated) or "
            "`worker.engine.speculative` (colocated), or `engine.speculative` for both") in str(info.value)


def test_a_pool_runs_vllm_with_typed_options_and_what_it_cannot_do_is_refused():
    config = ServeConfig.model_validate({"model": "m", "mode": "colocated", "worker": {"engine": {
        "backend": "vllm", "vllm": {"enforce_eager": False, "tensor_parallel_size": 2}}}})
    worker = config.engine_config("worker")
    assert worker.backend == "vllm" and (worker.vllm.enforce_eager, worker.vllm.tensor_parallel_size) == (False, 2)
    assert config.engine_config("prefill").backend == "kvrelay" and config.engine_config("worker").vllm.max_loras == 4
    with pytest.raises(ValueError, match=r"worker.engine.vllm.max_num_sequences\n  Extra inputs are not permitted"):
        ServeConfig.model_validate({"model": "m", "mode": "colocated", "worker": {"engine": {
            "backend": "vllm", "vllm": {"max_num_sequences": 4}}}})
    both = ServeConfig.model_validate({"model": "m", "mode": "disaggregated", "engine": {"backend": "vllm"}})
    assert both.engine_config("prefill").backend == both.engine_config("decode").backend == "vllm"
    with pytest.raises(ValueError) as info:
        ServeConfig.model_validate({"model": "m", "mode": "disaggregated", "decode": {"engine": {"backend": "vllm"}}})
    assert ("prefill.engine.backend = 'kvrelay' but decode.engine.backend = 'vllm': a KV hand-off stays within one "
            "engine's block layout; set `engine.backend` for both pools") in str(info.value)
    with pytest.raises(ValueError) as info:
        ServeConfig.model_validate({"model": "m", "mode": "disaggregated", "engine": {
            "backend": "vllm", "vllm": {"tensor_parallel_size": 2}}})
    assert ("prefill.engine.vllm.tensor_parallel_size = 2: a KV hand-off through kvrelay moves whole blocks from one "
            "rank; set it to 1 for the P/D pools, or mode: colocated") in str(info.value)
    # one pool of vLLM in colocated mode leaves the (unused) P/D pools alone
    ServeConfig.model_validate({"model": "m", "mode": "colocated", "decode": {"engine": {"backend": "vllm"}}})
    with pytest.raises(ValueError, match="worker.engine: speculative is kvrelay's engine's"):
        ServeConfig.model_validate({"model": "m", "mode": "colocated", "worker": {"engine": {
            "backend": "vllm", "speculative": {"method": "ngram"}}}})
    with pytest.raises(ValueError, match="Input should be 'kvrelay' or 'vllm'"):
        ServeConfig.model_validate({"model": "m", "engine": {"backend": "sglang"}})
