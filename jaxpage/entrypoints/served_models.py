"""The names a server or batch job answers to in a request's `model` field: the base model's, and each LoRA adapter's
(vLLM's `--lora-modules`, and adapters loaded while serving through `/v1/load_lora_adapter`).

A request whose `model` is the base model's name (or absent) runs without an adapter; one naming an adapter runs with
it (a LoRARequest: the engine reads the adapter when first named, jaxpage.engine.lora_adapters); any other name is
refused (ModelNotFound: HTTP 404). Adapters get ids the engine never gave another (LoRAAdapters.fresh_id): an adapter
unloaded and loaded again under the same name is a new adapter to the engine (its device slot and prefix-cache pages
are never taken for the old one's). Unloading an adapter ends new requests for it; requests already running finish
with it.
"""

from __future__ import annotations

import dataclasses
import json
import threading

from jaxpage.lora_request import LoRARequest
from jaxpage.validation import check_path, check_text, describe


class ModelNotFound(LookupError):
    """A request's `model` that is neither the base model nor a loaded adapter (HTTP 404)."""


@dataclasses.dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` value: an adapter's name, its PEFT directory, and the base model it names as its parent in
    /v1/models (None: the served base model's name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...} (the last optional);
    ValueError naming the value otherwise."""
    if value.lstrip().startswith("{"):
        try:
            fields = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {describe(value)}: not JSON ({e.msg})") from None
        unknown = set(fields) - {"name", "path", "base_model_name"} if isinstance(fields, dict) else None
        if unknown is None or unknown or not {"name", "path"} <= set(fields):
            problem = f"unknown keys {sorted(unknown)}" if unknown else 'expected {"name", "path", "base_model_name"}'
            raise ValueError(f"--lora-modules {describe(value)}: {problem}")
        base = fields.get("base_model_name")
        name, path = fields["name"], fields["path"]
        base = None if base is None else check_text("--lora-modules base_model_name", base)
    else:
        name, equals, path = value.partition("=")
        if not equals or not name or not path:
            raise ValueError(f"--lora-modules {describe(value)}: expected name=path or a JSON object")
        base = None
    return LoRAModule(check_text("--lora-modules name", name), check_path("--lora-modules path", path), base)


class ServedModels:
    def __init__(
        self, base_names: str | list[str], engine, lora_modules: list[LoRAModule] = (), root: str | None = None
    ):
        """The base model served under `base_names` (vLLM's --served-model-name: one or several, the first is the
        model's name where a request gives none) by `engine` (an LLMEngine; root: where its weights come from, for
        /v1/models), and the adapters of `lora_modules`, each read and checked now (ModelLoadError, ValueError naming
        the adapter)."""
        self.base_names = [base_names] if isinstance(base_names, str) else list(base_names)
        self.base_name, self.root = self.base_names[0], root
        self._adapters = engine.input_processor.lora_adapters  # jaxpage.engine.lora_adapters.LoRAAdapters
        self._served: dict[str, tuple[LoRARequest, str | None]] = {}  # name -> (its request, its parent's name)
        self._loading: set[str] = set()  # names of adapters being read (not served yet, not to be taken)
        self._lock = threading.Lock()  # loads and unloads come from the server's handlers' threads
        for module in lora_modules:
            self.load(module.name, module.path, module.base_model_name)

    def lora_request(self, model) -> LoRARequest | None:
        """The adapter a request's `model` field names (None: the base model, or no name); ModelNotFound otherwise."""
        if model is None or model in self.base_names:
            return None
        with self._lock:
            served = self._served.get(model) if isinstance(model, str) else None
            if served is None:
                names = ", ".join(repr(n) for n in [*self.base_names, *self._served])
                raise ModelNotFound(f"model {describe(model)} does not exist (this server has {names})")
            return served[0]

    def name_of(self, lora_request: LoRARequest | None, asked=None) -> str:
        """The model name a response gives for a request through `lora_request` (None: the base model's: the name
        the request `asked` for, where it is one of base_names, else the first)."""
        if lora_request is not None:
            return lora_request.lora_name
        return asked if asked in self.base_names else self.base_name

    def load(self, name, path, base_model_name: str | None = None) -> LoRARequest:
        """Serves the PEFT adapter in directory `path` as `name` (read and checked now, on the caller's thread).
        ValueError when LoRA is off, the name is taken (the base model's, or an adapter's), or the adapter cannot be
        served (ModelLoadError, naming it)."""
        name = check_text("lora_name", name)
        path = check_path("lora_path", path)
        if not self._adapters.enabled:
            raise ValueError(f"LoRA adapter {name!r}: this server serves no LoRA adapters; start it with --enable-lora")
        with self._lock:
            if name in self.base_names or name in self._served or name in self._loading:
                owner = "the base model" if name in self.base_names else "an adapter"
                raise ValueError(f"LoRA adapter {name!r}: the name is taken by {owner}")
            self._loading.add(name)
            request = LoRARequest(name, self._adapters.fresh_id(), path)
        try:
            self._adapters.get(request)  # read now: a bad adapter is refused here, not by its first request
            with self._lock:
                self._served[name] = request, base_model_name
        finally:
            with self._lock:
                self._loading.discard(name)
        return request

    def unload(self, name) -> None:
        """Stops serving adapter `name` (ModelNotFound if it is not served): new requests naming it are refused,
        running ones finish with it, and its weights leave host memory."""
        with self._lock:
            served = self._served.pop(name, None) if isinstance(name, str) else None
        if served is None:
            raise ModelNotFound(f"LoRA adapter {describe(name)} is not loaded")
        self._adapters.forget(served[0].lora_int_id)

    def cards(self, max_model_len: int) -> list[dict]:
        """/v1/models' entries, as vLLM lists them: the base model, then each adapter with its base as parent."""
        base = dict(object="model", owned_by="jaxpage", max_model_len=max_model_len)
        with self._lock:
            served = list(self._served.values())
        return [{"id": name, **base, "root": self.root, "parent": None} for name in self.base_names] + [
            {"id": r.lora_name, **base, "root": r.lora_path, "parent": parent or self.base_name} for r, parent in served
        ]
