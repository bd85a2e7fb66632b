"""CLI commands, one module per area."""
