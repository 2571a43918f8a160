"""pdserve.cluster: the control plane.

Modules (import the one you need; nothing is imported eagerly, so a process
that only reads topologies does not pay for Ray or gRPC):

- ``registry``: ``Registry`` (etcd membership with leases, keep-alive,
  re-registration, member views, policy distribution) and ``WorkerInfo``.
- ``watch``: ``MemberWatch`` and ``PolicyWatch``, the self-healing watches.
- ``keys``: the etcd keyspace of ARCHITECTURE.md.
- ``etcd_server``: ``EmbeddedEtcd``, an etcd child process on loopback.
- ``topology``: the XpYd topology schema and ``load_topology``.
- ``queue``: ``PrefillTask`` and the ``PrefillQueue`` Ray actor.
- ``cli``: ``pdserve topology check`` and ``pdserve etcd``.
"""
