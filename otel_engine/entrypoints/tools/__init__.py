"""Tool calls: what a request says about tools (request.py, base.py), the formats model
families write calls in (format.py: one `ToolFormat` class per format in formats/, and their
registry), one request's prompt, grammar and parsers (plan.py, grammar.py), and the parser
that reads the calls out of the text (parser.py over json_scan.py, giving calls.py's
types)."""
