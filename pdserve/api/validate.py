"""Request validation at the edge (a decode worker's or a gateway's `Surface`): every field checked, every size bounded
before the work it bounds (ServingLimits), the prompt tokenized. Pure CPU work that
touches no engine state: the surface runs it in its tokenizer pool, off the event loop.
Refusals are `RequestError`s naming the field."""

from __future__ import annotations

import dataclasses
import json

from pdserve.common import Priority
from pdserve.engine import InvalidRequestError, SamplingParams, check_text
from pdserve.engine.prompts import PromptChecker, check_resume_ids

from .adapters import Adapters
from .ingress import REQUEST_ID_CHARS, GenerateInput, RequestError, ServingLimits


def check_privileges(inp: GenerateInput) -> None:
    """Route overrides and priority above normal are an operator key's (only while API
    keys are on: ``inp.caller`` None means nothing is checked). Cheap: runs before tokenizing."""
    caller = inp.caller
    if caller is None or caller.operator:
        return
    if inp.route != "auto":
        raise RequestError("permission_denied", f"route: {inp.route!r} overrides the router and needs an operator "
                           "API key (marked `operator` in the keys file); leave route at auto", "route")
    try:
        prio = Priority.parse(inp.priority)
    except ValueError:
        return  # not a priority at all: validation names it
    if prio < Priority.NORMAL:
        raise RequestError("permission_denied", f"priority: {prio.label!r} is above normal and needs an operator "
                           "API key (marked `operator` in the keys file); use normal or low", "priority")


class Validator:
    """Checks requests for one model (its vocabulary, context length, tokenizer: a
    `PromptChecker`, an engine's or a gateway's)."""

    def __init__(self, checker: PromptChecker, limits: ServingLimits, served_model: str, max_prompt_chars: int):
        self.eng = checker
        self.limits = limits
        self.served_model = served_model
        self.max_prompt_chars = max_prompt_chars
        # The LoRA adapters a request's model may name (api/adapters.py); None: the model alone.
        self.adapters: Adapters | None = None

    def validate(self, inp: GenerateInput) -> tuple[list[int], SamplingParams, int]:
        """Check and tokenize one request (CPU work: call it off the event loop, see
        `generate`). Every size is checked before the work it bounds."""
        eng = self.eng
        lim = self.limits
        rid = inp.request_id
        if rid is not None:
            if not isinstance(rid, str) or not 0 < len(rid) <= lim.max_request_id_chars \
                    or not REQUEST_ID_CHARS.fullmatch(rid):
                raise RequestError("invalid_argument",
                                   f"request_id: must be 1-{lim.max_request_id_chars} characters of "
                                   "A-Z a-z 0-9 . _ : @ / + = -", "request_id")
        if inp.model and inp.model != self.served_model and (self.adapters is None or inp.model not in self.adapters):
            more = f" and the LoRA adapters {sorted(self.adapters.served)}" if self.adapters else ""
            raise RequestError("not_found", f"model: the model {inp.model!r} does not exist here; this worker "
                               f"serves {self.served_model!r}{more}", "model")
        if inp.route not in ("auto", "local", "remote"):
            raise RequestError("invalid_argument", f"route: {inp.route!r}; use auto, local or remote", "route")
        if inp.ttft_slo_ms is not None and not inp.ttft_slo_ms > 0:
            raise RequestError("invalid_argument", f"ttft_slo_ms: must be > 0, got {inp.ttft_slo_ms}", "ttft_slo_ms")
        try:
            # Parameters first: a bad one is refused before the prompt costs anything.
            inp.params.validate(eng.vocab_size, lim.request)
            prompt = self._chat_prompt(inp.messages, inp.tools) if inp.messages is not None else inp.prompt
            if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
                raise InvalidRequestError(
                    "messages" if inp.messages is not None else "prompt",
                    f"has {len(prompt)} characters; this worker takes at most {self.max_prompt_chars} "
                    f"(max_model_len {eng.max_model_len} tokens)")
            ids, params, prio = eng.validate_input(prompt, inp.params, inp.priority, lim.request)
        except InvalidRequestError as exc:
            # The engine names a bad token id "prompt_token_ids"; the client sent it as the
            # prompt, or sent the messages that became it.
            err = RequestError("invalid_argument", str(exc), exc.field)
            client = "messages" if inp.messages is not None else "prompt"
            raise err.renamed({"prompt_token_ids": client, "prompt": client}) from None
        room = eng.max_model_len - len(ids)
        if inp.fill_context:
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        if params.max_tokens > room:
            raise RequestError(
                "invalid_argument",
                f"max_tokens: {params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
                f"max_model_len {eng.max_model_len}; use max_tokens <= {room}", "max_tokens")
        if inp.resume_ids is not None:
            try:
                check_resume_ids(inp.resume_ids, len(ids), params.max_tokens, eng.max_model_len,
                                 eng.vocab_size)
            except InvalidRequestError as exc:
                raise RequestError("invalid_argument", str(exc), exc.field) from None
        return ids, params, prio

    def _chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render chat messages (and the tools, HF's ``tools``) with the model's template, then
        tokenize (the template already holds BOS, so no special tokens are added again). Every
        text is checked, and all of them together bounded, before the template runs."""
        if len(messages) > self.limits.max_messages:
            raise InvalidRequestError("messages", f"{len(messages)} messages; at most {self.limits.max_messages}")
        total = 0
        for i, m in enumerate(messages):
            check_text(f"messages[{i}].content", m["content"])
            check_text(f"messages[{i}].role", m["role"])
            total += len(m["content"])
            for key in ("tool_call_id", "name"):
                if key in m:
                    check_text(f"messages[{i}].{key}", m[key])
                    total += len(m[key])
            for j, call in enumerate(m.get("tool_calls") or ()):
                text = json.dumps(call, ensure_ascii=False)
                check_text(f"messages[{i}].tool_calls[{j}]", text)
                total += len(text)
        if tools:
            text = json.dumps(tools, ensure_ascii=False)
            check_text("tools", text)
            total += len(text)
        if total > self.max_prompt_chars:
            raise InvalidRequestError("messages", f"hold {total} characters; this worker takes at most "
                                      f"{self.max_prompt_chars}")
        tokenizer = self.eng.tokenizer
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools)
        except ValueError as exc:
            raise InvalidRequestError("messages", str(exc).removeprefix("messages: ")) from None
        return tokenizer.encode(text, add_special_tokens=False)
