"""Bridges to training frameworks; each imports its framework only when used.

* :mod:`secondorder.integrations.lightning`: train a PyTorch Lightning
  ``LightningModule`` with :class:`~secondorder.lm.LevenbergMarquardt` through manual
  optimization (``pip install 'secondorder[lightning]'``).
"""
