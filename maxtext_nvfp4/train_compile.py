"""``python -m maxtext_nvfp4.train_compile RECIPE compile_topology=TOPOLOGY [key=value ...]``: the documented entry point.

The implementation is :mod:`maxtext_nvfp4.tools.train_compile`.
"""

import sys

from maxtext_nvfp4.tools.train_compile import cli_main

if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
