"""``conductor gateway``: the OpenAI-compatible HTTP front door (see README.md here)."""
