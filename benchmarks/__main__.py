import sys

from compile_engine.benchmarks.cli import main

sys.exit(main())
