"""``python -m maxtext_nvfp4.sft RECIPE.yml [key=value ...]``: MaxText's SFT with the plugin registered.

The implementation is :mod:`maxtext_nvfp4.tools.posttrain` (also ``maxtext-nvfp4 sft``).
"""

import sys

from maxtext_nvfp4.tools.posttrain import sft_main as cli_main

if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
