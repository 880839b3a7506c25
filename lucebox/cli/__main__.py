"""`python -m lucebox.cli`: the `lucebox` command."""

import sys

from lucebox.cli import main

if __name__ == "__main__":  # not when a package walk imports this module
    sys.exit(main())
