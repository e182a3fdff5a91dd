"""`python -m embedscale` (what `torchrun -m embedscale` runs)."""

from embedscale.cli import _fail, main
from embedscale.errors import EmbedscaleError
from embedscale.train.launch import follow_node_rank

if __name__ == "__main__":
    try:
        follow_node_rank()  # a multi-node launch's ranks numbered by --node-rank, before anything reads them
    except EmbedscaleError as e:  # one line and exit 2, as every command's user error
        _fail(e)
    main()
