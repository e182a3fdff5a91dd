"""``embedscale serve`` with TorchRec's quantized ``EmbeddingBagCollection`` in place of our served lookup: the
baseline of ``bench_serve.py``. The same export, the same dense model, the same HTTP stack and micro-batching;
only the tables' lookup differs: the export's tables (dequantised to float32) are handed to
``torchrec.quant.EmbeddingBagCollection.from_float`` with an INT8 weight qconfig, which quantizes them row-wise
with FBGEMM (the fused rows ours hold) and pools with FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen``.

    python benchmarks/_torchrec_serve.py EXPORT_DIR [serve options]     (one worker process)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.quantization as tq
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import embedscale.serve.predict as predict  # noqa: E402
from embedscale.serve.quantize import dequantize_rows  # noqa: E402


class TorchRecQuantEmbedding(nn.Module):
    """``ServedEmbedding``'s interface over TorchRec's quantized EmbeddingBagCollection (INT8 weights)."""

    def __init__(self, tables: list[dict], stored: dict[str, torch.Tensor], shared: bool = False, tt=None):
        super().__init__()
        if any(t["form"] == "tt" for t in tables):
            raise SystemExit("the TorchRec baseline serves row tables only, not TT cores")
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

        self.feature_names = [f for t in tables for f in t["features"]]
        configs = [EmbeddingBagConfig(name=t["name"], embedding_dim=t["dim"], num_embeddings=t["num_rows"],
                                      feature_names=list(t["features"]),
                                      pooling=PoolingType.MEAN if t["pooling"] == "mean" else PoolingType.SUM)
                   for t in tables]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        with torch.no_grad():
            for t in tables:
                ebc.embedding_bags[t["name"]].weight.copy_(dequantize_rows(stored[t["name"]], t["form"], t["dim"]))
        ebc.qconfig = tq.QConfig(activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
                                 weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8))
        self.qebc = QuantEmbeddingBagCollection.from_float(ebc)

    def forward(self, jf) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = KeyedJaggedTensor(keys=list(jf.keys), values=jf.values, lengths=jf.lengths.to(torch.int32),
                                weights=jf.weights)
        kt = self.qebc(kjt)
        return kt.values().to(torch.float32)


if __name__ == "__main__":
    predict.ServedEmbedding = TorchRecQuantEmbedding  # load_export builds the tables' lookup through this name
    from embedscale.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
