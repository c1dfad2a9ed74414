"""`python -m zeroxla ...` runs the `zeroxla` command (see zeroxla/cli.py)."""

import sys

from zeroxla.app.cli import main

sys.exit(main())
