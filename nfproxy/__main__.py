"""`python -m nfproxy`: the same as the `nfproxy` command."""

import sys

from nfproxy.cli.main import main

sys.exit(main())
