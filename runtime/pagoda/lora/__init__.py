"""Multi-LoRA serving: adapters named per request (request.py), checked and read from PEFT directories
(adapter.py), held in device slots with an LRU of host copies (manager.py), and applied to a whole batch of
mixed adapters by one hook on the linear layers: shrink then expand per adapter's rows (ops.py)."""
