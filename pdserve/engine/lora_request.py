"""Which LoRA adapter a request runs with (vLLM's `LoRARequest`), and how it keys the prefix cache.

``LoRARequest(lora_name, lora_int_id, lora_path)``: the name identifies the adapter (the prefix
cache and the KV events use it, as vLLM's block hash does), the id is vLLM's integer handle, the
path a PEFT adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``).
No engine imports: the request (engine/request.py) and the block manager read it.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a block hash folds in for an adapter: ahead of any cache salt, so the same prompt under
# two adapters (or an adapter and the base) never names the same blocks.
LORA_SALT_TAG = b"\x00lora\x00"


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def adapter_id(self) -> int:  # vLLM's alias
        return self.lora_int_id

    @property
    def name(self) -> str:  # vLLM's alias
        return self.lora_name

    @property
    def path(self) -> str:  # vLLM's alias
        return self.lora_path


def lora_salt(salt: bytes | None, lora: LoRARequest | None) -> bytes | None:
    """The prefix-cache salt of a request with adapter ``lora`` and cache salt ``salt``."""
    if lora is None:
        return salt
    return LORA_SALT_TAG + lora.lora_name.encode() + b"\x00" + (salt or b"")
