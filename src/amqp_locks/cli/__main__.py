"""`python -m amqp_locks.cli ...` runs the `amqp-locks` command."""

import sys

from . import main

sys.exit(main())
