"""The HTTP edge's OpenAI surface: the request and response types, serving (from a request
to the engine and back), rendering of completions, chat and Responses, logprobs, the chat
template and the OpenAPI document."""
