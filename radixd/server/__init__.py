"""The HTTP/SSE front end: OpenAI-compatible routes on starlette, served by hypercorn on the
same asyncio loop as the engine's batching loop."""
