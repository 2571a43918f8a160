"""Worker actors: entry points as restartable, detached Ray actors.

`start_worker_actor` is the one way a worker actor is created: `pdserve up`
(launcher.py), the planner's Ray backend and `pdserve worker` all call it.

The control plane never imports the workers: a role is a `module:Class` string
(`load_entrypoint`) whose class takes a config dict (cluster/worker_config.py)
and has async `start() -> dict`, `drain()` and `stop()`. Ray restarts a worker
actor whose process dies (`WORKER_MAX_RESTARTS`); the restarted actor starts
itself again (`restartable`), so it loads its engine and re-registers in etcd
without anyone calling `start()`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.cluster.worker_config import launch_config

if TYPE_CHECKING:
    from pdserve.cluster.topology import Topology

log = logging.getLogger(__name__)

# Restarts of one worker actor over its life. Bounded: a worker that crashes at every start
# (a bad model path, a port taken) must end up visibly dead, not loop forever.
WORKER_MAX_RESTARTS = 10
START_CALL_RETRIES = 5  # resends of a restarted actor's call to its own start() (see restartable)


def load_entrypoint(spec: str):
    module, _, name = spec.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def restartable(cls: type) -> type:
    """`cls` (an entry-point class) as an actor class that, when Ray restarts the actor after
    its process died, calls its own `start()` again (Ray re-runs only `__init__`)."""

    class Restartable(cls):
        _restart_start_claimed = False  # this process has run (or is running) its own start()

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            import ray

            ctx = ray.get_runtime_context()
            if ctx.was_current_actor_reconstructed:
                log.warning("%s restarted by Ray; starting it again", cls.__name__)
                # Its registration may still be alive (lease TTL): it is this worker's own.
                if hasattr(getattr(self, "cfg", None), "replace_stale_registration"):
                    self.cfg.replace_stale_registration = True
                # Sent before this constructor returns: the actor may still read as RESTARTING
                # when the call reaches it, which fails the call unless it may be resent. Ray
                # can then deliver it twice (seen: a call reported failed "the actor was
                # restarted" had run, and its resend ran too: two concurrent start()s, whose
                # engines' rank processes were then driven from two threads), so only the
                # first delivery starts the worker.
                ctx.current_actor._start_after_restart.options(max_task_retries=START_CALL_RETRIES).remote()

        async def start(self, *args, **kwargs):
            if not getattr(self, "_rank_devices_claimed", False):
                self._rank_devices_claimed = True
                await asyncio.to_thread(claim_rank_devices)
            return await super().start(*args, **kwargs)

        async def _start_after_restart(self) -> None:
            if self._restart_start_claimed:  # set before any await: the actor's one event loop
                log.warning("%s: a second delivery of the start after a restart ignored", cls.__name__)
                return
            self._restart_start_claimed = True
            try:
                await self.start()
            except Exception:  # noqa: BLE001  (logged; the actor stays up for inspection)
                log.exception("%s: start after a restart failed", cls.__name__)

    Restartable.__name__ = Restartable.__qualname__ = cls.__name__
    Restartable.__module__ = cls.__module__
    return Restartable


# Ray refuses a bundle whose resources are all zero; a rank of a worker that asks for no CPU
# (num_cpus: 0) reserves this much in its bundle.
RANK_BUNDLE_MIN_CPU = 0.01
RANK_SLOT_TIMEOUT_S = 120.0  # the slots of a restarted worker wait for its old slots' GPUs to be freed


def ranks_group_name(actor: str) -> str:
    """The Ray placement group of a TP worker's ranks (named after its actor)."""
    return f"{actor}-ranks"


def rank_bundles(num_cpus: float, num_gpus: float, tp: int, custom: dict[str, float]) -> list[dict[str, float]]:
    """One placement-group bundle per rank of a TP worker: the role's CPUs and GPUs shared out
    evenly (a rank's cores, a rank's GPUs). Bundle 0 holds the worker's actor (rank 0), so it
    also carries the custom resources that place the worker (a node type's, "node:<ip>")."""
    bundles = []
    for rank in range(tp):
        bundle = {key: amount / tp for key, amount in (("CPU", num_cpus), ("GPU", num_gpus)) if amount > 0}
        if rank == 0:
            bundle.update(custom)
        bundles.append(bundle or {"CPU": RANK_BUNDLE_MIN_CPU})
    return bundles


def remove_ranks_group(actor: str) -> bool:
    """Remove the placement group of the named worker's ranks; False if it has none (a TP=1
    worker, or removed already). Called after the worker's actor is killed: every path that
    ends a worker (stop_actor, the planner's backend, `pdserve down`) goes through here."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    try:  # looked up in this driver's namespace: every pdserve driver joins the cluster's
        group = get_placement_group(ranks_group_name(actor))
    except ValueError:
        return False
    try:
        remove_placement_group(group)
    except Exception as exc:  # noqa: BLE001  (removed meanwhile; nothing to free)
        log.warning("placement group %s: %r while removing it", ranks_group_name(actor), exc)
        return False
    return True


class RankSlot:
    """Holds one bundle of a TP worker's placement group (rank r > 0) for the worker's life and
    says which GPUs Ray gave it. Ranks are the worker's child processes (engine/tp_group.py),
    which Ray does not schedule; the slot is how the worker learns the GPUs of rank r's bundle."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


def claim_rank_devices() -> list[list[str]] | None:
    """In a TP worker's actor (bundle 0 of its ranks' placement group): start a `RankSlot` in
    every other bundle, and make CUDA_VISIBLE_DEVICES list each bundle's first GPU in rank order,
    so that rank r's `cuda:r` (engine/runner.py) is a GPU Ray reserved for rank r. Returns the
    GPU ids per bundle, or None outside a multi-bundle group or without GPUs (CPU ranks are
    placed by their cores; their bundles only reserve them). Must run before CUDA is
    initialised in this process; the actor is started with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    so that Ray does not narrow it to bundle 0's GPUs."""
    import os

    import ray
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():  # not in a Ray actor (an entry point driven directly)
        return None
    group = get_current_placement_group()
    if group is None or group.bundle_count < 2:
        return None
    per_rank = group.bundle_specs[0].get("GPU", 0)
    if per_rank <= 0:
        return None
    slot_cls = ray.remote(RankSlot)
    slots = [slot_cls.options(num_cpus=0, num_gpus=per_rank, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=index)).remote() for index in range(1, group.bundle_count)]
    try:
        ids = [[str(i) for i in ray.get_gpu_ids()]] + ray.get([s.gpu_ids.remote() for s in slots],
                                                            timeout=RANK_SLOT_TIMEOUT_S)
    except Exception:
        for slot in slots:
            ray.kill(slot)
        raise
    # held for this process's life: they hold the bundles' GPUs (setattr: a function attribute)
    setattr(claim_rank_devices, "slots", slots)
    if any(not got for got in ids):
        raise RuntimeError(f"a rank's bundle was given no GPU (GPU ids per rank: {ids})")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(got[0] for got in ids)
    log.info("tensor-parallel ranks on GPUs %s (one placement-group bundle each)", os.environ["CUDA_VISIBLE_DEVICES"])
    return ids


def worker_actor_options(name: str, namespace: str, num_cpus: float, num_gpus: float = 0,
                         resources: dict[str, float] | None = None) -> dict:
    """Ray options of a worker actor: detached, restarted when its process dies, calls not
    retried (a call caught by the death fails; `start` after a restart is the actor's own).
    `resources`: Ray custom resources that place it (a node type's, or "node:<ip>")."""
    return dict(name=name, namespace=namespace, lifetime="detached", num_cpus=num_cpus, num_gpus=num_gpus,
                resources=dict(resources or {}), max_concurrency=1000, max_restarts=WORKER_MAX_RESTARTS,
                max_task_retries=0)


def stop_actor(name: str, namespace: str, timeout_s: float, progress) -> None:
    """Drain and stop the named worker actor, then kill it (a dead or stuck one is killed anyway)."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    try:
        ray.get(actor.drain.remote(), timeout=timeout_s)
        ray.get(actor.stop.remote(), timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001  (a dead or stuck worker is killed anyway)
        progress(f"worker    {name}: {exc.__class__.__name__} while draining; killing")
    ray.kill(actor)
    remove_ranks_group(name)
    progress(f"worker    {name} stopped")


@dataclass
class StartedWorker:
    """A worker actor just created: its Ray name, worker id, handle and its `start()` call."""

    name: str
    worker_id: str
    actor: Any
    start_ref: Any  # ObjectRef of start() -> the worker's endpoints dict


def actor_name(cluster: str, worker_id: str) -> str:
    """The Ray actor name of a worker (unique in the cluster's namespace)."""
    return f"{cluster}-{worker_id}"


def start_worker_actor(topo: "Topology", role: str, replica: int, *, model: str, etcd_endpoints: list[str],
                       worker_id: str | None = None, resources: dict[str, float] | None = None,
                       flexible: bool = False) -> StartedWorker:
    """Create replica `replica` of `role` as a detached, restartable Ray actor and call its
    `start()`: the one way workers are started (`pdserve up`, the planner, `pdserve worker`).
    `resources` adds Ray custom resources to the role's own (e.g. {"node:<ip>": 0.01} to
    place it on one node). `flexible`: a `FlexWorker` that the planner may move to the other
    role later without reloading its weights (the autoscale policy's allow_role_flip); it
    needs the default entry points of both roles."""
    import ray

    from pdserve.cluster.topology import DEFAULT_DECODE_ENTRYPOINT, DEFAULT_FLEX_ENTRYPOINT, DEFAULT_PREFILL_ENTRYPOINT

    spec = getattr(topo.roles, role)
    cfg = launch_config(topo, role, replica, model=model, etcd_endpoints=etcd_endpoints, worker_id=worker_id)
    wid = cfg["worker_id"]
    entrypoint = spec.entrypoint
    if flexible:
        if (topo.roles.prefill.entrypoint, topo.roles.decode.entrypoint) != (DEFAULT_PREFILL_ENTRYPOINT,
                                                                             DEFAULT_DECODE_ENTRYPOINT):
            raise ValueError("allow_role_flip needs the default entry points of both roles "
                             f"({DEFAULT_PREFILL_ENTRYPOINT}, {DEFAULT_DECODE_ENTRYPOINT}); set "
                             "allow_role_flip: false in the autoscale policy to use others")
        p_tp, d_tp = topo.roles.prefill.tensor_parallel_size, topo.roles.decode.tensor_parallel_size
        if p_tp != d_tp:
            raise ValueError(f"allow_role_flip needs the same tensor_parallel_size on both roles (a flipped worker "
                             f"keeps its ranks and KV pool); this topology has prefill {p_tp}, decode {d_tp}: set "
                             "allow_role_flip: false in the autoscale policy, or one TP size")
        other = "decode" if role == "prefill" else "prefill"
        # The other role's config; the planner names its worker id when it flips the worker.
        alt = launch_config(topo, other, replica, model=model, etcd_endpoints=etcd_endpoints)
        cfg, entrypoint = {"role": role, "configs": {role: cfg, other: alt}}, DEFAULT_FLEX_ENTRYPOINT
    cls = ray.remote(restartable(load_entrypoint(entrypoint)))
    name = actor_name(topo.cluster, wid)
    custom = {**spec.resources.custom, **(resources or {})}
    tp = spec.tensor_parallel_size
    if tp == 1:
        opts = worker_actor_options(name, topo.ray.namespace, spec.resources.num_cpus, spec.resources.num_gpus, custom)
        actor = cls.options(**opts).remote(cfg)
        return StartedWorker(name, wid, actor, actor.start.remote())
    bundles = rank_bundles(spec.resources.num_cpus, spec.resources.num_gpus, tp, custom)
    group = ranks_group(name, topo.ray.namespace, bundles)
    try:
        actor = cls.options(**ranks_actor_options(name, topo.ray.namespace, group, bundles[0])).remote(cfg)
        return StartedWorker(name, wid, actor, actor.start.remote())
    except BaseException:
        remove_ranks_group(name)
        raise


def ranks_group(name: str, namespace: str, bundles: list[dict[str, float]]):
    """A TP worker's ranks as one detached STRICT_PACK placement group (one node, one bundle
    per rank), named after the worker's actor. A group of that name left by a worker that no
    longer exists (a launcher that died between the two) is removed first."""
    import ray
    from ray.util.placement_group import placement_group

    group_name = ranks_group_name(name)
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        remove_ranks_group(name)
    else:
        raise ValueError(f"a worker actor named {name!r} exists already; stop it first (pdserve down)")
    return placement_group(bundles, strategy="STRICT_PACK", name=group_name, lifetime="detached")


def ranks_actor_options(name: str, namespace: str, group, bundle0: dict[str, float]) -> dict:
    """Options of a TP worker's actor: `worker_actor_options` taking bundle 0 of its ranks'
    group (rank 0 is this actor's process). With GPUs, Ray leaves CUDA_VISIBLE_DEVICES to the
    worker (`claim_rank_devices` sets it to every rank's GPU)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = dict(bundle0)
    cpus, gpus = bundle.pop("CPU", 0.0), bundle.pop("GPU", 0.0)
    if gpus == 0 and cpus == RANK_BUNDLE_MIN_CPU and not bundle:
        cpus = 0.0  # the bundle's placeholder CPU stays unclaimed
    opts = worker_actor_options(name, namespace, cpus, gpus, bundle)
    opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    if gpus:
        opts["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    return opts
