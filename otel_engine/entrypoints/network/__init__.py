"""The HTTP edge's network room: connections and their limits, the access log, the admission
guard, request bodies, server-sent events, HTTP tracing and error bodies. Nothing here knows
the OpenAI API's shapes."""
