"""`kvrelay k8s status` on recorded API objects: a RayService in KubeRay 1.x's status shape and
its pods, served by fake API clients (no API server here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from cluster import k8s
from serving import cli

DATA = Path(__file__).parent / "data"


class FakeCustomObjectsApi:
    def __init__(self, recorded: str | None = None, error: ApiException | None = None):
        self.recorded, self.error, self.calls = recorded, error, []

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=None):
        self.calls.append((group, version, namespace, plural, label_selector))
        if self.error is not None:
            raise self.error
        return json.loads((DATA / self.recorded).read_text()) if self.recorded else {"items": []}


class FakeCoreV1Api:
    """Returns V1PodList objects, deserialized from the recording the way the client does."""

    def __init__(self, recorded: str):
        self.recorded, self.calls = recorded, []

    def list_namespaced_pod(self, namespace, label_selector=None):
        self.calls.append((namespace, label_selector))
        return ApiClient().deserialize((DATA / self.recorded).read_text(), "V1PodList", "application/json")


def test_running_release():
    custom, core = FakeCustomObjectsApi("rayservice_running.json"), FakeCoreV1Api("pods_running.json")
    report = k8s.status("kvrelay", "serving", custom_api=custom, core_api=core)
    assert custom.calls == [("ray.io", "v1", "serving", "rayservices", "app.kubernetes.io/instance=kvrelay")]
    assert core.calls == [("serving", "app.kubernetes.io/instance=kvrelay")]
    assert report.splitlines() == [
        "RayService kvrelay (release kvrelay, namespace serving): Running",
        "  conditions: Ready=True (NonZeroServeEndpoints), UpgradeInProgress=False (NoPendingCluster)",
        "  active cluster: kvrelay-x2fk9 (state ready, workers ready 2/2)",
        "    app kvrelay: RUNNING",
        "      DecodeWorker   HEALTHY",
        "      OpenAIIngress  HEALTHY",
        "      PrefillWorker  HEALTHY",
        "pods:",
        "  pool     pod                                 phase    ready  restarts  node          cluster",
        "  head     kvrelay-x2fk9-head                  Running  1/1    0         gke-pool-a-0  active",
        "  prefill  kvrelay-x2fk9-prefill-worker-m8q2d  Running  1/1    0         gke-pool-a-1  active",
        "  decode   kvrelay-x2fk9-decode-worker-5tr7w   Running  1/1    1         gke-pool-b-0  active",
    ]


def test_upgrade_in_progress_shows_both_clusters_and_why_a_deployment_waits():
    report = k8s.status(
        "prod", "serving", custom_api=FakeCustomObjectsApi("rayservice_upgrading.json"),
        core_api=FakeCoreV1Api("pods_upgrading.json"),
    )
    assert report.splitlines() == [
        "RayService prod-kvrelay (release prod, namespace serving): Running",
        "  conditions: Ready=True (NonZeroServeEndpoints), UpgradeInProgress=True (BothActivePendingClustersExist)",
        "  active cluster: prod-kvrelay-x2fk9 (state ready, workers ready 2/2)",
        "    app kvrelay: RUNNING",
        "      DecodeWorker   HEALTHY",
        "      OpenAIIngress  HEALTHY",
        "      PrefillWorker  HEALTHY",
        "  pending cluster: prod-kvrelay-q9wz4 (workers ready 1/3)",
        "    app kvrelay: DEPLOYING: Deploying app 'kvrelay'",
        "      DecodeWorker   UPDATING: Deployment 'DecodeWorker' in application 'kvrelay' has 1 replicas that have taken more than 30s to be scheduled.",
        "      OpenAIIngress  HEALTHY",
        "      PrefillWorker  HEALTHY",
        "pods:",
        "  pool     pod                                      phase        ready  restarts  node    cluster",
        "  head     prod-kvrelay-x2fk9-head                  Running      1/1    0         node-0  active",
        "  head     prod-kvrelay-q9wz4-head                  Running      1/1    0         node-3  pending",
        "  prefill  prod-kvrelay-x2fk9-prefill-worker-m8q2d  Terminating  0/1    0         node-1  active",
        "  prefill  prod-kvrelay-q9wz4-prefill-worker-2kd8s  Running      1/1    0         node-4  pending",
        "  decode   prod-kvrelay-x2fk9-decode-worker-5tr7w   Running      1/1    0         node-2  active",
        "  decode   prod-kvrelay-q9wz4-decode-worker-7hh3k   Pending      0/1    0         -       pending",
    ]


def test_not_ready_says_why():
    service = json.loads((DATA / "rayservice_running.json").read_text())["items"][0]
    service["status"] = {
        "serviceStatus": "",
        "conditions": [{"type": "Ready", "status": "False", "reason": "Initializing", "message": "RayService is initializing"}],
    }
    assert k8s.format_status(service, [], release="kvrelay", namespace="serving").splitlines() == [
        "RayService kvrelay (release kvrelay, namespace serving): unknown",
        "  conditions: Ready=False (Initializing)",
        "    not ready: RayService is initializing",
        "  active cluster: none yet",
        "pods: none",
    ]


def test_unknown_release():
    with pytest.raises(k8s.K8sError) as info:
        k8s.status("nope", "serving", custom_api=FakeCustomObjectsApi(), core_api=FakeCoreV1Api("pods_running.json"))
    assert str(info.value) == (
        "no RayService of release 'nope' in namespace 'serving' (none labelled app.kubernetes.io/instance=nope); "
        "check --release and --namespace (helm list -A)"
    )


def test_api_error_is_wrapped_and_the_cli_exits_2(monkeypatch, capsys):
    denied = ApiException(status=403, reason="Forbidden")
    denied.body = json.dumps({"kind": "Status", "message": 'rayservices.ray.io is forbidden: User "dev" cannot list resource "rayservices"'})
    fakes = (FakeCustomObjectsApi(error=denied), FakeCoreV1Api("pods_running.json"))
    monkeypatch.setattr(k8s, "_clients", lambda context: fakes)
    assert cli.main(["k8s", "status", "--release", "kvrelay", "--namespace", "serving"]) == 2
    assert capsys.readouterr().err == (
        "kvrelay k8s status: the Kubernetes API refused the request (403 Forbidden): "
        'rayservices.ray.io is forbidden: User "dev" cannot list resource "rayservices"\n'
    )


def test_cli_prints_the_report(monkeypatch, capsys):
    fakes = (FakeCustomObjectsApi("rayservice_running.json"), FakeCoreV1Api("pods_running.json"))
    monkeypatch.setattr(k8s, "_clients", lambda context: fakes)
    assert cli.main(["k8s", "status", "--release", "kvrelay", "--namespace", "serving"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "RayService kvrelay (release kvrelay, namespace serving): Running"
