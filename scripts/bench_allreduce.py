#!/usr/bin/env python3
"""Same as `python -m ud_transport bench`; see --help."""
import sys

from ud_transport.lab.bench import main

if __name__ == "__main__":
    sys.exit(main())
