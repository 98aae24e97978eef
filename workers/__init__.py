"""Probes: the programs (or, for ``simulate``, functions) that measure one trial.

Installed as ``autotune.workers``. Probes never import tracking, search or MLflow: they run on
worker nodes and know only their trial file (docs/ARCHITECTURE.md, "The probe protocol").
"""
