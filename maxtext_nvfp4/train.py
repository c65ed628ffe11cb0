"""``python -m maxtext_nvfp4.train RECIPE.yml [key=value ...]``: the documented entry point.

The implementation is :mod:`maxtext_nvfp4.tools.train`; this module keeps the command (and
``from maxtext_nvfp4.train import cli_main``) stable.
"""

import sys

from maxtext_nvfp4.tools.train import cli_main

if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
