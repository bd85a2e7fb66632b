"""``python -m conductor``: the same as the ``conductor`` command."""

from .cli import main

main()
