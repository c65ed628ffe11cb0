"""``python -m maxtext_nvfp4 COMMAND ...``: the same as the ``maxtext-nvfp4`` command."""

import sys

from maxtext_nvfp4.tools.cli import main

sys.exit(main())
