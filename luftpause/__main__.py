"""`python -m luftpause` is the `luftpause` command."""

from luftpause.cli import main

main()
