"""Writes helm/kvrelay/values.schema.json (the chart's values schema, JSON Schema draft 7).

    .venv/bin/python helm/tools/values_schema.py          # rewrite the file
    .venv/bin/python helm/tools/values_schema.py --check  # exit 1 if the file is stale

The `serve` and `autoscaling.policy` sections are derived from the project's own pydantic models
(serving.config.ServeConfig, router.autoscaling.policy.AutoscalingPolicyConfig): their keys, types,
ranges and descriptions, so `helm install` rejects what the app would reject, and the schema
cannot drift from the models (tests/helm/test_chart.py runs --check). The Kubernetes parts are
written out below. Cross-field rules (min <= max) are checked by the templates or by the models.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel

from router.autoscaling.policy import AutoscalingPolicyConfig
from serving.config import PoolConfig, ServeConfig
from serving.api.usage import PricingConfig

__all__ = ["CHART_OWNED_SERVE_FIELDS", "SCHEMA_PATH", "values_schema"]

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "kvrelay" / "values.schema.json"
# ServeConfig fields the chart sets itself (model source, mounted files, secret, listen address).
CHART_OWNED_SERVE_FIELDS = {"model", "http", "ray", "api_keys", "admin_api_keys", "autoscaling_policy", "pricing"}
# PoolConfig.resources carries the node role, set per pool by the chart.
CHART_OWNED_POOL_FIELDS = {"resources"}


def _type_schema(annotation: Any) -> dict:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a constrained type inside an optional one (EngineOverrides)
        base, *metadata = typing.get_args(annotation)
        # a pydantic Field(...) inside Annotated carries its constraints in .metadata
        metadata = [m for item in metadata for m in (getattr(item, "metadata", None) or [item])]
        schema = _type_schema(base)
        return {**schema, **_constraints(metadata, schema)}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) > 1:  # e.g. a count or "auto"; an override of one: or null
            nullable = [{"type": "null"}] if type(None) in typing.get_args(annotation) else []
            return {"anyOf": [*(_type_schema(a) for a in args), *nullable]}
        assert len(args) == 1, f"unsupported union {annotation}"
        inner = _type_schema(args[0])
        if "type" in inner:
            kinds = inner["type"] if isinstance(inner["type"], list) else [inner["type"]]
            return {**inner, "type": kinds if "null" in kinds else [*kinds, "null"]}
        return {"anyOf": [inner, {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin is dict:
        _, value = typing.get_args(annotation)
        return {"type": "object"} if value is Any else {"type": "object", "additionalProperties": _type_schema(value)}
    if origin is list:
        (item,) = typing.get_args(annotation)
        return {"type": "array", "items": _type_schema(item)}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model_schema(annotation)
    simple = {bool: "boolean", int: "integer", float: "number", str: "string", Decimal: ["number", "string"]}
    assert annotation in simple, f"unsupported type {annotation}"
    return {"type": simple[annotation]}


def _bound(value: Any, schema: dict) -> Any:
    """A bound written as its field's type: `ge=0` and `ge=0.0` are equal and hash alike, so
    whichever a process met first is the one `typing.Annotated`'s cache hands every field with
    that constraint; the schema must not depend on what was imported before it. A nullable
    field's type is a list (["number", "null"]): its bounds are its number's."""
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "number" in kinds:
        return float(value)
    if "integer" in kinds and float(value).is_integer():
        return int(value)
    return value


def _constraints(metadata: list, schema: dict) -> dict:
    out: dict[str, Any] = {}
    is_object = schema.get("type") == "object"
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            out["minimum"] = _bound(item.ge, schema)
        elif isinstance(item, annotated_types.Gt):
            out["exclusiveMinimum"] = _bound(item.gt, schema)
        elif isinstance(item, annotated_types.Le):
            out["maximum"] = _bound(item.le, schema)
        elif isinstance(item, annotated_types.Lt):
            out["exclusiveMaximum"] = _bound(item.lt, schema)
        elif isinstance(item, annotated_types.MinLen):
            out["minProperties" if is_object else "minItems" if schema.get("type") == "array" else "minLength"] = item.min_length
        elif getattr(item, "pattern", None):
            out["pattern"] = item.pattern
    return out


def _model_schema(model: type[BaseModel], *, exclude: set[str] = frozenset()) -> dict:
    properties = {}
    for name, field in model.model_fields.items():
        if name in exclude or field.exclude:  # e.g. a union's discriminator the YAML does not repeat
            continue
        schema = _type_schema(field.annotation)
        if model is ServeConfig and field.annotation is PoolConfig:
            schema = _model_schema(PoolConfig, exclude=CHART_OWNED_POOL_FIELDS)
        schema.update(_constraints(field.metadata, schema))
        if field.description:
            schema["description"] = field.description
        properties[name] = schema
    required = [n for n, f in model.model_fields.items() if f.is_required() and n not in exclude]
    return {"type": "object", "additionalProperties": False, "properties": properties,
            **({"required": required} if required else {})}


def _obj(properties: dict, **extra) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


_MAP = {"type": "object"}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITY = {"type": ["string", "integer", "number"]}
_RESOURCES = _obj(
    {
        kind: {"type": "object", "additionalProperties": _QUANTITY,
               "description": "cpu, memory, nvidia.com/gpu, ... (Kubernetes quantities)"}
        for kind in ("requests", "limits")
    },
    description="Kubernetes resources of the Ray container.",
)


_LABEL_SELECTOR = _obj({
    "matchLabels": _STR_MAP,
    "matchExpressions": {"type": "array", "items": _obj({
        "key": {"type": "string"},
        "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
        "values": {"type": "array", "items": {"type": "string"}},
    }, required=["key", "operator"])},
})
_PEER = _obj(
    {
        "podSelector": _LABEL_SELECTOR,
        "namespaceSelector": _LABEL_SELECTOR,
        "ipBlock": _obj({"cidr": {"type": "string", "minLength": 1},
                         "except": {"type": "array", "items": {"type": "string"}}}, required=["cidr"]),
    },
    minProperties=1,
    description="A NetworkPolicyPeer: podSelector and/or namespaceSelector, or ipBlock.",
)
_PEERS = {"type": "array", "items": _PEER}


def _pod(extra: dict) -> dict:
    return {
        **extra,
        "rayStartParams": {**_STR_MAP, "description": "ray start flags (values are strings)."},
        "resources": _RESOURCES,
        "nodeSelector": _STR_MAP,
        "tolerations": {"type": "array", "items": {"type": "object"}},
        "affinity": _MAP,
        "podLabels": _STR_MAP,
        "podAnnotations": _STR_MAP,
    }


def _group(role: str) -> dict:
    count = {"type": "integer", "minimum": 0, "maximum": 1000}
    return _obj(
        _pod({
            "replicas": {**count, "description": f"{role} worker pods at install (within min..max)."},
            "minReplicas": {**count, "description": f"Fewest {role} worker pods."},
            "maxReplicas": {**count, "minimum": 1, "description": f"Most {role} worker pods."},
        }),
        required=["replicas", "minReplicas", "maxReplicas"],
        description=f"The {role} worker group: its nodes carry the kvrelay_{role} Ray resource.",
    )


def values_schema() -> dict:
    serve = _model_schema(ServeConfig, exclude=CHART_OWNED_SERVE_FIELDS)
    serve["description"] = ("The Serve app's ServeConfig fields (serving/config/), as in deploy/local.yaml; "
                            f"the chart sets {', '.join(sorted(CHART_OWNED_SERVE_FIELDS))} itself.")
    policy = _model_schema(AutoscalingPolicyConfig)
    policy["description"] = "The autoscaling policy (router/autoscaling/policy.py), as in deploy/autoscaling/*.yaml."
    pricing = _model_schema(PricingConfig)
    pricing.pop("required")  # {} (the default): no pricing file
    pricing["description"] = "Pricing YAML (serving/api/usage.py), as in deploy/pricing.yaml; empty: no cost."
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "kvrelay chart values",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "global": _MAP,
            "nameOverride": {"type": "string"},
            "fullnameOverride": {"type": "string"},
            "image": _obj({
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string", "minLength": 1},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            }, required=["repository", "tag"]),
            "imagePullSecrets": {"type": "array", "items": _obj({"name": {"type": "string"}})},
            "rayVersion": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
            "model": _obj({
                "source": {"enum": ["builtin", "pvc", "image"],
                           "description": "builtin: model.name; pvc: model.path inside model.pvc.claimName; "
                                          "image: model.path, absolute, inside the image."},
                "name": {"type": "string", "description": "Built-in model name (source: builtin)."},
                "path": {"type": "string", "description": "A .gguf file or a Hugging Face directory."},
                "pvc": _obj({"claimName": {"type": "string"},
                             "mountPath": {"type": "string", "pattern": "^/"}}),
                "cacheSizeLimit": {"type": "string", "description": "emptyDir for converted weights."},
            }, required=["source"]),
            "loraAdapters": _obj({
                "pvc": _obj({
                    "claimName": {"type": "string", "description": "A PVC holding PEFT adapter directories, "
                                  "mounted read-only in every Ray pod; empty: none."},
                    "mountPath": {"type": "string", "pattern": "^/", "description": "Where: serve.engine.lora."
                                  "adapters (and runtime loads) name adapters by paths under it."},
                }),
            }),
            "serve": serve,
            "autoscaling": _obj({"enabled": {"type": "boolean"}, "policy": policy}, required=["enabled"]),
            "pricing": pricing,
            "auth": _obj({
                "allowUnauthenticated": {
                    "type": "boolean",
                    "description": "Serve the OpenAI API without API keys. Without keys and without this, "
                                   "the chart refuses to render.",
                },
                "rayToken": _obj({
                    "existingSecret": {
                        "type": "string",
                        "description": "A Secret with key auth_token: Ray's token (RAY_AUTH_TOKEN, KubeRay "
                                       "authOptions.secretName). Empty: the chart's <fullname>-ray-token, "
                                       "generated at install and kept on upgrade.",
                    },
                }),
            }),
            "apiKeys": _obj({
                "keys": {"type": "array", "items": {"type": "string", "minLength": 1, "pattern": "^[^,]+$"}},
                "adminKeys": {"type": "array", "items": {"type": "string", "minLength": 1, "pattern": "^[^,]+$"}},
                "existingSecret": {"type": "string",
                                   "description": "A Secret with keys api-keys and (optional) admin-api-keys; "
                                                  "it must exist, or the pods do not start."},
                "rotationId": {"type": "string",
                               "description": "Change it after changing the keys to roll a new RayCluster "
                                              "(pods read the keys when they start)."},
            }),
            "rayAutoscaler": _obj({"enabled": {"type": "boolean"},
                                   "idleTimeoutSeconds": {"type": "integer", "minimum": 0}}),
            "head": _obj(_pod({
                "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"],
                                "description": "KubeRay's <name>-head-svc (GCS, dashboard, client): ClusterIP "
                                               "keeps them inside the cluster."},
            }), description="The Ray head group (Serve controller, proxy, dashboard)."),
            "prefillGroup": _group("prefill"),
            "decodeGroup": _group("decode"),
            "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            "service": _obj({
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "annotations": _STR_MAP,
            }),
            "ingress": _obj({
                "enabled": {"type": "boolean"},
                "className": {"type": "string"},
                "annotations": _STR_MAP,
                "api": _obj({"host": {"type": "string"}, "path": {"type": "string", "pattern": "^/"}}),
                "dashboard": _obj({"enabled": {"type": "boolean"}, "host": {"type": "string"},
                                   "path": {"type": "string", "pattern": "^/"}}),
                "tls": {"type": "array", "items": {"type": "object"}},
            }),
            "networkPolicy": _obj({
                "enabled": {"type": "boolean", "description": "A NetworkPolicy over the release's Ray pods."},
                "kuberayOperator": {**_PEER, "description": "The KubeRay operator's pods: dashboard and Serve."},
                "head": _obj({"from": {**_PEERS, "description": "Peers allowed on GCS, dashboard and client."}}),
                "serve": _obj({
                    "allowAll": {"type": "boolean", "description": "The Serve port from any source."},
                    "from": {**_PEERS, "description": "Peers allowed on the Serve port (allowAll: false)."},
                }),
                "metrics": _obj({"from": {**_PEERS, "description": "Peers allowed on the metrics port."}}),
            }),
            "monitoring": _obj({
                "podMonitor": _obj({"enabled": {"type": "boolean"}, "interval": {"type": "string"},
                                    "labels": _STR_MAP}),
                "prometheusRule": _obj({"enabled": {"type": "boolean"}, "labels": _STR_MAP}),
                "grafanaDashboards": _obj({"enabled": {"type": "boolean"}, "labels": _STR_MAP}),
            }),
        },
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not SCHEMA_PATH.exists() or SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is stale; run .venv/bin/python helm/tools/values_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
