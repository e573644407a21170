"""The engine's side of adapters: every LoRARequest is checked (and a Hub id downloaded) once, before its
first request is queued, so a bad adapter fails that request alone with a message naming what is wrong."""

import dataclasses
import os

from pagoda.config.configs import LoRAConfig
from pagoda.errors import InvalidParam
from pagoda.lora.adapter import AdapterInfo, check_adapter
from pagoda.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, hf_config):
        self.config = config
        self.hf_config = hf_config
        # by lora_int_id: the request as the user gave it, as resolved (a local lora_path), what was found
        self.adapters: dict[int, tuple[LoRARequest, LoRARequest, AdapterInfo]] = {}

    def resolve(self, request: LoRARequest | None) -> LoRARequest | None:
        """The request with a local lora_path, checked; InvalidParam("lora_request") when it cannot run."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise InvalidParam("lora_request", f"lora_request must be a LoRARequest; got {type(request).__name__}")
        if self.config is None:
            raise InvalidParam("lora_request", f"adapter {request.lora_name!r}: the engine runs without LoRA; "
                                               "start it with enable_lora=True (--enable-lora)")
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            given, resolved, _ = known
            if request not in (given, resolved):
                raise InvalidParam("lora_request", f"lora_int_id {request.lora_int_id} already names adapter "
                                                   f"{given.lora_name!r} ({given.lora_path}); give each adapter "
                                                   "its own id")
            return resolved
        path = request.lora_path
        if not os.path.isdir(path):
            from pagoda.config.hub import download_adapter, is_repo_id

            if not is_repo_id(path):
                raise InvalidParam("lora_request", f"adapter {request.lora_name!r}: {path!r} is neither a "
                                                   "directory nor a Hub id")
            try:
                path = download_adapter(path)
            except ValueError as e:
                raise InvalidParam("lora_request", f"adapter {request.lora_name!r}: {e}") from None
        info = check_adapter(path, self.hf_config, self.config.max_lora_rank)
        resolved = dataclasses.replace(request, lora_path=path)
        self.adapters[request.lora_int_id] = (request, resolved, info)
        return resolved
