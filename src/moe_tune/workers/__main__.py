"""`python -m moe_tune.workers [--setup module:function]`: one worker process (`worker.py`)."""

import sys

# Serve from the module as imported (not `__main__`), so that `progress` and `shared`, called by the requests'
# functions through `moe_tune.workers`, see this worker's streams and payload.
from moe_tune.workers.worker import main

main(sys.argv[1:])
