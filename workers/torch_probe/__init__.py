"""The ``torch`` probe: a few real training steps (or an inference pass) of a Llama model under
exactly one trial's config, measured and reported through the probe protocol (docs/ARCHITECTURE.md).

Run as ``torchrun --nproc-per-node N -m autotune.workers.torch_probe TRIAL_FILE`` (see
``launch.torchrun_argv``), one process per device, on cpu (gloo), cuda (nccl) or npu (hccl).
Importing this package imports no torch: the driver uses ``launch`` without it, and the probe
sets the trial's environment before torch starts. See README.md in this folder.

Modules, one concern each: ``plan`` (resolve + validate a trial), ``_device`` (device, backend,
environment, threads), ``model`` (the Llama), ``parallelize`` (tp/cp/pp/recompute/compile/dp on
one DeviceMesh), ``zero1`` (ZeRO-1 for DTensor parameters), ``train`` and ``infer`` (the probes),
``measure`` (timing, statistics, memory, comm share), ``failures`` (exception → status),
``launch`` (torchrun argv), ``__main__`` (the entry point).
"""
