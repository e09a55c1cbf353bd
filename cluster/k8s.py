"""`kvrelay k8s status --release NAME`: a Helm release's RayService and its pods, per pool.

    RayService (ray.io/v1, labelled app.kubernetes.io/instance=NAME by the chart)
      status.serviceStatus, status.conditions          Ready / UpgradeInProgress
      status.activeServiceStatus                       the RayCluster serving now:
        .rayClusterName, .rayClusterStatus               its workers (ready / desired)
        .applicationStatuses[app].status                 the Serve app, and per deployment
        .applicationStatuses[app].serveDeploymentStatuses[name].status / .message
      status.pendingServiceStatus                      the RayCluster of an upgrade in progress
    Pods labelled app.kubernetes.io/instance=NAME, grouped by KubeRay's ray.io/group
      (headgroup -> head, prefill, decode), with phase, ready containers, restarts, node, and
      whether they belong to the active or the pending RayCluster (ray.io/cluster).

Read with the `kubernetes` client (kubeconfig, or the in-cluster service account); the
formatting is a pure function of the API objects, so it is tested on recorded ones.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["INSTANCE_LABEL", "K8sError", "fetch", "format_status", "status"]

logger = logging.getLogger(__name__)

INSTANCE_LABEL = "app.kubernetes.io/instance"  # set by the chart on the RayService and every pod
GROUP, VERSION, PLURAL = "ray.io", "v1", "rayservices"
POOLS = ("head", "prefill", "decode")  # display order; other worker groups follow by name
_CLUSTER_ORDER = ("active", "pending", "other")


class K8sError(RuntimeError):
    """The cluster could not be reached or the release was not found; the message says which."""


def status(release: str, namespace: str = "default", *, context: str | None = None, custom_api=None, core_api=None) -> str:
    """The report `kvrelay k8s status` prints. APIs default to clients from the kubeconfig
    (`context`) or, inside a pod, the service account."""
    if custom_api is None or core_api is None:
        custom_api, core_api = _clients(context)
    service, pods = fetch(release, namespace, custom_api, core_api)
    return format_status(service, pods, release=release, namespace=namespace)


def fetch(release: str, namespace: str, custom_api, core_api) -> tuple[dict, list[dict]]:
    """The release's RayService (a dict, as the API returns it) and its pods (as JSON dicts)."""
    from kubernetes.client import ApiClient
    from kubernetes.client.exceptions import ApiException

    selector = f"{INSTANCE_LABEL}={release}"
    try:
        services = custom_api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, label_selector=selector)
        pod_list = core_api.list_namespaced_pod(namespace, label_selector=selector)
    except ApiException as exc:
        raise K8sError(f"the Kubernetes API refused the request ({exc.status} {exc.reason}): {_api_message(exc)}") from exc
    items = services.get("items", [])
    if not items:
        raise K8sError(
            f"no RayService of release {release!r} in namespace {namespace!r} (none labelled {selector}); "
            "check --release and --namespace (helm list -A)"
        )
    if len(items) > 1:
        names = ", ".join(item["metadata"]["name"] for item in items)
        raise K8sError(f"release {release!r} has several RayServices ({names}); kvrelay's chart makes one")
    api = ApiClient()
    return items[0], [api.sanitize_for_serialization(pod) for pod in pod_list.items]


def format_status(service: dict, pods: list[dict], *, release: str, namespace: str) -> str:
    st = service.get("status") or {}
    name = service["metadata"]["name"]
    lines = [f"RayService {name} (release {release}, namespace {namespace}): {st.get('serviceStatus') or 'unknown'}"]
    conditions = st.get("conditions") or []
    if conditions:
        shown = ", ".join(f"{c['type']}={c['status']}" + (f" ({c['reason']})" if c.get("reason") else "") for c in conditions)
        lines.append(f"  conditions: {shown}")
        for c in conditions:  # why it is not ready (other conditions' messages restate their reason)
            if c["type"] == "Ready" and c.get("status") != "True" and c.get("message"):
                lines.append(f"    not ready: {c['message']}")
    clusters = {}
    for which, key in (("active", "activeServiceStatus"), ("pending", "pendingServiceStatus")):
        section = st.get(key) or {}
        cluster = section.get("rayClusterName")
        if not cluster:
            if which == "active":
                lines.append("  active cluster: none yet")
            continue
        clusters[cluster] = which
        lines.append(f"  {which} cluster: {cluster}{_workers(section.get('rayClusterStatus') or {})}")
        for app, app_status in sorted((section.get("applicationStatuses") or {}).items()):
            lines.append(f"    app {app}: {app_status.get('status', 'unknown')}" + _message(app_status))
            deployments = app_status.get("serveDeploymentStatuses") or {}
            width = max((len(d) for d in deployments), default=0)
            for deployment, dep_status in sorted(deployments.items()):
                lines.append(f"      {deployment:<{width}}  {dep_status.get('status', 'unknown')}" + _message(dep_status))
    lines.append("pods:" if pods else "pods: none")
    rows = [_pod_row(pod, clusters) for pod in pods]
    rows.sort(key=lambda row: (_pool_order(row[0]), _CLUSTER_ORDER.index(row[6]), row[1]))
    if rows:
        header = ("pool", "pod", "phase", "ready", "restarts", "node", "cluster")
        widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  " + "  ".join(f"{cell!s:<{widths[i]}}" for i, cell in enumerate(row)).rstrip())
    return "\n".join(lines)


# ---- helpers ---------------------------------------------------------------------------------
def _clients(context: str | None):
    try:
        from kubernetes import client, config
    except ImportError as exc:  # a dependency, but say what to do if it is missing
        raise K8sError("the `kubernetes` package is not installed (pip install kubernetes)") from exc
    try:
        try:
            config.load_kube_config(context=context)
        except config.ConfigException:
            if context is not None:
                raise
            config.load_incluster_config()
    except config.ConfigException as exc:
        raise K8sError(f"no Kubernetes configuration: {exc} (set KUBECONFIG or run inside the cluster)") from exc
    return client.CustomObjectsApi(), client.CoreV1Api()


def _api_message(exc) -> str:
    import json

    try:
        return json.loads(exc.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or "")


def _workers(cluster_status: dict[str, Any]) -> str:
    if "readyWorkerReplicas" not in cluster_status and "desiredWorkerReplicas" not in cluster_status:
        return ""
    state = f"state {cluster_status['state']}, " if cluster_status.get("state") else ""
    return f" ({state}workers ready {cluster_status.get('readyWorkerReplicas', 0)}/{cluster_status.get('desiredWorkerReplicas', 0)})"


def _message(status: dict) -> str:
    message = (status.get("message") or "").strip().splitlines()
    return f": {message[0]}" if message else ""


def _pod_row(pod: dict, clusters: dict[str, str]) -> tuple:
    meta, spec, st = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    group = labels.get("ray.io/group", "?")
    pool = "head" if group == "headgroup" or labels.get("ray.io/node-type") == "head" else group
    containers = st.get("containerStatuses") or []
    ready = f"{sum(bool(c.get('ready')) for c in containers)}/{len(spec.get('containers') or containers)}"
    restarts = sum(int(c.get("restartCount") or 0) for c in containers)
    phase = "Terminating" if meta.get("deletionTimestamp") else st.get("phase", "Unknown")
    cluster = clusters.get(labels.get("ray.io/cluster", ""), "other")
    return pool, meta.get("name", "?"), phase, ready, restarts, spec.get("nodeName") or "-", cluster


def _pool_order(pool: str) -> tuple[int, str]:
    return (POOLS.index(pool), "") if pool in POOLS else (len(POOLS), pool)
