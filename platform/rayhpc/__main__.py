"""`python -m rayhpc ...`: the `rayhpc` command."""

from rayhpc.cli import main

main()
