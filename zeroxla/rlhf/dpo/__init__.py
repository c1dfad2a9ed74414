"""DPO / IPO on preference pairs: the policy's ZeRO step on a loss over per-sequence log-prob
sums against a frozen reference's (pairs padded or packed: zeroxla.rlhf.packed_pairs).

    losses.py      DPOConfig, the DPO / IPO losses over per-sequence log-prob sums, their
                   metrics (accuracy, margins) and the make_step loss_fn
    trainer.py     DPOTrainer (the policy's ZeRO step, reference sums computed once) and run_dpo
"""
