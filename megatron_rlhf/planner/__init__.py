"""The planner's command-line tools, above training in the package order (the pure cost model
they use is ``planning/``, which training/ checks memory with): ``cli``
(``tools/plan_parallelism.py``, which writes a ``train-ppo`` config), ``sweep``
(``tools/scaling_study.py``) and ``measure``, which builds real models and measures what
``planning/memory.py`` predicts."""
