"""Which LoRA adapter a request runs under (vLLM's ``LoRARequest``, same fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name``: what clients call the adapter (the OpenAI ``model``);
    ``lora_int_id``: its identity, unique per loaded adapter (> 0): it keys the adapter's
    weights in the engine's slots and its prefix-cache entries, so an adapter reloaded
    under the same name from another path never meets the old one's KV;
    ``lora_path``: a PEFT adapter directory, ``file://``, ``pvc://`` or ``hf://`` source."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, not {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_salt(self) -> bytes:
        """What keeps this adapter's KV apart from the base model's and other adapters':
        prefixed to the request's own salt. It starts with a NUL, which a request's own
        salt may not contain, and ends with one, so no salt a client can send, with or
        without an adapter, equals another adapter's."""
        return f"\x00lora:{self.lora_int_id}\x00".encode()
