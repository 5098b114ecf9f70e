#!/usr/bin/env python3
"""Load generator: same flags as `prfaas bench` (see prfaas_sgl/tools/loadgen/config.py).

Example (1/64-scale paper workload against a local server, 20 requests at 2 req/s):
    python scripts/loadgen.py --url http://127.0.0.1:30000 --scale 0.015625 --rate 2 \
        --num-sessions 20 --warmup 2 --out-dir /tmp/bench
"""

import sys

from prfaas_sgl.tools.loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
