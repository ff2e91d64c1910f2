"""The LoRA adapters requests have named, each read once and kept in host memory by its lora_int_id (vLLM's
identity of an adapter); their device slots are jaxpage.engine.lora_slots'."""

from __future__ import annotations

import hashlib
import threading

from jaxpage.config import ModelConfig
from jaxpage.lora_request import LoRARequest
from jaxpage.models.lora_adapter import LoRAAdapter, read_lora_adapter


def adapter_digest(adapter: LoRAAdapter) -> bytes:
    """sha256 of what the adapter computes (its rank and every weight): the root of its pages' prefix-cache keys."""
    digest = hashlib.sha256(b"lora\x00" + adapter.rank.to_bytes(4, "little"))
    for module in sorted(adapter.weights):
        digest.update(module.encode())
        for weight in adapter.weights[module]:
            digest.update(weight.tobytes())
    return digest.digest()


class LoRAAdapters:
    def __init__(self, config: ModelConfig, max_lora_rank: int, enabled: bool):
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.enabled = enabled
        self._known: dict[int, tuple[LoRARequest, LoRAAdapter, bytes]] = {}
        self._lock = threading.Lock()  # requests are prepared on the callers' threads

    def get(self, request: LoRARequest) -> tuple[LoRAAdapter, bytes]:
        """(the adapter, its digest) of a request's LoRARequest, read from its path the first time its id is seen.
        ValueError (ModelLoadError for the adapter's files) naming the adapter: LoRA is off, the id is another
        adapter's, or the adapter cannot be served (see read_lora_adapter)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        if not self.enabled:
            raise ValueError(
                f"lora_request {request.lora_name!r}: the engine serves no LoRA adapters; start it with "
                "enable_lora=True"
            )
        with self._lock:
            known = self._known.get(request.lora_int_id)
            if known is not None:
                if (known[0].lora_name, known[0].lora_path) != (request.lora_name, request.lora_path):
                    raise ValueError(
                        f"lora_int_id {request.lora_int_id} is adapter {known[0].lora_name!r} ({known[0].lora_path}), "
                        f"not {request.lora_name!r} ({request.lora_path}): each adapter needs an id of its own"
                    )
                return known[1], known[2]
            adapter = read_lora_adapter(request.lora_path, self.config, request.lora_name, self.max_lora_rank)
            self._known[request.lora_int_id] = (request, adapter, adapter_digest(adapter))
            return adapter, self._known[request.lora_int_id][2]

    def attach(self, seqs: list, request: LoRARequest | None) -> None:
        """Gives a prepared request's sequences their adapter (read here the first time its id comes: see get)."""
        if request is not None:
            adapter, digest = self.get(request)
            for seq in seqs:
                seq.lora_id, seq.lora_adapter, seq.prefix_root = request.lora_int_id, adapter, digest
