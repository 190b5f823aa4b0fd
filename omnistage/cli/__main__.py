"""``python -m omnistage.cli``: the ``omnistage`` command."""

from omnistage.cli.main import main

main()
