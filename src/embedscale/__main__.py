"""`python -m embedscale` (what `torchrun -m embedscale` runs)."""

import sys

from embedscale.cli import main
from embedscale.errors import EmbedscaleError
from embedscale.train.launch import follow_node_rank

if __name__ == "__main__":
    try:
        follow_node_rank()  # a multi-node launch's ranks numbered by --node-rank, before anything reads them
    except EmbedscaleError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    main()
