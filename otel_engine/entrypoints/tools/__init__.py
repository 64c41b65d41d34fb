"""Tool calls: the format a model writes its calls in, the prompt and the grammar a request
with tools gets (plan.py), and the parser that reads the calls out of the text
(parser.py)."""
