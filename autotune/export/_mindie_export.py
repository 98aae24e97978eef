"""The ``mindie`` format: MindIE's launch of a tuned serving config.

An aggregated config (every instance runs both phases) is a ``config.json`` fragment
(``mindie_config.json``, :mod:`._mindie`: only the keys the trial sets, merged into a team's
config.json); a disaggregated one is MindIE's PD separation, MindIE-Motor's deploy input
(``mindie_pd_user_config.json``, :mod:`._mindie_pd`). An aggregated instance wider than a node is
MindIE's multi-node inference: the fragment every node of it merges, and in its header the rank
table each instance's nodes share and how each node starts (:func:`_multinode_header`).
"""

from __future__ import annotations

from typing import Any

from ..workers.parameters import instance_nodes, value as param
from ._base import ExportContext, Exporter, header_fields, json_text, longest_lengths
from ._mindie import (
    MINDIE_KEYS,
    MINDIE_WRITTEN,
    MULTINODE_DOC,
    mindie_env,
    mindie_settings,
    rank_table,
    setting_where,
    weights_note,
)
from ._mindie_pd import PD_FILE_MODE, PD_FILENAME, hardware_type, render_pd

__all__ = ["MindIEExporter"]


def _disaggregated(config: dict[str, Any]) -> bool:
    return param(config, "prefill_replicas") > 0


def _node_devices(ctx: ExportContext) -> int:
    return int(ctx.cluster.get("devices_per_node") or 0)


def _instance_nodes(ctx: ExportContext) -> int:
    """The nodes one aggregated instance takes (1: within a node)."""
    per = _node_devices(ctx)
    return int(instance_nodes(param(ctx.config, "tp"), per)) if per > 0 else 1


def _multinode_header(ctx: ExportContext, header: dict[str, Any]) -> None:
    """How the instances across nodes start, as MindIE's docs run multi-node inference
    (MindIE-LLM 5e896196 docs/zh/user_guide/user_manual/prefill_decode_mixed_deployment.md): on
    every node of an instance the same config.json, ``RANK_TABLE_FILE`` (the instance's table, mode
    640, on each of its nodes), ``MIES_CONTAINER_IP`` (that node's address) and
    ``HCCL_DETERMINISTIC=true``, then the daemon; the node of rank 0 is the master and the only one
    that takes requests."""
    per, k, replicas = _node_devices(ctx), _instance_nodes(ctx), param(ctx.config, "replicas")
    header["launch"] = (
        f"{replicas} instance(s) of {k} nodes x {per} NPUs ({replicas * k} nodes): on every node of an instance, "
        "merge this fragment into the same MindIE config.json, set the env below, RANK_TABLE_FILE (the "
        "instance's rank_table, saved with mode 640 on each of its nodes) and MIES_CONTAINER_IP (the node's own "
        "address), then start mindieservice_daemon; requests go to each instance's master, the node with "
        f"rank_id 0 (the others take none) ({MULTINODE_DOC})"
    )
    header["env"] = {**mindie_env(ctx.config), "HCCL_DETERMINISTIC": "true"}
    header["replicas"] = [{"nodes": list(range(r * k, (r + 1) * k)), "master": r * k} for r in range(replicas)]
    header["rank_table"] = rank_table(k, per)
    header["rank_table_fill"] = (
        "one table per instance, node0 its master and the others in order: server_id and container_ip each "
        "node's address (the container's, or the host's under --net=host), device_ip each NPU's "
        "(hccn_tool -i <device_id> -ip -g)"
    )
    header["fill"] = (
        "interNodeTLSEnabled: MindIE's default is on (the gRPC certificates of security/grpc/ on every node); "
        "inside a trusted data centre it may be set false"
    )


class MindIEExporter(Exporter):
    name = "mindie"
    filename = "mindie_config.json"
    launches = "serve"
    engine_values = "json"  # engine.NAME -> a key of config.json: finite numbers only (strict JSON)

    def file_name(self, ctx: ExportContext) -> str:
        """A disaggregated config's file is MindIE-Motor's deploy input (:mod:`._mindie_pd`), not a
        config.json fragment."""
        return PD_FILENAME if _disaggregated(ctx.config) else self.filename

    def file_mode(self, ctx: ExportContext) -> int | None:
        return PD_FILE_MODE if _disaggregated(ctx.config) else None

    def unsupported(self, ctx: ExportContext) -> list[str]:
        """The stack's rules, and MindIE's multi-node inference on the hardware it supports: Atlas 800I
        A2 only (not A3) per its docs."""
        reasons = super().unsupported(ctx)
        nodes, hardware = _instance_nodes(ctx), hardware_type(ctx.cluster)
        if not _disaggregated(ctx.config) and nodes > 1 and hardware != "800I_A2":
            reasons.append(
                f"MindIE's multi-node inference (an instance over {nodes} nodes) runs on Atlas 800I A2 "
                f"only ({MULTINODE_DOC}, 使用限制), and this cluster's profile is {hardware}"
            )
        return reasons

    def render(self, ctx: ExportContext) -> str:
        config = ctx.config
        engine = {
            n: setting_where(n[len("engine.") :]) for n in config if n.startswith("engine.") and n[7:] in MINDIE_KEYS
        }
        if _disaggregated(config):
            return render_pd(ctx, {**MINDIE_WRITTEN, **{n: f"{where} (both pools)" for n, where in engine.items()}})
        prompt, output = longest_lengths(ctx.workload)
        fragment = mindie_settings(
            config,
            max_model_len=int(ctx.workload.get("max_model_len") or 0),
            max_prompt_len=prompt,
            max_output_len=output,
            model_name=str(ctx.model.get("name") or ""),
            weight_path=ctx.model.get("path"),
            devices_per_node=_node_devices(ctx),
        )
        tp = param(config, "tp")
        replicas = param(config, "replicas")
        header = header_fields(ctx, {**MINDIE_WRITTEN, **engine})
        header["merge"] = (
            "merge into your MindIE config.json (MindIE-LLM 3.0.0.beta.1 keys): mappings key by key, "
            "ModelConfig[0] key by key, a null value removes the key (plugin_params: null = no plugin)"
        )
        if _instance_nodes(ctx) > 1:
            _multinode_header(ctx, header)
        else:
            header["launch"] = (
                f"{replicas} mindieservice_daemon(s), one per replica, each with its own port, managementPort and "
                f"metricsPort, the env below, ASCEND_RT_VISIBLE_DEVICES as listed and npuDeviceIds [[0..{tp - 1}]]"
            )
            header["env"] = mindie_env(config)
            header["replicas"] = [
                {"ASCEND_RT_VISIBLE_DEVICES": ",".join(str(d) for d in range(k * tp, (k + 1) * tp))}
                for k in range(replicas)
            ]
        note = weights_note(config)
        if note:
            header["weights"] = note
        return json_text({"_autotune": header, **fragment}, indent=1, default=str) + "\n"
