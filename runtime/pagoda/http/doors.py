"""The server's doors whose own request body `POST /tokenize` renders as the door does (`endpoint` names the
door, `request` carries its body): the precise router sends each request so, and hashes what comes back."""

TOKENIZE_ENDPOINTS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
