"""The engine core: models, KV memory, radix cache, scheduler, sampling.

Importable without the server packages (starlette, hypercorn, structlog, ...).
"""
