"""Structural JSON schemas for the Prometheus Operator objects in k8s/monitoring
(monitoring.coreos.com/v1 PodMonitor and PrometheusRule).

Not the operator's published CRDs (no copy of them ships here): the fields these
manifests may use, with their types, and nothing else, so that a misspelt or
misplaced field fails the test. Field names follow the operator's v1 API
(prometheus-operator Documentation/api.md); extend the lists when a manifest needs
another field of that API.
"""

from __future__ import annotations

# Prometheus duration as the operator validates it (monitoringv1.Duration).
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}

METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
        "namespace": {"type": "string"},
        "labels": LABELS,
        "annotations": LABELS,
    },
    "additionalProperties": False,
}

LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": LABELS,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}

RELABEL_CONFIG = {
    "type": "object",
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                            "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                            "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                            "dropequal", "DropEqual"]},
    },
    "additionalProperties": False,
}

POD_METRICS_ENDPOINT = {
    "type": "object",
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "params": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "trackTimestampsStaleness": {"type": "boolean"},
        "filterRunning": {"type": "boolean"},
        "followRedirects": {"type": "boolean"},
        "enableHttp2": {"type": "boolean"},
        "relabelings": {"type": "array", "items": RELABEL_CONFIG},
        "metricRelabelings": {"type": "array", "items": RELABEL_CONFIG},
    },
    "additionalProperties": False,
}

def _custom_resource(kind: str, spec: dict) -> dict:
    """A monitoring.coreos.com/v1 object of `kind` whose spec follows `spec`."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


POD_MONITOR = _custom_resource("PodMonitor", {
    "type": "object",
    "required": ["selector"],
    "properties": {
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": POD_METRICS_ENDPOINT},
        "selector": LABEL_SELECTOR,
        "namespaceSelector": {
            "type": "object",
            "properties": {
                "any": {"type": "boolean"},
                "matchNames": {"type": "array", "items": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "sampleLimit": {"type": "integer", "minimum": 0},
        "targetLimit": {"type": "integer", "minimum": 0},
        "labelLimit": {"type": "integer", "minimum": 0},
    },
    "additionalProperties": False,
})


RULE = {
    "type": "object",
    "required": ["expr"],
    "properties": {
        "alert": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
        "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "expr": {"type": ["string", "integer"], "minLength": 1},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": LABELS,
        "annotations": LABELS,
    },
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "additionalProperties": False,
}

PROMETHEUS_RULE = _custom_resource("PrometheusRule", {
    "type": "object",
    "required": ["groups"],
    "properties": {
        "groups": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": DURATION,
                    "query_offset": DURATION,
                    "limit": {"type": "integer"},
                    "labels": LABELS,
                    "partial_response_strategy": {"type": "string"},
                    "rules": {"type": "array", "items": RULE},
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
})


SCHEMAS = {"PodMonitor": POD_MONITOR, "PrometheusRule": PROMETHEUS_RULE}


def validate_crd_object(doc: dict) -> None:
    import jsonschema

    schema = SCHEMAS.get(doc.get("kind"))
    if schema is None:
        raise AssertionError(f"no structural schema for {doc.get('apiVersion')} {doc.get('kind')}")
    jsonschema.Draft202012Validator(schema).validate(doc)
