"""Schemas of the custom resources the chart can render, which kubernetes-validate does not know.

Subsets of the CRDs' OpenAPI schemas (prometheus-operator's ServiceMonitor, monitoring.coreos.com/v1;
KEDA's ScaledObject, keda.sh/v1alpha1; the Gateway API Inference Extension's InferencePool,
inference.networking.k8s.io/v1, from its Go types ``api/v1/inferencepool_types.go``), written down
from their CRD definitions: each field the chart sets, with its type and the CRD's bounds; unknown
fields refused, as ``kubernetes-validate --strict`` does.
"""

from __future__ import annotations

from typing import Any

_STR: dict[str, Any] = {"type": "string"}
_INT: dict[str, Any] = {"type": "integer"}
_LABELS: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _STR, "namespace": _STR, "labels": _LABELS, "annotations": _LABELS},
    "additionalProperties": False,
}
_TARGET_REF: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {"apiVersion": _STR, "kind": _STR, "name": _STR, "envSourceContainerName": _STR},
    "additionalProperties": False,
}


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "properties": {
            "selector": {
                "type": "object",
                "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
                "additionalProperties": False,
            },
            "namespaceSelector": {
                "type": "object",
                "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}},
                "additionalProperties": False,
            },
            "endpoints": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "port": _STR,
                        "path": _STR,
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {
                            "type": "string",
                            "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$",
                        },
                        "scrapeTimeout": {
                            "type": "string",
                            "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$",
                        },
                    },
                    "additionalProperties": False,
                },
            },
        },
        "additionalProperties": False,
    },
)

SCALED_OBJECT = _resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": _TARGET_REF,
            "minReplicaCount": _INT,
            "maxReplicaCount": _INT,
            "pollingInterval": _INT,
            "cooldownPeriod": _INT,
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "properties": {
                        "type": _STR,
                        "name": _STR,
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                    "additionalProperties": False,
                },
            },
        },
        "additionalProperties": False,
    },
)

_PORT: dict[str, Any] = {
    "type": "object",
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
    "additionalProperties": False,
}
_LABEL_VALUE: dict[str, Any] = {
    "type": "string",
    "maxLength": 63,
    "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}

INFERENCE_POOL = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    {
        "type": "object",
        "required": ["selector", "targetPorts"],
        "properties": {
            "selector": {
                "type": "object",
                "required": ["matchLabels"],
                "properties": {"matchLabels": {"type": "object", "additionalProperties": _LABEL_VALUE}},
                "additionalProperties": False,
            },
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "group": {"type": "string", "maxLength": 253},
                    "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "port": _PORT,
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
)

CUSTOM_RESOURCES: dict[tuple[str, str], dict[str, Any]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
}
"""(apiVersion, kind) -> schema."""
