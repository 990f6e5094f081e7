"""`python -m molt ...` is the `molt` command."""
from molt.cli import main

main()
