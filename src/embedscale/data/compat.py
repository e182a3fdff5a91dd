"""Does a dataset fit a trained model? The difference in words, before ``load_state_dict`` fails.

A checkpoint's manifest lists its tables and their rows (``tables``, ``table_rows``); the tables a run
would build for another dataset follow from that dataset (``assemble.tables_for``). When they differ, the
model cannot score the data: ``mismatch`` names the tables only one side has and the tables whose rows
differ (a file converted with its own vocabulary instead of ``--vocab-from`` the training dataset), and
the dense features when both sides' are known.
"""

from __future__ import annotations

from embedscale.errors import InputError


def describe(trained: dict[str, int], given: dict[str, int], trained_dense: list[str] | None = None,
             given_dense: list[str] | None = None) -> list[str]:
    """The differences between the trained model's tables (name -> rows) and dense features and the data's."""
    out = []
    only_t = [n for n in trained if n not in given]
    only_g = [n for n in given if n not in trained]
    if only_t:
        out.append(f"tables only the model has: {', '.join(only_t[:10])}" + (" ..." if len(only_t) > 10 else ""))
    if only_g:
        out.append(f"tables only the data has: {', '.join(only_g[:10])}" + (" ..." if len(only_g) > 10 else ""))
    rows = [f"{n} {trained[n]:,} vs {given[n]:,}" for n in trained if n in given and trained[n] != given[n]]
    if rows:
        out.append(f"table rows differ (model vs data): {'; '.join(rows[:8])}" + (" ..." if len(rows) > 8 else ""))
    if trained_dense is not None and given_dense is not None and list(trained_dense) != list(given_dense):
        out.append(f"dense features differ: the model's {len(trained_dense)} ({', '.join(trained_dense[:6])}"
                   f"{' ...' if len(trained_dense) > 6 else ''}) vs the data's {len(given_dense)} "
                   f"({', '.join(given_dense[:6])}{' ...' if len(given_dense) > 6 else ''})")
    return out


def check_fits(checkpoint, checkpoint_manifest: dict, given: dict[str, int], data_dir,
               trained_dense: list[str] | None = None, given_dense: list[str] | None = None) -> None:
    """An ``InputError`` naming every difference when the data at ``data_dir`` does not fit the checkpoint."""
    names, rows = checkpoint_manifest.get("tables"), checkpoint_manifest.get("table_rows")
    trained = dict(zip(names, rows)) if names and rows and len(names) == len(rows) else None
    diff = describe(trained if trained is not None else given, given, trained_dense, given_dense)
    if diff:
        raise InputError(f"{data_dir} does not fit the model of {checkpoint}: " + "; ".join(diff)
                         + ". Encode new files with the training data's vocabulary: embedscale data ... "
                           "--vocab-from TRAINING_DATASET")
