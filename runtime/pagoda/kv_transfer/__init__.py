"""KV connectors: moving a request's KV cache between engines (prefill/decode disaggregation), in vLLM V1's
shape. base: the interface; nixl_connector: NixlConnector over NIXL; factory: the one built from the config."""
