"""The ``mindspore`` probe: a few real training steps of a Llama decoder in MindSpore under one
trial's mode, jit level, graph-kernel flags, recompute, precision and micro-batch, reported
through the probe protocol (docs/ARCHITECTURE.md). See README.md in this folder.

The probe runs in MindSpore's own environment (``backend.python``), so ``probe.py`` and
``model.py`` import only the standard library, numpy and MindSpore; this package's ``launch``
(for the dispatcher) imports neither.
"""
