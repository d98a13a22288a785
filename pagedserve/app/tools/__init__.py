"""Tool calling on /v1/chat/completions: request plan (plan.py), prompt (prompt.py), output
parsers (json_scan.py, calls.py, parsers.py) and the response shapes (output.py)."""
