"""The OpenAI-compatible HTTP server: `jserve serve`, or `build_app(config, settings)` for any ASGI server."""
