"""Launch-ready forms of a chosen config: autotune's own YAML and env file, and each stack's launch.

``autotune export RUN_OR_SPEC --format megatron,deepspeed,mindformers,torchtitan,vllm,mindie,env,yaml``
(or ``all``). A training study's launches are Megatron-LM/MindSpeed-LLM, DeepSpeed, torchtitan and
MindFormers; a serving study's are vLLM / vLLM-Ascend (``serve_vllm.sh``) and MindIE
(``mindie_config.json``); each refuses a study of the other kind (``Exporter.launches``).
Each exporter is an :class:`Exporter`: a name, a file name and ``render(context)``; the
implementations live in private modules, and each stack's descriptor (:mod:`autotune.stacks`) holds
the one that launches it; :mod:`autotune.finish.exports` puts them together (``EXPORTERS``: yaml, env and
the registered stacks' exporters) above both, so the formats never import the stacks. Every file
starts with the same header (in the file format's comment syntax, or an ``_autotune`` key in JSON):
study, trial, whether the numbers were measured (and on what) or predicted by the simulator, the
metrics, the software the probe saw (torch / torch_npu / CANN / MindSpore / driver versions), and
each value the evidence did not choose (a knob the model could not tell apart: "not chosen by
evidence ...; probe to choose"), so a file found later explains itself. Every sentence about the
numbers takes its wording from :class:`ExportContext` (``ctx.how``, ``ctx.provenance``): a
simulated number is never said to be measured.
"""

from __future__ import annotations

from ._base import ExportContext, Exporter, ExportRefused, header_fields, header_lines
from ._env import EnvExporter
from ._megatron import megatron_args
from ._yaml import YamlExporter

__all__ = [
    "Exporter",
    "ExportContext",
    "ExportRefused",
    "EnvExporter",
    "YamlExporter",
    "header_lines",
    "header_fields",
    "megatron_args",
]
