"""`python -m ddplaunch` is the `ddplaunch` command."""

from ddplaunch.cli import main

main()
