"""``python -m sp_kpool.bench CASE [options]``: see :mod:`sp_kpool.bench`."""

import sys

from .cli import main

sys.exit(main())
