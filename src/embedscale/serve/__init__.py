"""Serving what was trained: ``export`` (a checkpoint -> a self-contained model directory), ``quantize``
(FP16 / INT8 / INT4 row-wise tables), ``encode`` (raw rows -> model inputs as in training), ``predict``
(load an export, score rows and files) and ``server`` (the HTTP prediction server). Only ``export`` reads
training state (a checkpoint); the rest reads exports."""
