"""The SGLang engine: the client (`client.SGLangEngine`) over SGLang HTTP workers, its worker pool, weight
transports, launcher and router, the `/generate` wire format, health checks, FP8 export rules, and `serve`, the
embedded engine behind the same HTTP API."""
