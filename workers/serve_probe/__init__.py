"""The serving probe: a real inference engine (vLLM, vLLM-Ascend, MindIE) under real load.

``python -m autotune.workers.serve_probe`` with ``AUTOTUNE_TRIAL_FILE`` set, and ``engine.json``
(the engine's own launch, rendered by the serving stack preset) beside the trial file. It starts
the engine's replicas, drives open-loop traffic at the rates the rate search picks, and reports
goodput at the SLO with the latencies and the engine's own metrics (docs/ARCHITECTURE.md, "The
probe protocol"; the metric definitions are objectives/serving.py). One module per job:

- ``engine``: start, health-check and stop the replicas (process groups, the engine's own
  failure words);
- ``traffic``: when each request is sent and what it asks for (seeded, open loop);
- ``client``: the asyncio streaming client and the least-outstanding-requests balancer;
- ``prom``: the engine's Prometheus ``/metrics``;
- ``rates``: the rate search (the ladder seeds a bracket, bisected to ``workload.rate_tolerance``);
- ``probe``: the run, its protocol lines and ``requests.jsonl``;
- ``failure``: how a run fails (status and reason).

Like every probe it imports nothing of the driver (it runs on worker nodes): the standard library,
numpy, aiohttp and prometheus_client.
"""
