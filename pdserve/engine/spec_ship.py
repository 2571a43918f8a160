"""Whether a decode worker asks its prefill workers for a remote prompt's draft KV
(``speculative_config.draft_prompt_kv``; docs/speculative.md, "In the cluster"): `ship_prompt_kv`
weighs where the draft's prefill of the prompt costs less, and `PromptKVAsks` stops ``auto``
from asking while nobody answers (prefill workers that run no such draft).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# ``auto`` stops asking after this many remote prompts in a row arrived without their draft KV
# although draft blocks were reserved for them (its prefill workers run no such draft: the
# reservations only held blocks), then asks for one prompt in AUTO_PROBE_EVERY until one arrives
# with it. (``prefill`` always asks: the operator's word.)
AUTO_GIVE_UP = 8
AUTO_PROBE_EVERY = 16


def ship_prompt_kv(mode: str, decoding: int) -> bool:
    """Whether a remote request's draft KV of its prompt is asked of the prefill worker
    (``draft_prompt_kv``; docs/speculative.md, "In the cluster"). ``auto`` weighs the two
    costs of the draft's prefill of the prompt, ``t`` ms on either worker: computed here it
    runs inside a decode step, stalling every stream decoding then and this request's own
    second token, ``(decoding + 1) x t``; shipped, it delays only this request's first token,
    by ``t`` and the write. So it ships when another stream decodes here (``decoding >= 1``)
    and computes it here when none does (the write is saved, and the prefill worker's time)."""
    if mode == "auto":
        return decoding >= 1
    return mode == "prefill"


class PromptKVAsks:
    """Whether a proposer's asks for prompts' draft KV have been answered lately."""

    def __init__(self) -> None:
        self.unanswered = 0  # remote prompts in a row whose reserved draft blocks arrived empty
        self.skipped = 0  # asks ``auto`` left out since it gave up

    def asking(self, mode: str) -> bool:
        """False under ``auto`` once AUTO_GIVE_UP asks in a row went unanswered, but for one ask
        in AUTO_PROBE_EVERY."""
        if mode != "auto" or self.unanswered < AUTO_GIVE_UP:
            return True
        self.skipped += 1
        return self.skipped % AUTO_PROBE_EVERY == 0

    def answered(self, mode: str, shipped: bool) -> None:
        """A remote prompt draft blocks were reserved for arrived, its draft KV written into them
        (``shipped``) or not."""
        if not shipped:
            self.unanswered += 1
            if self.unanswered == AUTO_GIVE_UP and mode == "auto":
                log.warning("draft_prompt_kv auto: %d remote prompts in a row came without their draft KV (do the "
                            "prefill workers run this draft?); asking for 1 in %d from now on", AUTO_GIVE_UP,
                            AUTO_PROBE_EVERY)
            return
        if self.unanswered >= AUTO_GIVE_UP and mode == "auto":
            log.info("draft_prompt_kv auto: a prefill worker shipped a prompt's draft KV; asking for every one again")
        self.unanswered = self.skipped = 0
