"""Errors that cross module boundaries, torch-free so every part (server, engine, config) can use them."""


class InvalidParam(ValueError):
    """A bad value for one named field. `param` is the field's name, as the OpenAI error's `param`:
    callers map errors to fields by this attribute, never by matching the message text."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # it crosses processes (the engine core's load errors)
        return type(self), (self.param, str(self))


class RequestFailed(RuntimeError):
    """One request failed inside the engine (and only it): the engine goes on serving the others."""
