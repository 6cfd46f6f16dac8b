"""``python -m meridian`` runs the CLI."""

import sys

from meridian.cli import main

sys.exit(main())
