"""The batch lane: OpenAI's Files and Batches APIs over a durable queue of request lines.

``model`` holds the pure parts (states, the Batch object, JSONL checks, result lines),
``pacing`` the scheduling arithmetic, ``store`` the durable queue (SQLite or PostgreSQL),
``runner`` the loop that runs lines through the router's own request path, ``api`` the
HTTP handlers.
"""
