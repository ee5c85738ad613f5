"""An emulated Kubernetes API server (kmock underneath) and the operator running against it."""
