"""Noticing an HTTP client that left while its handler still works for it.

gRPC cancels a call's task when its client goes. An ASGI handler is not told:
a non-streaming handler runs to the end, and a streaming one waits for the
first chunk before its response (and Starlette's own disconnect listener)
starts. `ClientWatch` listens for the ASGI ``http.disconnect`` message beside
the handler and, when it comes, cancels the handler's task where it waits:
inside the frontend's generators, whose ``finally`` aborts the sequences
(queued remote tasks withdrawn, blocks freed). Once a stream's response has
started, Starlette cancels the stream itself on a disconnect (or its next
write fails), so the watch is closed before the response is returned.
"""

from __future__ import annotations

import asyncio


class ClientWatch:
    """Cancels the task that created it if its HTTP client disconnects before `close()`.

    The handler catches the CancelledError and asks `gone()`: True means the client left
    (the cancellation was ours, and is taken back), False means someone else cancelled.
    Close it before a response is sent: after one, the server reports every receive as a
    disconnect.
    """

    def __init__(self, receive):
        self._task = asyncio.current_task()
        self._fired = False
        self._listener = asyncio.ensure_future(self._listen(receive))

    async def _listen(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # the body was read already: nothing else is expected before a disconnect
        self._fired = True
        self._task.cancel()

    def gone(self) -> bool:
        """After a CancelledError: whether it came from the client's disconnect (then the
        cancellation is taken back so the handler can return normally)."""
        # Python 3.11+ counts cancellations: a caught one still marks the task cancelling (and a
        # later `asyncio.timeout` would misread it) unless taken back. 3.10 has no count: a
        # caught CancelledError leaves nothing behind, so there is nothing to take back.
        if self._fired and hasattr(self._task, "uncancel") and self._task.cancelling():
            self._task.uncancel()
        return self._fired

    def close(self) -> bool:
        """Stop listening; True if the client had already left (the handler's work was, or
        is about to be, cancelled)."""
        self._listener.cancel()
        return self._fired
