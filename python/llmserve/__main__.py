"""`python -m llmserve ...`: the `llmserve` command, for environments whose scripts folder is
not on PATH."""

import sys

from llmserve.cli import main

sys.exit(main())
