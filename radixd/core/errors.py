"""Exceptions the engine raises for bad requests; each names the offending field."""


class RadixdError(Exception):
    """Base of radixd's own exceptions."""


class InvalidRequest(RadixdError, ValueError):
    """A request parameter is missing, of the wrong type or out of range.

    ``field`` names the parameter so front ends can report it (OpenAI's ``param``).
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus the tokens to generate) does not fit the model's context."""

    def __init__(self, field: str, prompt_tokens: int, limit: int, message: str):
        super().__init__(field, message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class ConfigError(RadixdError, ValueError):
    """A configuration value is not allowed; the message names key, value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str):
        super().__init__(f"config key {key!r}: got {value!r}; allowed: {allowed}")
        self.key = key
        self.value = value
        self.allowed = allowed


class EngineStopped(RadixdError):
    """The engine is shutting down and accepts no new requests."""
