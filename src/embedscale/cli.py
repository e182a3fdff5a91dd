"""Command-line interface (placeholder until the trainer lands)."""

import click


@click.group()
def main() -> None:
    """embedscale: train and serve recommendation models with large, skewed embedding tables."""
