"""The request for an adapter, vLLM's LoRARequest (torch-free: it travels with a request across processes)."""

from dataclasses import dataclass

from pagoda.errors import InvalidParam


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to run a request with. lora_int_id identifies the adapter: requests with the same id share
    its device slot and their prefix-cache blocks; it must be >= 1 and always name the same lora_path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidParam("lora_request", f"lora_int_id must be an integer >= 1; got {self.lora_int_id!r}")
        if not self.lora_path:
            raise InvalidParam("lora_request", f"adapter {self.lora_name!r}: lora_path is empty")
