#!/bin/bash
# deploy/k8s against the Kubernetes API models (tests/deploy/k8s_manifests_test.py).
exec /usr/bin/python3 "$PWD/tests/deploy/k8s_manifests_test.py" "$PWD/deploy/k8s"
