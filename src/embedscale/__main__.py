"""`python -m embedscale` (what `torchrun -m embedscale` runs)."""

import os

from embedscale.cli import _fail, main
from embedscale.errors import EmbedscaleError
from embedscale.train.launcher import NODE_RANK_ENV

if __name__ == "__main__":
    if NODE_RANK_ENV in os.environ:  # a rank of a multi-node launch; a launcher never imports torch (train.launcher)
        from embedscale.train.launch import follow_node_rank

        try:
            follow_node_rank()  # the ranks numbered by --node-rank, before anything reads them
        except EmbedscaleError as e:  # one line and exit 2, as every command's user error
            _fail(e)
    main()
