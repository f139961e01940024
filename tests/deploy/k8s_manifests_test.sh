#!/bin/bash
# deploy/k8s and deploy/Dockerfile against the Kubernetes API models and the security
# rules (tests/deploy/k8s_manifests_test.py).
exec /usr/bin/python3 "$PWD/tests/deploy/k8s_manifests_test.py" "$PWD/deploy/k8s" "$PWD/deploy/Dockerfile"
