"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA endpoints.

    load    {"lora_name", "lora_path"}  the workers read and check the adapter (one replica per pool,
                                        Backend.check_adapter) before its name is served; every
                                        worker registers it from the first request that names it
                                        (the request carries its path)
    unload  {"lora_name"}               new requests for it get 404 at once, running ones finish

Allowed where `engine.lora.allow_runtime_updates` is set (else 403), to admin keys where keys are
configured. With several ingress replicas the names are kept in the app's AdapterRegistry
(ModelCatalog.adapter_sync), so a name is loaded once across them. Plain-text answers, as vLLM's;
failures in OpenAI's error shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import PurePosixPath

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from serving.api.backend import Backend
from serving.api.endpoints.http_io import error_response, read_json
from serving.api.endpoints.models import ModelCatalog
from serving.api.errors import APIError, to_api_error
from serving.config import ServeConfig
from serving.config.access import APIKey
from serving.engine.errors import InvalidRequestError

__all__ = ["AdapterUpdates"]

logger = logging.getLogger(__name__)


class AdapterUpdates:
    """The two endpoints over one app's ModelCatalog and Backend."""

    def __init__(self, models: ModelCatalog, backend: Backend, config: ServeConfig,
                 authenticate: Callable[[Request], APIKey], *, has_keys: bool):
        self.models = models
        self.backend = backend
        self.config = config
        self.authenticate = authenticate
        self.has_keys = has_keys

    async def __call__(self, request: Request, *, load: bool) -> Response:
        try:
            self._check_allowed(self.authenticate(request))
            body = await read_json(request, self.config.max_request_body_bytes)
            name = _adapter_field(body, "lora_name")
            if load:
                return await self._load(name, str(PurePosixPath(_adapter_field(body, "lora_path"))))  # as the engines spell it
            return await self._unload(name)
        except Exception as exc:  # noqa: BLE001 - every failure is an HTTP answer
            error = to_api_error(exc)
            if error.status >= 500:
                logger.exception("%s failed", request.url.path)
            return error_response(error)

    def _check_allowed(self, key: APIKey) -> None:
        lora = self.config.lora
        if lora is None or not lora.allow_runtime_updates:
            raise APIError(403, "Adapters are not loaded or unloaded at run time here: set "
                           "engine.lora.allow_runtime_updates: true in the serve config.",
                           type="permission_error", code="runtime_lora_updates_disabled")
        if self.has_keys and not key.is_admin:
            raise APIError(403, "Loading and unloading LoRA adapters needs an admin key (admin_api_keys).",
                           type="permission_error", code="admin_key_required")

    async def _unload(self, name: str) -> Response:
        models = self.models
        if name in models.static_adapters:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is listed in engine.lora.adapters; "
                                      "remove it from the serve config instead")
        if models.adapter_sync is not None:
            await models.adapter_sync.refresh()
        if name not in models.runtime_adapters:
            raise APIError(404, f"The lora adapter {name!r} cannot be found.", param="lora_name",
                           code="lora_adapter_not_found")
        if models.adapter_sync is not None:
            await models.adapter_sync.unload(name)
        models.runtime_adapters.pop(name, None)
        logger.info("LoRA adapter %r unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _load(self, name: str, path: str) -> Response:
        models = self.models
        if name == models.model_name or ":" in name:
            raise InvalidRequestError("lora_name", f"{name!r} cannot name an adapter: it is the base model's "
                                      "name or holds ':' (base:adapter is how requests name adapters)")
        if models.adapter_sync is not None:
            await models.adapter_sync.refresh()
        self._check_not_loaded(name)
        await self.backend.check_adapter(name, path)
        self._check_not_loaded(name)  # another load of the name finished while this one was checked
        if models.adapter_sync is not None:
            taken = await models.adapter_sync.load(name, path)
            if taken is not None:  # another replica loaded the name meanwhile
                raise InvalidRequestError("lora_name", f"adapter {name!r} is already loaded (from {taken}); "
                                          "unload it first")
        models.runtime_adapters[name] = path
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    def _check_not_loaded(self, name: str) -> None:
        if name in self.models.adapters:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is already loaded (from "
                                      f"{self.models.adapters[name]}); unload it first")


def _adapter_field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip() or len(value) > 4096:
        raise InvalidRequestError(name, f"must be a non-empty string (at most 4096 characters); got {value!r:.80}")
    return value.strip()
