import sys

from leapfrog.cli import main

sys.exit(main())
