"""Scaling (issue 45): a config measured at several sizes of the cluster, and projected from one
size to another by the calibrated model. The stages: the sizes (:mod:`.sizes`), the measurements
(:mod:`.measure`), the projection (:mod:`autotune.guide.projection`, the model's), the summary (:mod:`.summary`) and the
study that ties them (:mod:`.study`); the output is :mod:`autotune.finish.scaling_output`'s."""
