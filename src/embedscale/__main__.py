"""`python -m embedscale` (what `torchrun -m embedscale` runs)."""

from embedscale.cli import main

if __name__ == "__main__":
    main()
