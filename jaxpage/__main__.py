"""`python -m jaxpage ...`: the same as the `jaxpage` command."""

import sys

from jaxpage.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
