"""``python -m conductor``: the same as the ``conductor`` command."""

from conductor.cli import main

main()
