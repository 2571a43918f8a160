"""pdserve.cluster: the control plane (docs/cluster.md has the full module table).

Import the module you need; nothing is imported eagerly, so a process that only
reads topologies does not pay for Ray or gRPC. The main entry points:

- ``topology``: the XpYd topology schema and ``load_topology``.
- ``launcher``: ``Launcher`` brings a topology up and down; ``state`` records it.
- ``registry``: ``Registry`` (etcd membership, views, watches, policy, drain) and
  ``WorkerInfo``; ``registration`` holds its lease and keep-alive.
- ``queue``: the prefill queue package (task messages, pure core, Ray actor, wire).
- ``worker_config`` / ``join``: what both worker roles share to start and join.
- ``netaddr``: which address every server binds and advertises (network.bind).
- ``keys``: the etcd keyspace of docs/architecture.md; ``etcd_server``: ``EmbeddedEtcd``.
- ``cli``: ``pdserve topology check`` and ``pdserve etcd``.
"""
