import sys

from launch.commands.cli import main

sys.exit(main())
