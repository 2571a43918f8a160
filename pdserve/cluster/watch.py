"""Self-healing etcd watches: a live member view and a policy follower.

Both follow the same loop: list the key range (this gives a revision), apply
the listing as a diff against what we already hold, then watch from the next
revision. Any stream error (etcd restarted, network cut, compaction) sends the
loop back to the listing after a jittered backoff. Re-listing rather than
resuming from the last revision is deliberate: an etcd that lost its data
restarts at a lower revision, and a resume would silently wait for revisions
that never come.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pdserve.cluster.etcd_client import CLOSE_TIMEOUT_S
from pdserve.cluster.records import TRANSIENT_ERRORS, WorkerInfo, decode_members, short_error

if TYPE_CHECKING:
    from pdserve.cluster.registry import Registry

log = logging.getLogger(__name__)


async def _call(callback: Callable | None, *args: Any) -> None:
    """Run a user callback (plain or async); its failure is logged, never fatal."""
    if callback is None:
        return
    try:
        result = callback(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("watch callback %r failed", getattr(callback, "__name__", callback))


class _ResyncingWatch:
    """List + watch + re-list-on-error loop; subclasses say what to list and apply."""

    def __init__(self, registry: "Registry", key: bytes, prefix: bool):
        self._registry = registry
        self._key = key
        self._prefix = prefix
        self._task: asyncio.Task | None = None
        self._stream: Any = None  # an aetcd watch stream (aetcd is read as Any), None between watches
        self._closing = False
        self._synced = asyncio.Event()
        self.resyncs = 0  # listings after the first: one per reconnect

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"pdserve-watch-{self._key!r}")

    @property
    def synced(self) -> bool:
        """True while the watch stream is up and the view reflects etcd."""
        return self._synced.is_set()

    async def wait_synced(self, timeout_s: float = 10.0) -> None:
        """Wait until the first listing has been applied (raises TimeoutError)."""
        await asyncio.wait_for(self._synced.wait(), timeout_s)

    async def close(self) -> None:
        self._closing = True
        if self._stream is not None:
            try:  # (bounded: a stream that does not cancel must not hold a shutdown)
                await asyncio.wait_for(self._stream.cancel(), CLOSE_TIMEOUT_S)
            except TRANSIENT_ERRORS:  # (asyncio.TimeoutError among them)
                pass
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        failures = 0
        listings = 0
        while not self._closing:
            client = self._registry.client()
            try:
                if self._prefix:
                    reply = await client.get_prefix(self._key)
                    revision = reply.header.revision
                    await self._apply_listing(list(reply))
                else:
                    # One read gives both the value and the revision to watch from:
                    # a separate revision read could skip a put made in between.
                    reply = await client.get_prefix(self._key)
                    revision = reply.header.revision
                    await self._apply_listing([kv for kv in reply if kv.key == self._key])
                if listings:
                    self.resyncs += 1
                listings += 1
                watch_fn = client.watch_prefix if self._prefix else client.watch
                self._stream = await watch_fn(self._key, start_revision=revision + 1)
                self._synced.set()
                failures = 0
                async for event in self._stream:
                    await self._apply_event(event)
                # The iterator ends quietly when the client is closed or replaced.
                reason = "stream closed"
            except TRANSIENT_ERRORS as exc:
                reason = short_error(exc)
                self._registry.connection_failed(client)
            finally:
                self._stream = None
            self._synced.clear()
            if self._closing:
                return
            failures += 1
            delay_s = self._registry.backoff_s(failures)
            log.warning("watch %s lost (%s); re-listing in %.2f s", self._key.decode(), reason, delay_s)
            await asyncio.sleep(delay_s)

    async def _apply_listing(self, kvs: list) -> None:
        raise NotImplementedError

    async def _apply_event(self, event) -> None:
        raise NotImplementedError


class MemberWatch(_ResyncingWatch):
    """A live view of registered workers (one role or all), with callbacks.

    `members` maps worker_id -> WorkerInfo and always reflects the last
    listing plus the events since. After a reconnect the fresh listing is
    diffed against it: workers that vanished meanwhile get `on_remove`, new
    ones `on_add`, changed ones `on_update`, so callbacks see every change
    exactly once even across an etcd restart.
    """

    def __init__(self, registry: "Registry", role: str | None, on_add, on_update, on_remove):
        super().__init__(registry, registry.keys.workers_prefix(role), prefix=True)
        self.role = role
        self.members: dict[str, WorkerInfo] = {}
        self._on_add, self._on_update, self._on_remove = on_add, on_update, on_remove

    async def wait_for(self, predicate: Callable[[dict[str, WorkerInfo]], bool], timeout_s: float) -> None:
        """Wait until `predicate(members)` holds (polled every 20 ms; raises TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self.members):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"member view never satisfied the predicate; have {sorted(self.members)}")
            await asyncio.sleep(0.02)

    async def _apply_listing(self, kvs: list) -> None:
        fresh = dict(decode_members(self._registry.keys, kvs))
        for worker_id in [w for w in self.members if w not in fresh]:
            await _call(self._on_remove, self.members.pop(worker_id))
        for worker_id, info in fresh.items():
            await self._upsert(worker_id, info)

    async def _apply_event(self, event) -> None:
        parsed = self._registry.keys.parse_worker(event.kv.key)
        if parsed is None:
            return
        worker_id = parsed[1]
        if event.kind == "DELETE":
            info = self.members.pop(worker_id, None)
            if info is not None:
                await _call(self._on_remove, info)
            return
        for _, info in decode_members(self._registry.keys, [event.kv]):
            await self._upsert(worker_id, info)

    async def _upsert(self, worker_id: str, info: WorkerInfo) -> None:
        old = self.members.get(worker_id)
        if old == info:
            return
        self.members[worker_id] = info
        await _call(self._on_add if old is None else self._on_update, info)


@dataclass(frozen=True)
class PolicyRejection:
    """Why a published policy version was refused; the previous one stays active."""

    kind: str
    revision: int
    reason: str
    active_revision: int | None

    def __str__(self) -> str:
        keeping = f"revision {self.active_revision}" if self.active_revision else "no policy"
        return f"{self.kind} policy revision {self.revision} rejected, keeping {keeping}: {self.reason}"


class PolicyWatch(_ResyncingWatch):
    """Follows one policy key; validates each version before it becomes active.

    `validate(yaml_text)` returns the parsed policy or raises (the router
    package's validator names the offending key). On success `current` is
    replaced in one assignment and `on_change(policy)` runs; on failure
    `current` is untouched and `on_reject(PolicyRejection)` runs. A deleted
    key keeps the active policy (removing config must not silently reset a
    cluster to defaults).
    """

    def __init__(self, registry: "Registry", kind: str, validate, on_change, on_reject):
        super().__init__(registry, registry.keys.policy(kind), prefix=False)
        self.kind = kind
        self.current: Any = None
        self.revision: int | None = None  # etcd mod_revision of `current`
        self.last_rejection: PolicyRejection | None = None
        self._validate, self._on_change, self._on_reject = validate, on_change, on_reject
        self._seen_revision: int | None = None  # last version judged, good or bad

    async def _apply_listing(self, kvs: list) -> None:
        for kv in kvs:
            await self._consider(kv.value, kv.mod_revision)

    async def _apply_event(self, event) -> None:
        if event.kind == "DELETE":
            log.warning("%s policy key deleted; keeping revision %s active", self.kind, self.revision)
            return
        await self._consider(event.kv.value, event.kv.mod_revision)

    async def _consider(self, value: bytes, mod_revision: int) -> None:
        if mod_revision == self._seen_revision:
            return  # the same version again after a re-list
        self._seen_revision = mod_revision
        try:
            policy = self._validate(value.decode())
            if inspect.isawaitable(policy):
                policy = await policy
        except Exception as exc:  # the validator is the caller's code: any failure is a refusal
            self.last_rejection = PolicyRejection(self.kind, mod_revision, str(exc), self.revision)
            log.warning("%s", self.last_rejection)
            await _call(self._on_reject, self.last_rejection)
            return
        self.current, self.revision = policy, mod_revision
        log.info("%s policy revision %d active", self.kind, mod_revision)
        await _call(self._on_change, policy)


class DrainWatch(_ResyncingWatch):
    """Fires `on_drain(reason)` once when the worker's drain key appears.

    `pdserve drain WORKER` writes the key and then revokes the worker's
    lease: peers drop the worker at once, and the worker, seeing the key,
    stops taking work, finishes what it holds and leaves instead of
    re-registering (which is what it does after an ordinary lease loss).

    A request at or below `ignore_through_revision` (etcd mod_revision) predates this
    worker: one it could not delete at start (etcd RBAC), ignored like a deleted one.
    Once the key is seen gone, every later request counts (even after an etcd that lost
    its data starts its revisions again).
    """

    def __init__(self, registry: "Registry", worker_id: str, on_drain, ignore_through_revision: int = 0):
        super().__init__(registry, registry.keys.drain(worker_id), prefix=False)
        self._on_drain = on_drain
        self._ignore_through = ignore_through_revision
        self.requested = False

    async def _apply_listing(self, kvs: list) -> None:
        if not kvs:
            self._ignore_through = 0
        for kv in kvs:
            await self._fire(kv.value, kv.mod_revision)

    async def _apply_event(self, event) -> None:
        if event.kind == "DELETE":
            self._ignore_through = 0
        else:
            await self._fire(event.kv.value, event.kv.mod_revision)

    async def _fire(self, value: bytes, mod_revision: int) -> None:
        if mod_revision <= self._ignore_through:
            return
        if not self.requested:
            self.requested = True
            await _call(self._on_drain, value.decode(errors="replace") or "drain requested")
