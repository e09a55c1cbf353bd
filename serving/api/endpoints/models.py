"""The models one app serves, and who may use which: its base model and its LoRA adapters (the
config's, and those loaded at run time), as a request's `model` names them and as /v1/models
lists them.

    request.model ──ModelCatalog.resolve(model, key)──▶ the LoRA adapter it names, None for the
                                                        base model, or 404 model_not_found
        "tiny"              the base model
        "sql" / "tiny:sql"  the adapter `sql` (the adapter, or base:adapter)
        anything else       404; so is a model the key's tier may not use (`tiers.<tier>.models`)

A name it does not know is looked up once more in the app's AdapterRegistry where there is one
(`adapter_sync`, serving/deployments/adapter_registry.py): another ingress replica may have just
loaded it. Loading and unloading at run time is serving/api/endpoints/adapters.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from serving.api.errors import APIError, ModelNotFoundError
from serving.api.generation.pipeline import Frontend
from serving.config import ServeConfig
from serving.config.access import APIKey

__all__ = ["ModelCatalog"]

logger = logging.getLogger(__name__)


class ModelCatalog:
    """The served model's name, its adapters (name -> PEFT path) and the tiers' allow-lists."""

    def __init__(self, config: ServeConfig, frontend: Frontend):
        self.model_name = config.model_name
        self._tiers = config.tiers
        self._frontend = frontend  # for the base model's card: its max_model_len
        lora = config.lora  # the pools agree on it (HANDOFF_KEYS)
        self.static_adapters: dict[str, str] = dict(lora.adapters) if lora is not None else {}
        # those loaded at run time (POST /v1/load_lora_adapter); with several ingress replicas, a
        # copy of the app's AdapterRegistry kept by `adapter_sync` (serving/deployments/adapter_registry.py)
        self.runtime_adapters: dict[str, str] = {}
        self.adapter_sync: Any = None
        self._created = int(time.time())

    @property
    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter served: name -> PEFT path (the config's, then those loaded at run time)."""
        return {**self.runtime_adapters, **self.static_adapters}

    def path_of(self, lora: str | None) -> str | None:
        """The PEFT path of the adapter `lora` (None: the base model, or an adapter just unloaded)."""
        return self.adapters.get(lora)

    def may_use(self, key: APIKey, model: str) -> bool:
        allowed = self._tiers[key.tier].models
        return allowed is None or model in allowed

    async def resolve(self, model: str | None, key: APIKey) -> str | None:
        """check; a name it does not know is looked up once more in the AdapterRegistry where there
        is one (another ingress replica may have just loaded it)."""
        try:
            return self.check(model, key)
        except ModelNotFoundError:
            if self.adapter_sync is None or not await self.adapter_sync.refresh():
                raise
            return self.check(model, key)

    def check(self, model: str | None, key: APIKey) -> str | None:
        """The LoRA adapter a request's `model` names (the adapter, or `base:adapter`), None for the
        base model. A model this app does not serve, or one the key's tier may not use: 404, as
        OpenAI answers both (it does not say which models exist to a key that may not use them).
        A tier's `models` lists adapters by name."""
        lora = None
        if model is not None and model != self.model_name:
            base, _, adapter = model.partition(":")
            lora = model if model in self.adapters else adapter if base == self.model_name and adapter in self.adapters else None
            if lora is None:
                served = [m for m in [self.model_name, *sorted(self.adapters)] if self.may_use(key, m)]
                raise ModelNotFoundError(model, served)
        if not self.may_use(key, lora or self.model_name):
            raise ModelNotFoundError(model or self.model_name, [])
        return lora

    # ---- /v1/models ------------------------------------------------------------------------------
    async def listing(self, key: APIKey) -> dict:
        """GET /v1/models: the cards of the models the key may use, the base model first."""
        base = [await self._model_card()] if self.may_use(key, self.model_name) else []
        adapters = [self._adapter_card(name) for name in sorted(self.adapters) if self.may_use(key, name)]
        return {"object": "list", "data": base + adapters}

    async def card(self, model: str, key: APIKey) -> dict:
        """GET /v1/models/{model}: one card, or 404 as for a request naming it."""
        lora = await self.resolve(model, key)
        return await self._model_card() if lora is None else self._adapter_card(lora)

    def _adapter_card(self, name: str) -> dict:
        """A LoRA adapter in /v1/models, as vLLM lists one: its base model as parent."""
        return {"id": name, "object": "model", "created": self._created, "owned_by": "kvrelay",
                "root": self.adapters[name], "parent": self.model_name}

    async def _model_card(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "kvrelay"}
        try:
            card["max_model_len"] = (await self._frontend.model_info()).max_model_len  # as vLLM's cards
        except APIError as exc:  # no live replica to ask (a request would get this 503): listed without it
            logger.warning("the model card of %s has no max_model_len: %s", self.model_name, exc.message)
        return card
