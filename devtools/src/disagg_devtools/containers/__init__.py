"""The operator's rendered objects run as real containers with podman, the way a cluster's
kubelet would run them: one podman pod per replica, Service names resolvable on a podman
network, ConfigMaps, Secrets and volumes mounted, securityContext applied, probes, restarts and
preStop hooks carried out. No cluster and no registry are needed (the images come from
`make images`).

pods.py: pure, manifests -> the pods to run (names, env, args, mounts, DNS names);
podman.py: the podman command line; kubelet.py: one pod's life (start, probes, restarts,
stop with its preStop hook); cluster.py: a set of manifests run together on one network.
"""
