"""``prfaas up`` (a local stack from one deployment file), its supervisor and Prometheus, and the Kubernetes
renderer (``k8s``)."""
