"""``python -m inspector``: the ``ckpt-inspect`` command line."""

import sys

from inspector.ui.cli import main

sys.exit(main())
