"""``python -m gradsync`` is the ``gradsync`` command."""

import sys

from gradsync.cli import main

sys.exit(main())
