"""Load an export and score rows with it: :func:`load_export`, :class:`ServedModel`, ``embedscale predict``.

Serving reads an export directory only (``serve.export``): the dense model is rebuilt from the manifest's
config (``models.build_model``) around :class:`ServedEmbedding`, which looks features up in their tables'
served form: the float32 tables in one :class:`~embedscale.embedding.local.LocalEmbeddingBags` (the training
lookup, so an FP32 export scores bit for bit as the trained model), the FP16 / INT8 / INT4 ones (and, with
shared memory-mapped tables, the FP32 ones) all in one fused pooled lookup (``serve.quantize.pooled_lookup_many``). Nothing here imports the training code.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from embedscale.data.batch import JaggedFeatures
from embedscale.data.metrics import binary_metrics
from embedscale.device import HOST
from embedscale.embedding.local import LocalEmbeddingBags
from embedscale.errors import FormatError, InputError
from embedscale.io import read_json
from embedscale.models import build_model
from embedscale.serve.encode import Encoded, RowEncoder, read_file
from embedscale.serve.quantize import pooled_lookup_many, quant_ops, row_bytes
from embedscale.serve.tt_tables import tt_module, tt_pool
from embedscale.specs import ModelConfig, TableSpec

EXPORT_FORMAT, EXPORT_VERSION, EXPORT_MANIFEST = "embedscale.export", 1, "export.json"
EMBEDDING_PREFIX = "sparse_arch.embedding."


class ServedEmbedding(nn.Module):
    """The export's tables in their served forms; ``forward(JaggedFeatures) -> [B, sum of dims]`` with the
    features in table order (the trained embedding's order)."""

    def __init__(self, tables: list[dict], stored: dict[str, torch.Tensor], shared: bool = False,
                 tt: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.tables = tables
        tt_tables = [t for t in tables if t["form"] == "tt"]  # served as cores (serve.tt_tables)
        self.tt = nn.ModuleDict({t["name"]: tt_module(t, tt or {}) for t in tt_tables})
        self._reorder = {t["name"]: (tt or {}).get(f"reorder.{t['name']}") for t in tt_tables}
        self.feature_names = [f for t in tables for f in t["features"]]
        self._dims = {f: t["dim"] for t in tables for f in t["features"]}
        self._of = {f: t for t in tables for f in t["features"]}
        tables = [t for t in tables if t["form"] != "tt"]  # row tables: fp32 (LocalEmbeddingBags) or stored
        fp32 = [t for t in tables if t["form"] == "fp32" and not shared]  # shared: every table read in place
        self.rows = None
        if fp32:
            specs = [TableSpec(t["name"], t["num_rows"], t["dim"], list(t["features"]), t["pooling"]) for t in fp32]
            self.rows = LocalEmbeddingBags(specs, optimizer=None, seed=0, validate=True)
            self.rows.requires_grad_(False)
            with torch.no_grad():
                for t in fp32:
                    self.rows.table_weight(t["name"]).copy_(stored[t["name"]])
        # not shared: the quantized rows copied out of the file's mapping into the process's own memory
        self.stored = {t["name"]: stored[t["name"]] if shared else stored[t["name"]].clone()
                       for t in tables if t["form"] != "fp32" or shared}
        self._form = {t["name"]: t["form"] for t in tables}
        self._dim = {t["name"]: t["dim"] for t in tables}
        self.use_kernel = True  # the fused quantized lookup when built (tests compare it against the other path)

    def set_table(self, name: str, stored: torch.Tensor, form: str) -> None:
        """Serve ``name`` (a table read in place, ``shared``) from ``stored`` rows of ``form`` from now on."""
        if name not in self.stored:
            raise KeyError(f"table {name!r} is not served from stored rows here")
        self.stored[name], self._form[name] = stored, form

    def forward(self, jf: JaggedFeatures) -> torch.Tensor:
        cols: dict[str, torch.Tensor] = {}
        if self.rows is not None:
            out = self.rows(jf.select(self.rows.feature_names))
            for f, part in zip(self.rows.feature_names, torch.split(out, self.rows.feature_dims, dim=1)):
                cols[f] = part
        if self.stored:
            whole = self._pool_stored(jf, cols)
            if whole is not None:
                return whole
        if len(self.tt):
            self._pool_tt(jf, cols)
        return torch.cat([cols[f] for f in self.feature_names], dim=1)

    def _pool_tt(self, jf: JaggedFeatures, cols: dict[str, torch.Tensor]) -> None:
        """Every feature of a TT table, pooled from its cores (EL-Rec's Eff-TT forward)."""
        starts = np.concatenate([[0], np.cumsum(jf.length_per_key_list())])
        B = jf.batch_size
        for k, f in enumerate(jf.keys):
            t = self._of.get(f)
            if t is None or t["name"] not in self.tt:
                continue
            offsets = torch.zeros(B + 1, dtype=torch.int64)
            torch.cumsum(jf.lengths[k * B:(k + 1) * B], 0, out=offsets[1:])
            w = jf.weights[starts[k]:starts[k + 1]] if jf.weights is not None else None
            cols[f] = tt_pool(self.tt[t["name"]], self._reorder[t["name"]], t, f,
                              jf.values[starts[k]:starts[k + 1]], offsets, w)

    def _pool_stored(self, jf: JaggedFeatures, cols: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Every feature of a stored (non-fp32, or shared) table in one fused lookup, its columns into ``cols``;
        returns the lookup's output itself when it holds every feature in ``feature_names`` order (no copy)."""
        lpk = jf.length_per_key_list()
        B = jf.batch_size
        names = list(self.stored)
        tables = [(self.stored[n], self._form[n], self._dim[n]) for n in names]
        index = {n: i for i, n in enumerate(names)}
        offsets = torch.zeros(len(jf.keys), B + 1, dtype=torch.int64)  # every feature's offsets in one cumsum
        torch.cumsum(jf.lengths.view(len(jf.keys), B), 1, out=offsets[:, 1:])
        offsets = offsets.unbind(0)
        values = torch.split(jf.values, lpk)
        weights = torch.split(jf.weights, lpk) if jf.weights is not None else [None] * len(lpk)
        features, order = [], []
        for k, f in enumerate(jf.keys):
            t = self._of.get(f)
            if t is None or t["name"] not in self.stored:
                continue
            features.append((index[t["name"]], values[k], offsets[k], t["pooling"], weights[k]))
            order.append(f)
        kernel = self.use_kernel and quant_ops() is not None
        if not kernel:  # the PyTorch path checks nothing itself
            self._check_ids(jf, lpk)
        try:  # the kernel checks every id against its table; a row outside is then named here
            out = pooled_lookup_many(tables, features, B, use_kernel=kernel)
        except RuntimeError:
            self._check_ids(jf, lpk)
            raise
        if order == self.feature_names:
            return out
        for f, part in zip(order, torch.split(out, [self._dims[f] for f in order], dim=1)):
            cols[f] = part
        return None

    def _check_ids(self, jf: JaggedFeatures, lpk: list[int]) -> None:
        """Every id of a stored table's feature within its table's rows, checked over all features at once."""
        rows = [self._of[f]["num_rows"] if f in self._of and self._of[f]["name"] in self.stored else -1
                for f in jf.keys]
        if not jf.values.numel():
            return
        bound = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lpk))
        bad = ((jf.values < 0) | (jf.values >= bound)) & (bound >= 0)
        if bool(bad.any()):
            k = int(torch.searchsorted(torch.tensor(lpk).cumsum(0), int(bad.nonzero()[0, 0]), right=True))
            f = jf.keys[k]
            raise InputError(f"feature {f!r}: row id outside table {self._of[f]['name']!r} [0, {rows[k]})")


DENSE_PRECISIONS = ("fp32", "bf16", "int8")


class ServedModel:
    """An export loaded: ``manifest``, ``version``, ``encoder`` (raw rows -> inputs), ``model`` (eval mode),
    ``dense`` (the dense model's precision: :meth:`set_dense`)."""

    def __init__(self, manifest: dict, model: nn.Module, encoder: RowEncoder, path: Path):
        self.manifest, self.model, self.encoder, self.path = manifest, model, encoder, path
        self.version = manifest["model_version"]
        self.dense = "fp32"

    def set_dense(self, precision: str) -> None:
        """Compute the dense model (MLPs, interaction) in ``precision``: ``fp32`` (as trained: an FP32 export
        scores bit for bit as the trained model), ``bf16`` (autocast: the Linear layers and the interaction's
        matrix products in bfloat16, weights kept in float32) or ``int8`` (dynamic quantization of the Linear
        layers in place: INT8 weights per tensor, activations quantized per batch, FBGEMM's CPU kernels). The
        tables are untouched. Numbers change with bf16 and int8: their eval AUC is measured
        (``benchmarks/bench_serve_quality.py``)."""
        if precision not in DENSE_PRECISIONS:
            raise InputError(f"dense precision {precision!r}: one of {', '.join(DENSE_PRECISIONS)}")
        if self.dense == "int8" and precision != "int8":
            raise InputError("the dense model is INT8 already: load the export again for another precision")
        if precision == "int8" and self.dense != "int8":
            import warnings

            from torch.ao.quantization import quantize_dynamic

            torch.backends.quantized.engine = "fbgemm"
            with warnings.catch_warnings():  # torch.ao's eager quantization is deprecated for torchao's, not gone
                warnings.simplefilter("ignore")
                quantize_dynamic(self.model, {nn.Linear}, dtype=torch.qint8, inplace=True)
        self.dense = precision

    def autocast(self):
        """The context the dense model runs in (bfloat16 autocast for ``bf16``, else nothing)."""
        import contextlib

        if self.dense == "bf16":
            return torch.autocast(HOST.type, dtype=torch.bfloat16)  # a served model runs in host memory
        return contextlib.nullcontext()

    @torch.inference_mode()
    def logits(self, enc: Encoded) -> torch.Tensor:
        """The model's logits ``[N]`` for encoded rows."""
        if enc.rows == 0:
            return torch.zeros(0)
        with self.autocast():
            return self.model(enc.dense, enc.sparse).float()

    def predict_rows(self, rows: list[dict]) -> list[float]:
        """Probabilities of raw JSON rows (checked: a bad row is a ``RequestError`` naming row and feature)."""
        return torch.sigmoid(self.logits(self.encoder.encode_rows(rows))).tolist()


def read_manifest(path: Path) -> dict:
    f = path / EXPORT_MANIFEST
    if not f.is_file():
        raise FormatError(f"{path}: not a model export (no {EXPORT_MANIFEST}; make one with embedscale export)")
    m = read_json(f, "export manifest")
    if not isinstance(m, dict) or m.get("format") != EXPORT_FORMAT:
        raise FormatError(f"{f}: not an embedscale export")
    if m.get("version") != EXPORT_VERSION:
        raise FormatError(f"{f}: export version {m.get('version')} is not {EXPORT_VERSION} (made by another release)")
    return m


def load_export(path: str | Path, shared: bool = False) -> ServedModel:
    """An export directory -> a :class:`ServedModel` (weights read with safetensors: no code runs on load);
    a missing tensor or one of another shape is a ``FormatError`` naming it. safetensors maps the file into
    memory; ``shared``: every table is read in place from that mapping (processes that load one export share its
    pages; FP32 tables then pool by the dequantise-then-pool path instead of a ``LocalEmbeddingBags`` copy:
    the same values, and for one-hot bags the same bits). Not shared, every table is copied into the process's
    own memory (rows read at random from the file's mapping cost a full-size server a quarter more CPU a request,
    in every thread)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    m = read_manifest(path)
    file = path / m.get("weights", "weights.safetensors")
    try:
        w = load_file(str(file))
    except (OSError, SafetensorError) as e:
        raise FormatError(f"{path}: the weights cannot be read ({e})") from None
    stored = {}
    for t in m["tables"]:
        if t["form"] == "tt":  # its cores and reordering: serve.tt_tables
            continue
        key = f"table.{t['name']}"
        if key not in w:
            raise FormatError(f"{path}: no tensor {key!r} in the weights")
        want = (t["num_rows"], t["dim"]) if t["form"] in ("fp32", "fp16") else (t["num_rows"], row_bytes(t["form"], t["dim"]))
        if tuple(w[key].shape) != want:
            raise FormatError(f"{path}: {key} has shape {tuple(w[key].shape)}, the manifest says {want}")
        stored[t["name"]] = w[key]
    specs = [TableSpec(t["name"], t["num_rows"], t["dim"], list(t["features"]), t["pooling"]) for t in m["tables"]]
    emb = ServedEmbedding(m["tables"], stored, shared,
                          tt={k: v for k, v in w.items() if k.startswith(("tt.", "reorder."))})
    torch.manual_seed(0)
    model = build_model(ModelConfig(**m["model"]), specs, int(m["num_dense"]), embedding=emb)
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(EMBEDDING_PREFIX)}
    dense = {k[len("dense."):]: v for k, v in w.items() if k.startswith("dense.")}
    # an export written before the logit calibration predicts uncalibrated (the map's identity)
    own = {k: v for k, v in own.items() if k in dense or not k.endswith(("calibration.scale_shift", "calibration.tail"))}
    for k, v in own.items():
        if k not in dense:
            raise FormatError(f"{path}: no tensor 'dense.{k}' in the weights")
        if tuple(dense[k].shape) != tuple(v.shape):
            raise FormatError(f"{path}: dense.{k} has shape {tuple(dense[k].shape)}, the model's {tuple(v.shape)}")
    model.load_state_dict({k: dense[k].clone() for k in own}, strict=False)
    model.eval()
    vocab = {k[len("vocab."):]: v.numpy() for k, v in w.items() if k.startswith("vocab.")}
    return ServedModel(m, model, RowEncoder(m["encoding"], vocab), path)


def predict_file(export_dir: str | Path, data: str | Path, out: str | Path, batch_rows: int = 65536,
                 dense: str = "fp32") -> dict:
    """Score every row of ``data`` (a file of the export's schema, labeled or not) into ``out`` (Parquet:
    ``probability``, ``logit`` and, labeled, ``label``; written to a temporary file, then renamed), the dense
    model in precision ``dense`` (:meth:`ServedModel.set_dense`). Returns ``{rows, labeled, model_version}``
    and, labeled, the figures of ``data.metrics.binary_metrics``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    served = load_export(export_dir)
    served.set_dense(dense)
    logits, labels = [], []
    labeled = True
    for enc in read_file(served.encoder, data, batch_rows):
        logits.append(served.logits(enc).numpy())
        labeled = labeled and enc.labels is not None
        if enc.labels is not None:
            labels.append(enc.labels)
    z = np.concatenate(logits) if logits else np.zeros(0, np.float32)
    cols = {"probability": 1.0 / (1.0 + np.exp(-z.astype(np.float64))), "logit": z}
    result = {"rows": int(z.size), "labeled": bool(labeled and logits), "model_version": served.version}
    if result["labeled"]:
        y = np.concatenate(labels)
        cols["label"] = y
        result.update(binary_metrics(y, z))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(pa.table(cols), tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return result


__all__ = ["DENSE_PRECISIONS", "ServedEmbedding", "ServedModel", "load_export", "predict_file", "read_manifest"]
