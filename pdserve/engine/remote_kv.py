"""The scheduler side of the remote-KV seam: what `Scheduler.schedule()` asks and tells about
a request whose prompt KV another worker writes (vLLM v1's KV connector in its scheduler
role; the worker side is engine/kv_connector.py).

A decode worker adds such a request like any other, marked ``remote_kv``
(`LLMEngine.add_request`). The scheduler reserves its blocks in the `schedule()` that
admits it, before the local prompts (a reservation computes nothing, and the sooner it is
made, the sooner a prefill worker can start):

    external_tokens(req, cached)   the prompt positions another worker fills (all uncached ones)
    allocated(req, reservation)    its blocks are reserved: the request waits for them to be written
    no_room(req)                   the pool cannot hold it now: it was queued for a local prefill
    request_finished(req, status)  whether its blocks outlive it (a prefill worker's export
                                   keeps them until its pages are written: `release_export`)

`take()` hands what happened since the last call to the worker side (the decode worker's
remote path, on the engine thread): each request id with its `Reservation`, or None where
there was no room. Nothing here does I/O or knows who writes the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from .request import Request, RequestStatus


@dataclass(frozen=True)
class Reservation:
    """Where a prefill worker writes: prompt positions [cached_len, n) go to ``block_ids``; a
    speculative draft model's KV of every prompt position to ``draft_block_ids`` (empty: the
    decode worker's draft computes the prompt itself, engine/spec_draft.py)."""

    cached_len: int
    block_ids: list[int]
    draft_block_ids: tuple[int, ...] = ()


class RemoteKVScheduler:
    """The scheduler's half of the seam (see the module docstring). Engine thread only."""

    def __init__(self) -> None:
        self._news: list[tuple[str, Reservation | None]] = []

    def external_tokens(self, req: Request, cached_len: int) -> int:
        """Prompt positions of ``req`` whose KV arrives from outside (0: none, a local request).
        The last prompt position too: the prefill worker samples the first token."""
        return max(0, req.num_prompt_tokens - cached_len) if req.remote_kv else 0

    def allocated(self, req: Request, reservation: Reservation) -> None:
        self._news.append((req.request_id, reservation))

    def no_room(self, req: Request) -> None:
        self._news.append((req.request_id, None))

    def request_finished(self, req: Request, status: RequestStatus) -> bool:
        """Whether ``req``'s blocks stay taken after it finished: an export's (``keep_kv``: the
        prefill role) until the workers' side releases them once its pages are written; an
        aborted one's never."""
        return req.keep_kv and status is not RequestStatus.FINISHED_ABORTED

    @property
    def pending(self) -> bool:
        """Whether reservations (or refusals) wait to be taken."""
        return bool(self._news)

    def take(self, request_id: str | None = None) -> list[tuple[str, Reservation | None]]:
        """What was reserved or refused since the last call, in order (only ``request_id``'s,
        leaving the others, when given)."""
        if request_id is None:
            news, self._news = self._news, []
            return news
        mine = [n for n in self._news if n[0] == request_id]
        self._news = [n for n in self._news if n[0] != request_id]
        return mine
