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


def pod_specs(doc):
    """The pod template specs of a workload object."""
    if doc.get("kind") in ("StatefulSet", "Deployment", "DaemonSet"):
        yield doc["spec"]["template"]["spec"]


def check_pod(spec, where, errors, run_as):
    """Secure by default: non-root, read-only root file system, no privilege escalation,
    no capabilities; probes whose pippyctl deadline fits in their timeoutSeconds."""
    pod = spec.get("securityContext", {})
    for c in spec.get("containers", []):
        at = f"{where} container {c.get('name')}"
        sc = c.get("securityContext", {})
        if not sc.get("runAsNonRoot", pod.get("runAsNonRoot")):
            errors.append(f"{at}: runAsNonRoot is not set")
        uid = sc.get("runAsUser", pod.get("runAsUser"))
        if uid != run_as:
            errors.append(f"{at}: runAsUser {uid} is not the image's USER {run_as}")
        if sc.get("readOnlyRootFilesystem") is not True:
            errors.append(f"{at}: readOnlyRootFilesystem is not true")
        if sc.get("allowPrivilegeEscalation") is not False:
            errors.append(f"{at}: allowPrivilegeEscalation is not false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            errors.append(f"{at}: capabilities do not drop ALL")
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            command = probe.get("exec", {}).get("command", [])
            timeout = probe.get("timeoutSeconds", 1)  # Kubernetes' default
            if "--timeout-s" not in command:
                errors.append(f"{at} {kind}: the command has no --timeout-s deadline")
                continue
            deadline = float(command[command.index("--timeout-s") + 1])
            if deadline >= timeout:
                errors.append(f"{at} {kind}: --timeout-s {deadline:g} does not finish within timeoutSeconds {timeout}")


def dockerfile_user(path, errors):
    """The final stage's numeric USER of a multi-stage Dockerfile (None if it has none)."""
    lines = [l.strip() for l in open(path) if l.strip() and not l.strip().startswith("#")]
    froms = [i for i, l in enumerate(lines) if l.upper().startswith("FROM ")]
    if len(froms) < 2:
        errors.append(f"{path}: not multi-stage ({len(froms)} FROM)")
    users = [l.split()[1] for l in lines[froms[-1]:] if l.upper().startswith("USER ")] if froms else []
    if not users:
        errors.append(f"{path}: the final stage sets no USER (it would run as root)")
        return None
    uid = users[-1].split(":")[0]
    if not uid.isdigit() or int(uid) == 0:
        errors.append(f"{path}: USER {users[-1]}: give a numeric non-root uid (runAsNonRoot checks numbers)")
        return None
    return int(uid)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "deploy/k8s"
    dockerfile = sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, "..", "Dockerfile")
    files = sorted(f for f in glob.glob(os.path.join(root, "*.yaml")) if os.path.basename(f) != "kustomization.yaml")
    assert files, f"no manifests under {root}"
    errors, objects = [], 0
    run_as = dockerfile_user(dockerfile, errors)
    kustomization = yaml.safe_load(open(os.path.join(root, "kustomization.yaml")))
    image_names = {i["name"] for i in kustomization.get("images", []) if i.get("newName")}
    missing = sorted(set(map(os.path.basename, files)) - set(kustomization.get("resources", [])))
    if missing:
        errors.append(f"kustomization.yaml: resources lack {missing}")
    pods = 0
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
            for spec in pod_specs(doc):
                pods += 1
                check_pod(spec, where, errors, run_as)
                for c in spec.get("containers", []):
                    if c.get("image") not in image_names:
                        errors.append(f"{where}: image {c.get('image')!r} is not set by kustomization.yaml's images "
                                      f"({sorted(image_names)})")
    # The test must be able to fail: a misspelled field is caught, and so are a root
    # container and a probe whose deadline outlasts its timeout.
    bad = []
    check_pod({"containers": [{"name": "x", "readinessProbe": {"exec": {"command": ["pippyctl", "health",
              "--timeout-s", "2"]}}}]}, "self-test", bad, 10001)
    assert len(bad) >= 6, f"the security checks miss a bare container: {bad}"
    probe = []
    check({"apiVersion": "v1", "kind": "Service", "spec": {"selectr": {}}}, "V1Service", "self-test", probe)
    assert probe, "the checker misses unknown fields"
    for e in errors:
        print(f"FAIL {e}")
    print(f"{'ok  ' if not errors else 'FAIL'} {objects} objects in {len(files)} manifest(s) checked against the "
          f"Kubernetes {client.__version__.split('.')[0]}.x models, {pods} pod templates for the security context "
          f"(runAsNonRoot as uid {run_as}, the Dockerfile's USER; read-only root; no escalation; no capabilities), "
          f"probe deadlines and the kustomize image: {len(errors)} error(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
