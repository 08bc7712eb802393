"""Accelerator lowerings of the one fold: kernels that compute what the engine's XLA loop
computes, for the folds they serve, chosen by :meth:`foldax._engine.Fold.expand`.

``tpu/``: Pallas kernels for the TPU (tested on a CPU in Pallas' interpret mode).
"""
