"""``conductor epp``: Conductor as the endpoint picker of the Gateway API Inference Extension (README.md)."""
