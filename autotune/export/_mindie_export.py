"""The ``mindie`` format: MindIE's launch of a tuned serving config.

An aggregated config (every instance runs both phases) is a ``config.json`` fragment
(``mindie_config.json``, :mod:`._mindie`: only the keys the trial sets, merged into a team's
config.json); a disaggregated one is MindIE's PD separation, MindIE-Motor's deploy input
(``mindie_pd_user_config.json``, :mod:`._mindie_pd`).
"""

from __future__ import annotations

from typing import Any

from ..workers.parameters import value as param
from ._base import ExportContext, Exporter, header_fields, json_text, longest_lengths
from ._mindie import MINDIE_KEYS, MINDIE_WRITTEN, mindie_env, mindie_settings, setting_where, weights_note
from ._mindie_pd import PD_FILE_MODE, PD_FILENAME, render_pd

__all__ = ["MindIEExporter"]


def _disaggregated(config: dict[str, Any]) -> bool:
    return param(config, "prefill_replicas") > 0


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
        )
        tp = param(config, "tp")
        replicas = param(config, "replicas")
        header = header_fields(ctx, {**MINDIE_WRITTEN, **engine})
        header["merge"] = (
            "merge into your MindIE config.json (MindIE-LLM 3.0.0.beta.1 keys): mappings key by key, "
            "ModelConfig[0] key by key, a null value removes the key (plugin_params: null = no plugin)"
        )
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
