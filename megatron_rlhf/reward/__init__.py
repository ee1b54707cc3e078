"""Reward Model (Eq. 1) and Advantage Model (Eqs. 5-8): losses, calibration, evaluation.

losses.py       pure RM / AM losses and the advantage of Eq. 8
calibration.py  pure accuracy, ECE (×100), reliability curve and per-task score statistics
evaluate.py     the ``eval-reward`` command (summary.json, summary.md, Fig. 2-4 style plots)
plots.py        the Fig. 2 / 3 / 4 style figures (matplotlib, Agg)
synthetic.py    a synthetic preference set that reproduces the paper's Fig. 4 mechanism
model.py        reading r and e_τ off the BLOOM trunk's scalar head (pure tensor ops)
config.py       the ``train-reward`` config and its checks
train.py        the ``train-reward`` command (RM or AM, any TP/PP/DP, exact resume): its
                batches, loss and evaluation in training/loop.py's loop
score.py        the ``score`` command (r, e_τ, a per response; or pairs for eval-reward)
"""
