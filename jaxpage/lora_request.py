"""LoRARequest: which LoRA adapter a request runs with, in vLLM's names."""

from __future__ import annotations

import dataclasses

from jaxpage.validation import check_int, check_path, check_text


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request, vLLM's fields:

    lora_name:   the adapter's name (a non-empty string); what responses and messages call it.
    lora_int_id: a positive integer, unique to the adapter: the id under which the engine keeps its weights.
    lora_path:   the directory Hugging Face PEFT saved it in (adapter_config.json + adapter_model.safetensors).

    Checked here for form; the adapter itself is read, and checked against the model, when the engine first needs it
    (jaxpage.models.lora_adapter.read_lora_adapter).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        check_text("LoRARequest.lora_name", self.lora_name)
        # kept as Python int and str (a numpy integer, a path-like object): the request stays plain, hashable data
        object.__setattr__(self, "lora_int_id", check_int("LoRARequest.lora_int_id", self.lora_int_id, minimum=1))
        object.__setattr__(self, "lora_path", check_path("LoRARequest.lora_path", self.lora_path))
