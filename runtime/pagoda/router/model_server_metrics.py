"""The model-server metrics the Gateway API Inference Extension reads (its Model Server Protocol), read as
it says: the queue (`vllm:num_requests_waiting`), KV-cache use (`vllm:kv_cache_usage_perc`, or V0's
`vllm:gpu_cache_usage_perc`) and, for LoRA, the newest `vllm:lora_requests_info` sample (its value is when
it was last updated) with `max_lora` and the comma-separated `running_lora_adapters` / `waiting_lora_adapters`.
`pagoda serve --metrics-vllm-names` publishes them; so does vLLM, so the router can stand in front of either."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass
class ModelServerMetrics:
    waiting: float | None = None
    kv_usage: float | None = None
    max_lora: int | None = None
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)


def _adapters(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def read_model_server_metrics(text: str) -> ModelServerMetrics:
    found = ModelServerMetrics()
    newest = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_waiting":
                found.waiting = (found.waiting or 0.0) + sample.value
            elif sample.name in KV_USAGE and found.kv_usage is None:
                found.kv_usage = sample.value
            elif sample.name == "vllm:lora_requests_info" and (newest is None or sample.value >= newest):
                newest = sample.value
                found.max_lora = int(sample.labels.get("max_lora", "0") or 0)
                found.running_lora_adapters = _adapters(sample.labels.get("running_lora_adapters", ""))
                found.waiting_lora_adapters = _adapters(sample.labels.get("waiting_lora_adapters", ""))
    return found
