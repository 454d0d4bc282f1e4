"""LoRA adapters on a running engine: those of --lora-modules, read at start, and with runtime
updating on (--allow-runtime-lora-updating), those vLLM's `POST /v1/load_lora_adapter` adds and
`POST /v1/unload_lora_adapter` removes.

Who owns what: the router (rust/router/src/lora.rs) owns the names and indices, the model
(models/lora.py) the weights, and the engine thread when the weights of an unloaded adapter
go. A load reads and composes the weights on a worker thread, reserves an index, installs the
weights under it (no step names that index yet, so the running model is not disturbed) and
then publishes the name. An unload retires the name at once (new requests get 404) and posts
the index to the engine thread, which frees the weights once no request holds the index (its
published stats list them, `loras_in_use`) and tells the router to forget it. A request
admitted with an index whose weights are gone (it was validated just before the unload) is
failed with a 404 when the engine thread takes it (`EngineThread._apply`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Callable

import torch

from llmserve.loaders.checkpoint import LoadError
from llmserve.loaders.load import DEFAULT_MODEL_REPO
from llmserve.models.lora import LoraError

log = logging.getLogger("llmserve.engine")


def adapter_fingerprint(base: str, adapter) -> str:
    """An adapter's `system_fingerprint`: the base model's, and the adapter's own weights."""
    h = hashlib.sha256(base.encode())
    for key in sorted(adapter.weights):
        h.update(repr(key).encode())
        for t in adapter.weights[key]:
            h.update(t.contiguous().numpy().tobytes())
    return "fp_" + h.hexdigest()[:10]


def read_adapter(name: str, path: str, hf_config: dict):
    """The PEFT adapter at `path` (a folder, or a Hugging Face id: fetched) for the model of
    `hf_config`, as models/lora.Adapter; raises LoraError naming the adapter (AdapterMissing
    when `path` is no folder and no hub id)."""
    from llmserve.loaders.load import local_folder
    from llmserve.models import lora

    try:
        folder = local_folder(path, log)
    except LoadError as exc:
        # (a hub error is several lines of the library's text: its first says what happened)
        said = str(exc).splitlines()[0] if str(exc) else "not found"
        raise AdapterMissing(f"LoRA adapter {name!r}: {said[:500]}") from None
    adapter = lora.load_adapter(name, str(folder), hf_config)
    # (vLLM reads an adapter's own tokenizer, for tokens it adds; this server tokenizes every
    # request with the base model's)
    if unused := sorted(f.name for f in folder.glob("tokenizer*") if f.is_file()):
        log.warning("LoRA adapter %r: %s not used: its requests are tokenized (and rendered) as the "
                    "base model's", name, ", ".join(unused))
    return adapter


def resolver_bases(served_names: list[str], model: str | None) -> set[str]:
    """The `base_model_name_or_path` values an adapter --lora-resolver-dir finds may name: the
    served names and the model as given, or for the default model the Hub repository its
    weights come from (what PEFT writes for an adapter trained on it)."""
    return {*served_names, model or DEFAULT_MODEL_REPO}


class AdapterMissing(LoraError):
    """An adapter path that is neither a folder here nor a Hugging Face id."""


class Adapters:
    """The model's LoRA adapters, for loading and unloading them while it serves. `retire`
    (set by the AsyncEngine) hands an unloaded adapter's index to the engine thread."""

    def __init__(self, model: torch.nn.Module, hf_config: dict, dtype: torch.dtype, device: torch.device,
                 fingerprint: str | None) -> None:
        self.model, self.hf_config, self.dtype, self.device = model, hf_config, dtype, device
        self.fingerprint = fingerprint   # (the base model's: an adapter's adds its weights)
        self.retire: Callable[[int], None] = lambda index: None
        self._loading: asyncio.Lock | None = None

    def installed(self, index: int) -> bool:
        return index in (getattr(self.model, "lora_adapters", None) or {})

    async def load(self, router, body: bytes) -> tuple[str, list]:
        """`POST /v1/load_lora_adapter`: (the answer's text, its headers), or raises ApiError.
        Loads run one at a time, so two of one name never both read their weights."""
        from llmserve._core import Router
        from llmserve.models import lora

        name, path, inplace, headers = router.check_lora_load(body)
        self._loading = self._loading or asyncio.Lock()
        async with self._loading:
            router.check_lora_load(body)   # (again: a load of this name may have ended meanwhile)
            try:
                adapter, composed, fingerprint = await asyncio.to_thread(self._read, name, path)
            except AdapterMissing as exc:
                raise Router.error("not_found", str(exc)) from None
            except LoraError as exc:
                raise Router.error("invalid_request", str(exc), param="lora_path") from None
            except (torch.OutOfMemoryError, MemoryError):
                # (the KV cache took the device's memory it was given: adapters take the rest)
                raise Router.error("invalid_request", f"LoRA adapter {name!r} does not fit in the memory left on "
                                   f"{self.device}: unload an adapter first, or start the server with a smaller "
                                   "KV cache", param="lora_path") from None
            index = router.reserve_lora()
            lora.install(self.model, index, adapter, composed)
            try:
                replaced = router.publish_lora(index, name, path, fingerprint, inplace)
            except BaseException:
                lora.remove(self.model, index)
                raise
        if replaced is not None:
            self.retire(replaced)
        log.info("LoRA adapter %r loaded from %s (rank %d)%s", name, path, adapter.rank,
                 ", in place of the one of that name" if replaced is not None else "")
        # (vLLM's words, which its clients and tests read; also for load_inplace)
        return f"Success: LoRA adapter '{name}' added successfully.", headers

    async def resolve(self, router, name: str, folder: str, bases: set[str]) -> bool:
        """vLLM's filesystem LoRA resolver: a request named `name`, which no served model has,
        and `folder` (--lora-resolver-dir) holds a subfolder `name` whose adapter_config.json is
        a LoRA made for one of `bases` (base_model_name_or_path): it is loaded and served under
        `name`. Whether it now is (False: the name stays unknown, a 404). An adapter found but
        that cannot be served raises its 400 at `model`, as a load does at `lora_path`.

        `name` must be the subfolder's path as written plainly (`org/adapter`, not `adapter/`,
        `./adapter` or `x/../adapter`): every other spelling of a folder would load its weights
        again under another name."""
        from llmserve._core import BadRequestError, Router

        parts = name.split("/")
        if os.path.isabs(name) or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
            return False
        root = os.path.realpath(folder)
        path = os.path.realpath(os.path.join(root, *parts))
        if os.path.commonpath([root, path]) != root or path == root:
            return False
        try:
            with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        if not isinstance(config, dict):
            return False
        base, kind = config.get("base_model_name_or_path"), config.get("peft_type", "LORA")
        if not (isinstance(base, str) and base in bases and kind == "LORA"):
            # (the client gets vLLM's 404; whoever runs the server learns why)
            log.warning("LoRA adapter %r in %s not served: its adapter_config.json has base_model_name_or_path "
                        "%r and peft_type %r; this server serves LoRA adapters of %s", name, path, base, kind,
                        ", ".join(sorted(bases)))
            return False
        body = json.dumps({"lora_name": name, "lora_path": path}).encode()
        try:
            await self.load(router, body)
        except BadRequestError as exc:
            if exc.code == "lora_adapter_exists":   # (another request loaded it meanwhile)
                pass
            elif exc.param == "lora_path":   # (the client named no path: its `model` cannot be served)
                raise Router.error("invalid_request", exc.message, param="model") from None
            else:
                raise
        log.info("LoRA adapter %r resolved from %s", name, path)
        return True

    def unload(self, router, body: bytes) -> tuple[str, list]:
        """`POST /v1/unload_lora_adapter`: (the answer's text, its headers), or raises ApiError
        (404 for a name not loaded). Its requests already admitted run to their end."""
        index, name, headers = router.unload_lora(body)
        self.retire(index)
        log.info("LoRA adapter %r unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully.", headers

    def free(self, router, index: int) -> None:
        """On the engine thread, once no request holds `index`: frees its weights."""
        from llmserve.models import lora

        lora.remove(self.model, index)
        router.forget_lora(index)

    def _read(self, name: str, path: str):
        from llmserve.models import lora

        adapter = read_adapter(name, path, self.hf_config)
        fingerprint = adapter_fingerprint(self.fingerprint, adapter) if self.fingerprint else None
        return adapter, lora.compose(self.model, adapter, self.dtype, self.device), fingerprint
