"""HTTP entry points: the OpenAI-compatible API server (`api_server`), wired from three rooms:
`network` (the server, connections, guard, bodies), `openai` (the app, request and response
types, serving, rendering) and `tools`. `otel_engine.cli` starts it; nothing here is imported
by the engine itself."""
