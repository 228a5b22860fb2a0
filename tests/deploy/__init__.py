"""Tests of the image (Dockerfile, entrypoint) and the Kubernetes manifests (deploy/k8s)."""
