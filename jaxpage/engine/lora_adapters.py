"""The LoRA adapters requests have named, each read when first named and kept in host memory by its lora_int_id
(vLLM's identity of an adapter), max_cpu_loras of them at most; their device slots are jaxpage.engine.lora_slots'."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError
from jaxpage.lora_request import LoRARequest
from jaxpage.models.lora_adapter import LoRAAdapter, read_lora_adapter
from jaxpage.sources import DEFAULT_DOWNLOAD, HubDownload, is_hub_id, resolve_adapter


def adapter_digest(adapter: LoRAAdapter) -> bytes:
    """sha256 of what the adapter computes (its rank and every weight): the root of its pages' prefix-cache keys."""
    digest = hashlib.sha256(b"lora\x00" + adapter.rank.to_bytes(4, "little"))
    for module in sorted(adapter.weights):
        digest.update(module.encode())
        for weight in adapter.weights[module]:
            digest.update(weight.tobytes())
    return digest.digest()


class LoRAAdapters:
    def __init__(
        self,
        config: ModelConfig,
        max_lora_rank: int,
        enabled: bool,
        max_cpu_loras: int | None = None,
        download: HubDownload = DEFAULT_DOWNLOAD,
    ):
        """The adapters of base model `config`; max_cpu_loras: how many stay read (None: all), the least recently
        named dropped first (read again when a request names it; a request holds its own); download: where an
        adapter named by a Hub id is downloaded to."""
        self.config = config
        self.download = download
        self.max_lora_rank = max_lora_rank
        self.enabled = enabled
        self.max_cpu_loras = max_cpu_loras
        self._identities: dict[int, LoRARequest] = {}  # every id seen: an id names one adapter for good
        self._read: OrderedDict[int, tuple[LoRAAdapter, bytes]] = OrderedDict()  # by id, least recently named first
        self._last_id = 0  # the largest id seen or given out (fresh_id)
        self._lock = threading.Lock()  # requests are prepared on the callers' threads

    @classmethod
    def for_engine(cls, model: ModelConfig, config) -> LoRAAdapters:
        """The adapters of an engine of EngineConfig `config` over `model` (its LoRA arguments)."""
        download = HubDownload(None, config.download_dir)
        return cls(model, config.max_lora_rank, config.enable_lora, config.max_cpu_loras or config.max_loras, download)

    def get(self, request: LoRARequest) -> tuple[LoRAAdapter, bytes]:
        """(the adapter, its digest) of a request's LoRARequest, read from its path (a directory or a Hub id) the
        first time its id is seen.
        ValueError (ModelLoadError for the adapter's files) naming the adapter: LoRA is off, the id is another
        adapter's, or the adapter cannot be served (see read_lora_adapter)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        if not self.enabled:
            raise ValueError(
                f"lora_request {request.lora_name!r}: the engine serves no LoRA adapters; start it with "
                "enable_lora=True"
            )
        lora_id = request.lora_int_id
        with self._lock:
            self._check_identity(request)
            if lora_id in self._read:
                self._read.move_to_end(lora_id)
                return self._read[lora_id]
        # Read without the lock: requests naming adapters already read go on meanwhile.
        path = request.lora_path
        if is_hub_id(path):  # a Hub repo: downloaded, then read from the cache like a local directory
            try:
                path = resolve_adapter(path, self.download)
            except ModelLoadError as e:
                raise ModelLoadError(f"LoRA adapter {request.lora_name!r}: {e}") from None
        adapter = read_lora_adapter(path, self.config, request.lora_name, self.max_lora_rank)
        digest = adapter_digest(adapter)
        with self._lock:
            self._check_identity(request)  # (another thread may have given the id to another adapter meanwhile)
            self._identities[lora_id] = request
            self._read.setdefault(lora_id, (adapter, digest))
            self._read.move_to_end(lora_id)
            while self.max_cpu_loras is not None and len(self._read) > self.max_cpu_loras:
                self._read.popitem(last=False)
            return self._read[lora_id]

    def _check_identity(self, request: LoRARequest) -> None:
        known = self._identities.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}), not "
                f"{request.lora_name!r} ({request.lora_path}): each adapter needs an id of its own"
            )

    def fresh_id(self) -> int:
        """An id no adapter has had in this engine, for an adapter a server or batch job names."""
        with self._lock:
            self._last_id = max([self._last_id, *self._identities]) + 1
            return self._last_id

    def forget(self, lora_int_id: int) -> None:
        """Drops an adapter's weights from host memory (its requests keep theirs); its id stays its own."""
        with self._lock:
            self._read.pop(lora_int_id, None)

    @property
    def num_read(self) -> int:
        """Adapters held read in host memory."""
        return len(self._read)

    def attach(self, seqs: list, request: LoRARequest | None) -> None:
        """Gives a prepared request's sequences their adapter (read here the first time its id comes: see get)."""
        if request is not None:
            adapter, digest = self.get(request)
            for seq in seqs:
                seq.lora_id, seq.lora_adapter, seq.prefix_root = request.lora_int_id, adapter, digest
