"""``python -m meshdsl``: the same command line as the ``meshdsl`` console script."""
import sys

from .tools.entry import main

sys.exit(main())
