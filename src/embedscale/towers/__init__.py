"""Disaggregated Multi-Tower (DMT, Luo et al., MLSys 2024): tower modules, the tower partitioner and a
cluster simulator. The tower transform itself is ``embedscale.comm.hierarchical``; the models are
``embedscale.models.dmt``."""
