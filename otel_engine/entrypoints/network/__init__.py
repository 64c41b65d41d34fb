"""The HTTP edge's network room: the server (uvicorn, drain, exit on engine death),
connections and their limits, the access log, the admission guard, request bodies, the
transport of server-sent events, HTTP tracing and error bodies. Nothing here knows the
OpenAI API's shapes: the app hands in what the room needs of them."""
