"""The HTTP edge's OpenAI surface: the app and its routes, the request and response types,
serving (from a request to the engine and back), rendering of completions, chat and
Responses, logprobs and the OpenAPI document. Chat messages become prompt ids in
`engine/chat.py`, which `LLM` shares."""
