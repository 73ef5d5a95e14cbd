import sys

from leapfrog.cli import main

if __name__ == "__main__":      # not again in a spawned process (tensor-parallel ranks)
    sys.exit(main())
