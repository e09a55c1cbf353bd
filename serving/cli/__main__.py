import sys

from serving.cli.dispatch import main

sys.exit(main())
