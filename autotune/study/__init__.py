"""The study: the loop (:mod:`.search`) and one trial, top to bottom (:mod:`.trial_run`: ask -> resolve
(:mod:`.trial_resolve`) -> [memory profile, :mod:`.profiling`] -> dispatch -> interpret
(:mod:`.interpret`) -> tell -> listeners (:mod:`.listeners`)); the stop conditions, pruning, requeues;
the set-up before the first trial (:mod:`.plan`, :mod:`.host_profile`, :mod:`.usable_memory`,
:mod:`.definition`); Optuna storage, the run lock and the result cache; and what a study has found,
read back from storage (:mod:`.records`, :mod:`.result`, :mod:`.recommend`, :mod:`.importance`).

The middle of the data flow: it asks the guide (:mod:`autotune.guide`) and hands trials to the
dispatcher (:mod:`autotune.dispatch`) it is given; it never imports tracking (MLflow is a listener).
"""
