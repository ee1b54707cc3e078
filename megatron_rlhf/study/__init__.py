"""``study``: the paper's claims measured in a text world with a known gold reward.

world.py (tasks, gold reward, Bradley-Terry labels) -> stages.py (each stage one real command,
in-process) -> run.py (the ``study`` command and its layout) -> stats.py (results.json as a
pure function of the raw records) -> report.py (report.md and the PNGs). presets.py sizes it.
"""
