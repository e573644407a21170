"""What the OpenAI server (entrypoints) and the router share about HTTP: OpenAI's error shape and the
`X-Request-Id` middleware. It sits below both, so the router never imports the server."""
