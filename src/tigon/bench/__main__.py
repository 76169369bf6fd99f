import sys

from tigon.bench import main

sys.exit(main())
