r"""``python -m parallel_modules``: the benchmark (see :mod:`parallel_modules.bench`)."""

import sys

from .bench import main

sys.exit(main())
