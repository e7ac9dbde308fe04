"""`python -m kiln.entrypoints.cli ...` = the `kiln` console script."""

import sys

from kiln.entrypoints.cli.main import main

sys.exit(main())
