"""Pipelined training with a host-memory parameter server and a life-cycle embedding cache (EL-Rec, SC 2022,
section V): the tables whose form is ``host`` (``plan.forms.TableForm``) live in :class:`HostParameterServer`;
:class:`PipelinedEmbedding` presents them, with device-side tables, as one embedding module; :class:`PipelinedLoader` /
``train.trainer.pipelined_trainer`` prefetch host rows ``depth - 1`` batches ahead while the trainer computes, and
:class:`LifeCycleCache` patches the stale ones, so the result equals sequential training bit for bit.
"""

from embedscale.pipeline.cache import LifeCycleCache
from embedscale.pipeline.embedding import PipelinedEmbedding, select_features
from embedscale.pipeline.loop import Pipeline, PipelinedLoader
from embedscale.pipeline.queues import GradientBatch, HostRows, PipelineError, PrefetchedBatch
from embedscale.pipeline.server import HostParameterServer, aggregate_row_updates, apply_row_updates_

__all__ = [
    "GradientBatch",
    "HostParameterServer",
    "HostRows",
    "LifeCycleCache",
    "Pipeline",
    "PipelineError",
    "PipelinedEmbedding",
    "PipelinedLoader",
    "PrefetchedBatch",
    "aggregate_row_updates",
    "apply_row_updates_",
    "select_features",
]
