"""``python -m autopar.cli``: the command line, as the ``autopar`` script runs it."""

import sys

from autopar.cli import main

sys.exit(main())
