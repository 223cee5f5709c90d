"""`python -m posttrain.registry ...`: see `posttrain.registry.cli`."""

import sys

from posttrain.registry.cli import main

sys.exit(main())
