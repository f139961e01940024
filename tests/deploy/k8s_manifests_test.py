#!/usr/bin/python3
"""Every manifest in deploy/k8s/ checked offline against the Kubernetes API models of
Debian's python3-kubernetes (the OpenAPI types of Kubernetes 1.22): each object's kind
must be known, and every field at every depth must exist in its model with the right
kind of value (object, list, map, string, integer, boolean). An unknown or misspelled
field fails the test. No cluster needed."""
import glob
import os
import sys

import yaml
from kubernetes import client

KINDS = {
    ("v1", "Service"): "V1Service",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Secret"): "V1Secret",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
}
PRIMITIVE = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def check(value, type_name, path, errors):
    if type_name == "object":
        return
    if type_name in PRIMITIVE:
        want = PRIMITIVE[type_name]
        if type_name == "int" and isinstance(value, bool) or not isinstance(value, want):
            # Kubernetes' IntOrString and quantities are declared "object" or "str": exact types only here.
            errors.append(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return
    if type_name.startswith("list["):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list")
            return
        for i, v in enumerate(value):
            check(v, type_name[5:-1], f"{path}[{i}]", errors)
        return
    if type_name.startswith("dict("):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map")
            return
        inner = type_name[type_name.index(",") + 1:-1].strip()
        for k, v in value.items():
            check(v, inner, f"{path}.{k}", errors)
        return
    model = getattr(client, type_name, None)
    if model is None:
        errors.append(f"{path}: unknown model {type_name}")
        return
    if not isinstance(value, dict):
        errors.append(f"{path}: expected an object ({type_name})")
        return
    by_json = {j: a for a, j in model.attribute_map.items()}
    for key, v in value.items():
        if key not in by_json:
            errors.append(f"{path}.{key}: unknown field of {type_name} (known: {sorted(by_json)})")
            continue
        check(v, model.openapi_types[by_json[key]], f"{path}.{key}", errors)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "deploy/k8s"
    files = sorted(glob.glob(os.path.join(root, "*.yaml")))
    assert files, f"no manifests under {root}"
    errors, objects = [], 0
    for f in files:
        for i, doc in enumerate(yaml.safe_load_all(open(f))):
            if doc is None:
                continue
            objects += 1
            key = (doc.get("apiVersion"), doc.get("kind"))
            where = f"{os.path.basename(f)}#{i} {key[1]}/{doc.get('metadata', {}).get('name')}"
            if key not in KINDS:
                errors.append(f"{where}: unknown kind {key}")
                continue
            check(doc, KINDS[key], where, errors)
    # The test must be able to fail: a misspelled field is caught.
    probe = []
    check({"apiVersion": "v1", "kind": "Service", "spec": {"selectr": {}}}, "V1Service", "self-test", probe)
    assert probe, "the checker misses unknown fields"
    for e in errors:
        print(f"FAIL {e}")
    print(f"{'ok  ' if not errors else 'FAIL'} {objects} objects in {len(files)} manifest(s) checked against the "
          f"Kubernetes {client.__version__.split('.')[0]}.x models: {len(errors)} error(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
