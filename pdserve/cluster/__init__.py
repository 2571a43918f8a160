"""pdserve.cluster: the control plane (docs/cluster.md has the full module table).

Import the module you need; nothing is imported eagerly, so a process that only
reads topologies does not pay for Ray or gRPC. The main entry points:

- ``topology``: the XpYd topology schema and ``load_topology``.
- ``registry``: ``Registry`` (etcd membership, views, watches, policy, drain) and
  ``WorkerInfo``; ``registration`` holds its lease and keep-alive.
- ``worker_config`` / ``join``: what both worker roles share to start and join.
- ``netaddr``: which address every server binds and advertises (network.bind).
- ``keys``: the etcd keyspace of docs/architecture.md; ``etcd_server``: ``EmbeddedEtcd``.
- ``etcd_auth`` / ``etcd_gate`` / ``security``: who may do what, and with which credentials.

Its services are subpackages: the prefill queue ``pdserve.cluster.queue``, the autoscaler
``pdserve.cluster.planner``, the cluster's KV view ``pdserve.cluster.kvindex``. Below it only
``common``, ``router`` (the planner reuses the policy schema's errors) and ``kvtransfer``
(the queue carries the handoff's task). The launcher and the CLI that bring a topology up
are in the composition root (``pdserve.launcher``, ``pdserve.cluster_cli``).
"""
