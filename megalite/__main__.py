import sys

from megalite.cli import main

sys.exit(main())
