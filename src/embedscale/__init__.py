"""embedscale: embedding tables too large or too skewed for plain data parallelism.

One flow (see ARCHITECTURE.md): data -> profile -> plan -> build -> train/infer -> report.
"""

__version__ = "0.1.0"
