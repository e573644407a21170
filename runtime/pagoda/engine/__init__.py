class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; no request can make progress."""
