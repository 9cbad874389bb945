import sys

from compile_engine.cli import main

sys.exit(main())
