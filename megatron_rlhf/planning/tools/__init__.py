"""The planner's tools, above training in the package order: ``cli`` (``tools/plan_parallelism.py``,
which writes a ``train-ppo`` config), ``sweep`` (``tools/scaling_study.py``) and ``study``, which
builds real models and measures what ``planning/memory.py`` predicts."""
